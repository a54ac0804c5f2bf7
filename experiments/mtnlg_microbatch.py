"""MT-NLG's micro-batch size, which its paper does not give, read from the
paper's own strong scaling.

Smith et al. 2022 (section 2.4) time one model (530B, tp 8, pp 35, global
batch 1,920) on 2,240, 2,800 and 3,360 GPUs: dp 8, 10 and 12. At a fixed
global batch each replica runs 1,920 / (dp · b) microbatches of b samples, so
the pipeline's bubble, (pp − 1) slots against that many, weighs more as dp
grows, and more the larger b is: how much faster the 3,360-GPU run is than
the 2,240-GPU one depends on b, and hardly at all on the device constants
(a constant factor on every kernel cancels in the ratio). For each b this
prints the three rows predicted as ``experiments/published_runs.py`` predicts them (one
replica plus its data-parallel collectives, the device's fitted constants),
their errors, and the speed-up from 2,240 to 3,360 GPUs against the
published one (60.1 / 44.4 s).

    python -m experiments.mtnlg_microbatch [--sizes 1,2,4]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from experiments import results
from megatronapp.fidelity.fit import with_settings
from megatronapp.fidelity.published import (PublishedRun, published_runs,
                                            throughput_error)
from megatronapp.mitigate.plan import global_batch
from megatronapp.scenario.config import Scenario
from megatronapp.scenario.devices import DEVICES
from sim import simulate_iteration_times

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "Smith et al. 2022 (MT-NLG 530B)"


def with_micro_batch(s: Scenario, size: int) -> Scenario:
    """``s`` with micro-batches of ``size`` samples and the same global batch."""
    samples = global_batch(s.parallel, s.model.micro_batch_size)
    per_replica, left = divmod(samples, s.parallel.dp * size)
    if left or per_replica == 0:
        raise ValueError(f"micro-batch {size} does not divide the global batch {samples} "
                         f"over dp {s.parallel.dp}")
    return with_settings(s, {"model.micro_batch_size": size,
                             "parallel.microbatches": per_replica})


def predicted_s(run: PublishedRun, size: int) -> float:
    constants = {f"cluster.gpu.{k}": v for k, v in DEVICES[run.device].fitted.items()}
    s = with_settings(with_micro_batch(run.scenario, size), constants)
    return simulate_iteration_times(s, replica=True)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,4", help="micro-batch sizes to try")
    results.results_dir_option(parser)
    args = parser.parse_args(argv)
    experiment, rows = results.start("mtnlg_microbatch", argv), []
    runs = sorted((r for r in published_runs(ROOT) if r.source.startswith(SOURCE)),
                  key=lambda r: r.scenario.world_size)
    try:
        sizes = [int(x) for x in args.sizes.split(",")]
        for size in sizes:
            for r in runs:
                with_micro_batch(r.scenario, size)
    except ValueError as err:
        parser.error(f"--sizes: {err}")
    gpus = [r.scenario.world_size for r in runs]
    published_speedup = runs[0].iteration_s / runs[-1].iteration_s
    print("| micro-batch | " + " | ".join(f"{g:,} GPUs: s (error)" for g in gpus)
          + f" | speed-up {gpus[0]:,} → {gpus[-1]:,} (published {published_speedup:.3f}×) |")
    print("|---:|" + "---:|" * (len(runs) + 1))
    for size in sizes:
        t0 = time.process_time()
        times = [predicted_s(r, size) for r in runs]
        cells = [f"{t:.2f} ({throughput_error(r.iteration_s, t) * 100:+.1f}%)"
                 for r, t in zip(runs, times)]
        speedup = times[0] / times[-1]
        rows.append({"micro_batch": size, "iteration_s": times, "speedup": speedup,
                     "throughput_error": [throughput_error(r.iteration_s, t)
                                          for r, t in zip(runs, times)]})
        print(f"| {size} | " + " | ".join(cells)
              + f" | {speedup:.3f}× ({(speedup / published_speedup - 1) * 100:+.1f}%) |",
              flush=True)
        print(f"micro-batch {size}: {time.process_time() - t0:.0f} CPU s", file=sys.stderr)
    recorded = experiment.record(
        {"gpus": gpus, "published_s": [r.iteration_s for r in runs],
         "published_speedup": published_speedup, "rows": rows}, args.results_dir)
    print(f"wrote {recorded}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
