"""Memory per rank against Megatron's own estimate, and the 340B run that fitted.

For five layouts where Megatron's ``report_theoretical_memory`` assumptions
hold (multi-head attention, a 4h MLP, sequence parallelism with selective
recomputation, the distributed optimizer) it sets the simulator's count for the
first stage (``megatronapp predict``'s memory table) beside Megatron's. Then it
takes ``scenarios/memory/nemotron4_340b.yaml``, a run that trained on 128
H100s, under the four combinations of gradient reduction dtype and dropout,
beside Megatron's estimate and the device (closed forms, no simulation).

    python -m experiments.memory_accounting
"""
from __future__ import annotations

import sys
from typing import Any

from experiments import results
from experiments.render import markdown_table
from megatronapp.costs.memory import RankMemory, output_layer_bytes
from megatronapp.costs.theoretical_memory import theoretical_memory
from megatronapp.dpp.static_memory import stage_memory
from megatronapp.scenario.config import Scenario, load_scenario, parse_scenario

NAME = "memory_accounting"
LAYOUTS = ((1, 1, 8, 4), (2, 1, 1, 1), (4, 1, 8, 8), (4, 3, 8, 8), (8, 6, 2, 16))
ROW_340B = results.ROOT / "scenarios" / "memory" / "nemotron4_340b.yaml"


def layout(pp: int, vpp: int, dp: int, microbatches: int) -> Scenario:
    """A 48-layer, hidden-6144 GPT at tp 8 with sequence parallelism and selective
    recomputation (Megatron's estimate's own assumptions)."""
    return parse_scenario({
        "schedule": "interleaved" if vpp > 1 else "1f1b",
        "parallel": {"tp": 8, "pp": pp, "vpp": vpp, "dp": dp, "microbatches": microbatches,
                     "sequence_parallel": True},
        "model": {"layers": 48, "hidden": 6144, "heads": 48, "seq_len": 4096, "vocab": 51200,
                  "position_embedding_type": "rope"},
        "training": {"recompute": "selective", "distributed_optimizer": True}})


def state(m: RankMemory) -> float:
    return m.weights + m.grads + m.optimizer


def agreement(pp: int, vpp: int, dp: int, microbatches: int) -> dict[str, Any]:
    s = layout(pp, vpp, dp, microbatches)
    first, megatron = stage_memory(s)[0], theoretical_memory(s)
    logits = output_layer_bytes(s) if pp == 1 else 0.0  # Megatron counts them at pp 1
    return {"pp": pp, "vpp": vpp, "dp": dp, "microbatches": microbatches,
            "state_gb": state(first) / 1e9, "megatron_state_gb": megatron.weights_and_optimizer / 1e9,
            "activations_gb": (first.activations + logits) / 1e9,
            "megatron_activations_gb": megatron.activations / 1e9}


def variant(fp32_grads: bool, dropout: float) -> dict[str, Any]:
    s = load_scenario(ROW_340B, [f"training.grad_reduce_in_fp32={fp32_grads}",
                                 f"model.hidden_dropout={dropout}",
                                 f"model.attention_dropout={dropout}"])
    peak = max(stage_memory(s).values(), key=lambda m: m.total)
    return {"fp32_grads": fp32_grads, "dropout": dropout, "stage": peak.pp_rank,
            **{k: getattr(peak, k) / 1e9 for k in ("weights", "grads", "optimizer",
                                                   "activations", "total")},
            "device_gb": s.cluster.gpu.memory_gb}


def main(argv: list[str] | None = None) -> int:
    results.parser(NAME, __doc__).parse_args(argv)
    run = results.start(NAME, argv)
    megatron = theoretical_memory(load_scenario(ROW_340B))
    run.record({"agreement": [agreement(*x) for x in LAYOUTS],
                "row_340b": [variant(g, d) for g in (True, False) for d in (0.1, 0.0)],
                "megatron_340b_gb": {"weights_and_optimizer": megatron.weights_and_optimizer / 1e9,
                                     "activations": megatron.activations / 1e9,
                                     "total": megatron.total / 1e9}})
    print("\n".join(tables(results.read(NAME)).values()))
    return 0


def tables(doc: dict[str, Any]) -> dict[str, str]:
    data = doc["data"]
    agree = markdown_table(
        ["pp", "vpp", "dp", "microbatches", "weights + optimizer GB", "Megatron's",
         "activations GB", "Megatron's"],
        [[a["pp"], a["vpp"], a["dp"], a["microbatches"], f"{a['state_gb']:.3f}",
          f"{a['megatron_state_gb']:.3f}", f"{a['activations_gb']:.3f}",
          f"{a['megatron_activations_gb']:.3f}"] for a in data["agreement"]], "rrrrrrrr")
    meg = data["megatron_340b_gb"]
    rows = [[("fp32" if v["fp32_grads"] else "bf16"), f"{v['dropout']:g}", v["stage"],
             f"{v['weights']:.2f}", f"{v['grads']:.2f}", f"{v['optimizer']:.2f}",
             f"{v['activations']:.2f}", f"{v['total']:.2f}",
             "yes" if v["total"] <= v["device_gb"] else "no"] for v in data["row_340b"]]
    rows.append(["fp32 (Megatron's estimate)", "0.1", 0, "–", "–",
                 f"{meg['weights_and_optimizer']:.2f} (the three together)",
                 f"{meg['activations']:.2f}", f"{meg['total']:.2f}",
                 "yes" if meg["total"] <= data["row_340b"][0]["device_gb"] else "no"])
    row = markdown_table(["gradients reduced in", "dropout", "stage", "weights GB", "grads GB",
                          "optimizer GB", "activations GB", "total GB",
                          f"fits {data['row_340b'][0]['device_gb']:.2f} GB"], rows,
                         "llrrrrrrl")
    return {"agreement": agree, "row_340b": row}


if __name__ == "__main__":
    sys.exit(main())
