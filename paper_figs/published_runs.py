"""Published runs predicted by the simulator: fitted rows, held-out rows, and a
FLOPs-only peer.

Every row of ``scenarios/published/runs.yaml`` (source, scenario, published
figure, fitted or held out) is simulated as one data-parallel replica plus its
data-parallel collectives (``megatronapp predict --replica``) with its
device's efficiency constants: those the device profile keeps
(``megatronapp/scenario/devices.py``), or with ``--refit`` those fitted again
here on the device's fitted rows. The FLOPs-only column (what llm-analysis
computes: 6·N·tokens, 8 with full recomputation, at one efficiency of peak)
fits its one efficiency per device on the same rows. A row whose heaviest
stage exceeds its device by Megatron's memory accounting (Llama 3's, which
Meta fitted with its own schedule and FSDP) is timed with the check lifted
and marked "over memory" with its peak. Errors compare
throughput (published iteration time over predicted, minus one: positive is
optimistic). Prints markdown for docs/fidelity.md.

    python paper_figs/published_runs.py [--refit] [--only SOURCE_PREFIX]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatronapp.dpp.static_memory import static_peaks  # noqa: E402
from megatronapp.scenario.config import MAX_RATE, Scenario  # noqa: E402
from megatronapp.scenario.devices import DEVICES  # noqa: E402
from megatronapp.fidelity.fit import with_settings  # noqa: E402
from megatronapp.fidelity.predict import steady_state_s  # noqa: E402
from megatronapp.fidelity.published import (LEFT_OUT, METRIC_UNITS,  # noqa: E402
                                            PublishedRun, fit_device, fit_flops_only_efficiency,
                                            flops_only_iteration_s,
                                            held_out_errors, parameter_count, published_runs,
                                            throughput_error)
from sim import simulate_iteration_times  # noqa: E402


def replica_time(s: Scenario) -> float:
    return steady_state_s(simulate_iteration_times(s, replica=True))


def over_memory_gb(s: Scenario) -> float | None:
    """The heaviest stage's peak (GB) where it exceeds the device, else None."""
    peak = max(static_peaks(s).values()) / 1e9
    return peak if peak > s.cluster.gpu.memory_gb else None


def predicted_time(s: Scenario) -> float:
    """The iteration time; a row over memory by Megatron's accounting (which its
    source evidently fitted otherwise) is timed with the memory check lifted,
    as a static schedule's time does not depend on it, and marked."""
    if over_memory_gb(s) is not None:
        s = with_settings(s, {"cluster.gpu.memory_gb": MAX_RATE})
    return replica_time(s)


def describe(r: PublishedRun) -> str:
    s, q = r.scenario, r.scenario.parallel
    return (f"{parameter_count(s) / 1e9:.1f}B, {s.world_size} GPUs, tp {q.tp} pp {q.pp} "
            f"vpp {q.vpp} dp {q.dp}, {q.microbatches}×{s.model.micro_batch_size}, "
            f"recompute {s.training.recompute}")


def device_constants(runs: list[PublishedRun], device: str, refit: bool,
                     fitted: dict[str, dict[str, float]]) -> dict[str, float]:
    """The efficiency constants a device's rows are predicted with (``fitted``
    collects each device's, for a device that keeps another's)."""
    profile = DEVICES[device]
    if not refit:
        print(f"{device}: the profile's constants, fitted on {profile.fitted_on}: "
              + ", ".join(f"{k} = {v:.4f}" for k, v in profile.fitted.items()))
        fitted[device] = dict(profile.fitted)
    else:
        t0 = time.perf_counter()
        fitted[device], _ = fit_device(runs, device, replica_time,
                                       {**{d: p.fitted for d, p in DEVICES.items()}, **fitted},
                                       progress=lambda m: print(m, file=sys.stderr, flush=True))
        print(f"{device}: fitted on {profile.fitted_on} in {time.perf_counter() - t0:.0f} s: "
              + ", ".join(f"{k} = {v:.4f}" for k, v in fitted[device].items()))
    return {f"cluster.gpu.{k}": v for k, v in fitted[device].items()}


def print_summary(rows: list[tuple[PublishedRun, float, float]]) -> None:
    """Held-out mean and worst |error|: all rows, then by device and by source."""
    held = [(r, e, b) for r, e, b in rows if not r.fitted]
    groups = {"all held-out rows": held}
    for row in held:
        groups.setdefault(row[0].device, []).append(row)
        groups.setdefault(row[0].source.split(",")[0], []).append(row)
    print("\n| held out | rows | simulator mean |error| | worst | FLOPs-only mean | worst |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, members in groups.items():
        ours = held_out_errors([e for _, e, _ in members])
        peer = held_out_errors([b for _, _, b in members])
        print(f"| {name} | {len(members)} | {ours[0] * 100:.1f}% | {ours[1] * 100:+.1f}% "
              f"| {peer[0] * 100:.1f}% | {peer[1] * 100:+.1f}% |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refit", action="store_true",
                        help="fit each device's constants again on its fitted rows")
    parser.add_argument("--only", default="", help="only rows whose source starts with this")
    args = parser.parse_args()
    runs = published_runs(ROOT)
    chosen = [r for r in runs if r.source.startswith(args.only)]
    devices = sorted({r.device for r in chosen})
    fitted: dict[str, dict[str, float]] = {}
    constants = {d: device_constants(runs, d, args.refit, fitted) for d in devices}
    peer = {d: fit_flops_only_efficiency([r for r in runs if r.device == d]) for d in devices}
    print("FLOPs-only peer fitted on the same rows: "
          + ", ".join(f"{d} efficiency = {e:.4f}" for d, e in peer.items()) + "\n")
    print("| source | configuration | published | published s | predicted s | error "
          "| FLOPs-only error | role |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    rows = []
    for r in chosen:
        predicted = predicted_time(with_settings(r.scenario, constants[r.device]))
        over = over_memory_gb(r.scenario)
        err = throughput_error(r.iteration_s, predicted)
        peer_s = flops_only_iteration_s(r.scenario, peer[r.device])
        base_err = throughput_error(r.iteration_s, peer_s)
        rows.append((r, err, base_err))
        memory = "" if over is None else f", over memory: {over:.1f} GB"
        print(f"| {r.source} | {describe(r)}{memory} | {r.value:g} {METRIC_UNITS[r.metric]} "
              f"| {r.iteration_s:.3f} | {predicted:.3f} | {err * 100:+.1f}% "
              f"| {base_err * 100:+.1f}% | {'fitted' if r.fitted else 'held out'} |", flush=True)
    print_summary(rows)
    print("\nleft out (not expressible, or configuration not given in full):\n")
    for left in LEFT_OUT:
        print(f"- {left.source}: {left.missing}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
