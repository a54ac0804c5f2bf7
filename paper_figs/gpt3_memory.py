"""GPT-3 175B's memory per rank with Megatron's options, and without them.

Prints, for ``scenarios/gpt3_175b.yaml`` (tp 8, pp 8, interleaved, sequence
parallelism, selective recomputation, distributed optimizer), the memory of
every pipeline stage's rank, then the peak with each option switched off
alone and with all three off, and the error ``megatronapp run``/``predict``
gives when it does not fit. No simulation: memory is a closed form.

    python paper_figs/gpt3_memory.py
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatronapp.scenario.config import Scenario, load_scenario  # noqa: E402
from megatronapp.dpp.memory import MemoryExceeded  # noqa: E402
from megatronapp.dpp.static_memory import check_memory, stage_memory  # noqa: E402

SCENARIO = ROOT / "scenarios" / "gpt3_175b.yaml"
NO_SP = ["parallel.sequence_parallel=false"]
NO_RECOMPUTE = ["training.recompute=none"]
NO_DIST_OPT = ["training.distributed_optimizer=false", "training.overlap_param_gather=false"]
VARIANTS = {"all three on": [], "without sequence parallelism": NO_SP,
            "without selective recomputation": NO_RECOMPUTE,
            "without the distributed optimizer": NO_DIST_OPT,
            "all three off": NO_SP + NO_RECOMPUTE + NO_DIST_OPT}
COLUMNS = ("weights", "grads", "optimizer", "activations", "transient", "buffers", "total")


def peak_gb(s: Scenario) -> float:
    return max(m.total for m in stage_memory(s).values()) / 1e9


def main() -> int:
    s = load_scenario(SCENARIO)
    print("| stage | " + " | ".join(COLUMNS) + " |")
    print("|---:|" + "---:|" * len(COLUMNS))
    for pp, m in stage_memory(s).items():
        values = m.as_dict()
        print(f"| {pp} | " + " | ".join(f"{values[c] / 1e9:.2f}" for c in COLUMNS) + " |")
    print("\n| options | peak GB per rank | fits in 80 GB |\n|---|---:|---|")
    for name, sets in VARIANTS.items():
        v = load_scenario(SCENARIO, sets)
        print(f"| {name} | {peak_gb(v):.1f} | {'yes' if peak_gb(v) <= 80 else 'no'} |")
    try:
        check_memory(load_scenario(SCENARIO, VARIANTS["all three off"]))
    except MemoryExceeded as err:
        print(f"\nall three off: {err}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
