"""Narayanan et al. 2021 (SC21) Table 1, weak scaling, predicted by the simulator.

The efficiency model's two constants (``cluster.gpu.efficiency``: GEMM share
of peak; ``cluster.gpu.elementwise_traffic``: HBM bytes moved per stored
activation byte) are fitted on two rows; every other row is predicted with
them. Each row is simulated as one data-parallel replica plus its
data-parallel collectives (``megatronapp predict --replica``; exact without
faults or jitter). Prints the table for README.

    python paper_figs/narayanan_table1.py [--fit 1,7]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatronapp.scenario.config import Scenario  # noqa: E402
from megatronapp.fidelity.fit import with_settings  # noqa: E402
from megatronapp.fidelity.predict import predict  # noqa: E402
from megatronapp.fidelity.published import (PublishedRun, fit_simulator, narayanan_row,  # noqa: E402
                                            narayanan_table1_tflops, parameter_count)
from sim import simulate_iteration_times  # noqa: E402


def row_scenario(i: int) -> Scenario:
    return narayanan_row(ROOT, i)


def replica_time(s: Scenario) -> float:
    return simulate_iteration_times(s, replica=True)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", default="1,7",
                        help="the two rows to fit on (default 1,7: one without a pipeline, "
                             "one with)")
    args = parser.parse_args()
    fit_rows = [int(r) for r in args.fit.split(",")]
    published = narayanan_table1_tflops(ROOT)
    rows = {i: row_scenario(i) for i in published}
    t0 = time.perf_counter()
    fit = fit_simulator([PublishedRun(f"row {i}", rows[i], "tflops_per_gpu", published[i], True)
                         for i in fit_rows],
                        replica_time, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"fitted on rows {fit_rows} in {time.perf_counter() - t0:.0f} s: "
          + ", ".join(f"{k.split('.')[-1]} = {v:.4f}" for k, v in fit.values.items()))
    print()
    print("| row | params (B) | GPUs | tp | pp | vpp | microbatches | bubble | published TFLOP/s "
          "| predicted | error | predicted iteration (s) | simulation CPU / wall (s) | role |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    errors = []
    for i, s in rows.items():
        start, cpu = time.perf_counter(), time.process_time()
        p = predict(with_settings(s, fit.values), lambda sc, rep: simulate_iteration_times(sc, rep),
                    replica=True)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        err = p.hardware_tflops_per_gpu / published[i] - 1
        role = "fitted" if i in fit_rows else "predicted"
        if role == "predicted":
            errors.append(abs(err))
        q = s.parallel
        print(f"| {i} | {parameter_count(s) / 1e9:.1f} | {s.world_size} | {q.tp} | {q.pp} | {q.vpp} "
              f"| {q.microbatches} | {bubble(s) * 100:.1f}% | {published[i]} | {p.hardware_tflops_per_gpu:.1f} | {err * 100:+.1f}% "
              f"| {p.iteration_s:.2f} | {cpu:.0f} / {wall:.0f} | {role} |", flush=True)
    print(f"\npredicted rows: mean |error| {sum(errors) / len(errors) * 100:.1f}%, "
          f"max {max(errors) * 100:.1f}%")
    strong_scaling(rows[STRONG_ROW], fit.values)
    return 0


STRONG_ROW = 7  # 145.6B, global batch 2304


def strong_scaling(s: Scenario, values: dict[str, float]) -> None:
    """The same model and global batch on more GPUs (more data-parallel
    replicas, fewer microbatches each): predicted only, no published series."""
    batch = s.parallel.dp * s.parallel.microbatches * s.model.micro_batch_size
    print(f"\nstrong scaling, row {STRONG_ROW}'s model at global batch {batch} (predicted):\n")
    print("| GPUs | dp | microbatches per replica | TFLOP/s per GPU | iteration (s) |")
    print("|---:|---:|---:|---:|---:|")
    for dp in (s.parallel.dp // 2, s.parallel.dp, s.parallel.dp * 2):
        m = batch // (dp * s.model.micro_batch_size)
        scaled = with_settings(s, {**values, "parallel.dp": dp, "parallel.microbatches": m})
        p = predict(scaled, lambda sc, rep: simulate_iteration_times(sc, rep), replica=True)
        print(f"| {scaled.world_size} | {dp} | {m} | {p.hardware_tflops_per_gpu:.1f} "
              f"| {p.iteration_s:.2f} |", flush=True)


def bubble(s: Scenario) -> float:
    """The pipeline bubble over ideal time, (p - 1) / (v m) (Narayanan et al. §2.2)."""
    q = s.parallel
    return (q.pp - 1) / (q.vpp * q.microbatches)


if __name__ == "__main__":
    sys.exit(main())
