"""GPT-3 175B's memory per rank with Megatron's options, and without them.

For ``scenarios/gpt3_175b.yaml`` (tp 8, pp 8, interleaved, sequence
parallelism, selective recomputation, distributed optimizer) the memory of
every pipeline stage's rank, then the peak with each option switched off
alone and with all three off. No simulation: memory is a closed form (the
table ``megatronapp predict`` prints).

    python -m experiments.gpt3_memory
"""
from __future__ import annotations

import sys
from typing import Any

from experiments import results
from experiments.render import markdown_table
from megatronapp.dpp.static_memory import stage_memory
from megatronapp.scenario.config import Scenario, load_scenario

NAME = "gpt3_memory"
SCENARIO = results.ROOT / "scenarios" / "gpt3_175b.yaml"
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


def main(argv: list[str] | None = None) -> int:
    results.parser(NAME, __doc__).parse_args(argv)
    run = results.start(NAME, argv)
    s = load_scenario(SCENARIO)
    run.record({"stages": [m.as_dict() for m in stage_memory(s).values()],
                "device_gb": s.cluster.gpu.memory_gb,
                "variants": [{"options": name, "peak_gb": peak_gb(load_scenario(SCENARIO, sets))}
                             for name, sets in VARIANTS.items()]})
    print("\n".join(tables(results.read(NAME)).values()))
    return 0


def tables(doc: dict[str, Any]) -> dict[str, str]:
    data = doc["data"]
    stages = markdown_table(["stage", *COLUMNS], [
        [int(m["pp_rank"]), *(f"{m[c] / 1e9:.2f}" for c in COLUMNS)] for m in data["stages"]],
        "r" * (len(COLUMNS) + 1))
    device = data["device_gb"]
    variants = markdown_table(["options", "peak GB per rank", f"fits in {device:g} GB"], [
        [v["options"], f"{v['peak_gb']:.1f}", "yes" if v["peak_gb"] <= device else "no"]
        for v in data["variants"]], "lrl")
    return {"stages": stages, "variants": variants}


if __name__ == "__main__":
    sys.exit(main())
