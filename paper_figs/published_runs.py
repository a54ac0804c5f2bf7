"""Published runs predicted by the simulator: fitted rows, held-out rows, and a
FLOPs-only peer.

The efficiency model's two constants (``cluster.gpu.efficiency``,
``cluster.gpu.elementwise_traffic``) are fitted on the rows marked fitted;
every other row is predicted with them (simulated as one data-parallel replica
plus its data-parallel collectives, ``megatronapp predict --replica``). The
FLOPs-only column (what llm-analysis computes: 6·N·tokens, 8 with full
recomputation, at one efficiency of peak) fits its one efficiency on the same
rows. Rows whose source is not available in full are listed, not guessed.
Prints markdown for docs/fidelity.md.

    python paper_figs/published_runs.py
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatronapp.scenario.devices import DEVICES  # noqa: E402
from megatronapp.fidelity.fit import with_settings  # noqa: E402
from megatronapp.fidelity.predict import predict  # noqa: E402
from megatronapp.fidelity.published import (LEFT_OUT, PublishedRun, fit_flops_only_efficiency,  # noqa: E402
                                            fit_simulator, flops_only_peak_share,
                                            held_out_errors, parameter_count, published_runs)
from sim import simulate_iteration_times  # noqa: E402


def replica_time(s):  # type: ignore[no-untyped-def]
    return simulate_iteration_times(s, replica=True)[0]


def describe(r: PublishedRun) -> str:
    s, q = r.scenario, r.scenario.parallel
    return (f"{parameter_count(s) / 1e9:.1f}B, {s.world_size} GPUs, tp {q.tp} pp {q.pp} "
            f"vpp {q.vpp} dp {q.dp}, {q.microbatches}×{s.model.micro_batch_size}, "
            f"recompute {s.training.recompute}")


def main() -> int:
    runs = published_runs(ROOT)
    t0 = time.perf_counter()
    fit = fit_simulator([r for r in runs if r.fitted], replica_time,
                        progress=lambda m: print(m, file=sys.stderr, flush=True))
    peer = fit_flops_only_efficiency(runs)
    fitted_on = ", ".join(r.source for r in runs if r.fitted)
    print(f"simulator fitted on {fitted_on} in {time.perf_counter() - t0:.0f} s: "
          + ", ".join(f"{k.split('.')[-1]} = {v:.4f}" for k, v in fit.values.items()))
    print(f"a100-80gb device profile: " + ", ".join(
        f"{k} = {v:.4f}" for k, v in DEVICES["a100-80gb"].fitted.items()))
    print(f"FLOPs-only peer fitted on the same rows: efficiency = {peer:.4f}\n")
    print("| source | configuration | published TFLOP/s per GPU | predicted | error "
          "| FLOPs-only | its error | role |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    ours, theirs = [], []
    for r in runs:
        p = predict(with_settings(r.scenario, fit.values),
                    lambda sc, rep: simulate_iteration_times(sc, rep), replica=True)
        err = p.hardware_tflops_per_gpu / r.tflops_per_gpu - 1
        base = flops_only_peak_share(r.scenario) * peer
        base_err = base / r.tflops_per_gpu - 1
        if not r.fitted:
            ours.append(err)
            theirs.append(base_err)
        print(f"| {r.source} | {describe(r)} | {r.tflops_per_gpu:g} "
              f"| {p.hardware_tflops_per_gpu:.1f} | {err * 100:+.1f}% | {base:.1f} "
              f"| {base_err * 100:+.1f}% | {'fitted' if r.fitted else 'held out'} |", flush=True)
    for name, errors in (("simulator", ours), ("FLOPs-only peer", theirs)):
        mean, worst = held_out_errors(errors)
        print(f"\nheld-out rows ({len(errors)}), {name}: mean |error| {mean * 100:.1f}%, "
              f"worst {worst * 100:+.1f}%", end="")
    print("\n\nleft out (configuration or source not available in full):\n")
    for left in LEFT_OUT:
        print(f"- {left.source}: {left.missing}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
