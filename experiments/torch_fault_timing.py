"""What injected faults do to wall time on the torch backend (real processes).

Each fault runs once on tiny megatron-core stages (gloo, CPU); the faulty
ranks' op time is compared with healthy peers doing the same work in the same
run, so machine load affects both sides alike. The seconds the fault models
asked for (``injected_s`` in the trace) and the CPU seconds of all ranks stand
beside the wall times. The tests check the injected seconds exactly; these
ratios are measurements, not assertions.

    .venv/bin/python -m experiments.torch_fault_timing
"""
from __future__ import annotations

import resource
import time
from typing import Any, Mapping

from backends.torch.interpreter import INJECTED
from experiments import results
from backends.torch.launch import spawn_run
from megatronapp.scenario.config import Scenario, parse_scenario
from megatronapp.trace.events import Event

TINY = {"layers": 2, "hidden": 32, "heads": 4, "seq_len": 8, "vocab": 64, "micro_batch_size": 2}
# (label, parallel, fault, faulty ranks, healthy ranks, op kind compared)
CASES = (
    ("throttle 4x, rank 1 vs its dp peer", {"dp": 2, "microbatches": 8},
     {"kind": "throttle", "rank": 1, "factor": 4.0}, (1,), (0,), "compute"),
    ("slow link 3x, pair 1-3 vs pair 0-2", {"pp": 2, "dp": 2, "microbatches": 4},
     {"kind": "slow_link", "ranks": [1, 3], "factor": 3.0}, (1, 3), (0, 2), "p2p"),
    ("link jitter 1.0, pair 1-3 vs pair 0-2", {"pp": 2, "dp": 2, "microbatches": 4},
     {"kind": "link_jitter", "ranks": [1, 3], "sigma": 1.0}, (1, 3), (0, 2), "p2p"),
)


def scenario(parallel: dict[str, int], fault: dict[str, Any]) -> Scenario:
    return parse_scenario({"seed": 5, "iterations": 1, "schedule": "1f1b", "parallel": parallel,
                           "model": TINY, "costs": {"p2p_s": 0.05}, "faults": [fault]})


def op_seconds(events: Mapping[int, list[Event]], ranks: tuple[int, ...],
               kind: str) -> tuple[float, float]:
    """(wall seconds, injected seconds) of ``kind`` ops on ``ranks`` (receives for p2p)."""
    ops = [e for r in ranks for e in events[r] if e.args["kind"] == kind
           and e.args.get("role", "recv") == "recv"]
    return sum(e.dur_s for e in ops), sum(e.args.get(INJECTED, 0.0) for e in ops)


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> None:
    options = results.parser("torch_fault_timing", __doc__)
    results.results_dir_option(options)
    args = options.parse_args(argv)
    experiment, rows = results.start("torch_fault_timing", argv), []
    print("| fault | faulty ops s | healthy ops s | ratio | injected s | run wall s "
          "| ranks' CPU s |")
    print("|---|---|---|---|---|---|---|")
    for label, parallel, fault, faulty, healthy, kind in CASES:
        cpu0, wall0 = children_cpu_s(), time.perf_counter()
        run, _ = spawn_run(scenario(parallel, fault))
        wall, cpu = time.perf_counter() - wall0, children_cpu_s() - cpu0
        bad, injected = op_seconds(run.events, faulty, kind)
        good, _ = op_seconds(run.events, healthy, kind)
        rows.append({"fault": label, "parallel": parallel, "spec": fault, "faulty_ops_s": bad,
                     "healthy_ops_s": good, "injected_s": injected, "wall_s": wall, "cpu_s": cpu})
        print(f"| {label} | {bad:.3f} | {good:.3f} | {bad / good:.2f} | {injected:.3f} | "
              f"{wall:.1f} | {cpu:.1f} |")
    print(f"wrote {experiment.record({'rows': rows}, args.results_dir)}")


if __name__ == "__main__":
    main()
