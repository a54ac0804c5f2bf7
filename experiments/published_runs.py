"""Every published row predicted by the simulator: fitted rows, held-out rows,
and a FLOPs-only peer; the one table README and docs/pricing.md show.

Each row of ``scenarios/published/runs.yaml`` is simulated as one
data-parallel replica plus its data-parallel collectives (``megatronapp predict
--replica``'s steady state) with the constants its device profile holds for the
row's software generation (``megatronapp fidelity fit`` wrote them). The
FLOPs-only peer (what llm-analysis computes: 6·N·tokens, 8 with full
recomputation, at one efficiency of peak) fits its one efficiency per device on
the same fitted rows. A row over its device by Megatron's memory accounting is
timed with the check lifted and marked. Errors compare throughput: published
iteration time over predicted, minus one (positive: optimistic).

    python -m experiments.published_runs [--jobs 2]
"""
from __future__ import annotations

import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Sequence

from experiments import results
from experiments.render import markdown_table
from megatronapp.fidelity.predict import steady_state_s
from megatronapp.fidelity.published import (LEFT_OUT, METRIC_UNITS, PublishedRun,
                                            fit_flops_only_efficiency, flops_only_iteration_s,
                                            held_out_errors, parameter_count, predicted_row_s,
                                            published_runs, throughput_error)
from megatronapp.scenario.config import Scenario
from megatronapp.scenario.devices import DEVICES, SHARED_FITS
from sim import simulate_iteration_times

NAME = "published_runs"


def replica_steady_s(s: Scenario) -> float:
    return steady_state_s(simulate_iteration_times(s, replica=True))


def describe(r: PublishedRun) -> str:
    s, q = r.scenario, r.scenario.parallel
    cp = f" cp {q.cp}" if q.cp > 1 else ""
    return (f"{parameter_count(s) / 1e9:.1f}B, {s.world_size} GPUs, tp {q.tp} pp {q.pp} "
            f"vpp {q.vpp}{cp} dp {q.dp}, {q.microbatches}×{s.model.micro_batch_size}, "
            f"recompute {s.training.recompute}")


def timed_row(index: int) -> dict[str, Any]:
    """One row predicted (in a worker process: the rows are read there again)."""
    run = published_runs(results.ROOT)[index]
    cpu, wall = time.process_time(), time.perf_counter()
    predicted, over = predicted_row_s(run, replica_steady_s)
    return {"predicted_s": predicted, "over_memory_gb": over,
            "cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall}


def row_record(r: PublishedRun, timed: dict[str, Any], peer_efficiency: float) -> dict[str, Any]:
    peer_s = flops_only_iteration_s(r.scenario, peer_efficiency)
    return {"source": r.source, "configuration": describe(r), "device": r.device,
            "software": r.generation[1], "published": f"{r.value:g} {METRIC_UNITS[r.metric]}",
            "published_s": r.iteration_s, **timed,
            "error": throughput_error(r.iteration_s, timed["predicted_s"]),
            "flops_only_error": throughput_error(r.iteration_s, peer_s),
            "role": "fitted" if r.fitted else "held out", "disputed": r.disputed}


def summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Held-out mean and worst |error|: all rows, without the disputed, and by
    device, software and source."""
    held = [r for r in rows if r["role"] == "held out"]
    groups: dict[str, list[dict[str, Any]]] = {"all held-out rows": held}
    if any(r["disputed"] for r in held):
        groups["all held-out rows but the disputed"] = [r for r in held if not r["disputed"]]
    for r in held:
        for key in (r["device"], r["software"], r["source"].split(",")[0]):
            groups.setdefault(key, []).append(r)
    out = []
    for name, members in groups.items():
        ours = held_out_errors([m["error"] for m in members])
        peer = held_out_errors([m["flops_only_error"] for m in members])
        out.append({"group": name, "rows": len(members), "mean": ours[0], "worst": ours[1],
                    "flops_only_mean": peer[0], "flops_only_worst": peer[1]})
    return out


def generations() -> list[dict[str, Any]]:
    """Every fitted (device, software) pair's constants, from the device profiles."""
    return [{"device": device, "software": software, "constants": fit.constants,
             "fitted_on": fit.fitted_on, "default": software == profile.default_software}
            for device, profile in DEVICES.items() if device not in SHARED_FITS
            for software, fit in profile.fits.items()]


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    jobs = results.jobs_option(NAME, __doc__, argv)
    run = results.start(NAME, argv)
    runs = published_runs(results.ROOT)
    peer = {d: fit_flops_only_efficiency([r for r in runs if r.device == d])
            for d in sorted({r.device for r in runs})}
    wall = time.perf_counter()
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        timed = {}
        for i, result in zip(range(len(runs)), pool.map(timed_row, range(len(runs)))):
            timed[i] = result
            progress(f"{i + 1}/{len(runs)} {runs[i].source}: {result['predicted_s']:.3f} s "
                     f"({result['wall_s']:.0f} s)")
    rows = [row_record(r, timed[i], peer[r.device]) for i, r in enumerate(runs)]
    run.record({"rows": rows, "summary": summary(rows), "flops_only_efficiency": peer,
                "generations": generations(),
                "left_out": [{"source": x.source, "missing": x.missing} for x in LEFT_OUT],
                "wall_s": time.perf_counter() - wall})
    print("\n".join(tables(results.read(NAME)).values()))
    return 0


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def tables(doc: dict[str, Any]) -> dict[str, str]:
    data = doc["data"]
    rows = [[r["source"], r["configuration"] + (f", over memory: {r['over_memory_gb']:.1f} GB"
                                                 if r["over_memory_gb"] else ""),
             r["software"], r["published"], f"{r['published_s']:.3f}",
             f"{r['predicted_s']:.3f}", _pct(r["error"]), _pct(r["flops_only_error"]),
             r["role"] + (" (disputed)" if r["disputed"] else "")] for r in data["rows"]]
    table = markdown_table(["source", "configuration", "software", "published", "published s",
                            "predicted s", "error", "FLOPs-only error", "role"], rows,
                           "lllllrrrrl")
    groups = [[g["group"], g["rows"], f"{g['mean'] * 100:.1f}%", _pct(g["worst"]),
               f"{g['flops_only_mean'] * 100:.1f}%", _pct(g["flops_only_worst"])]
              for g in data["summary"]]
    summary_table = markdown_table(["held out", "rows", "simulator mean abs. error", "worst",
                                    "FLOPs-only mean", "worst"], groups, "lrrrrr")
    headline = "; ".join(
        f"{g['group']}: {g['rows']}, mean |error| {g['mean'] * 100:.1f}%, worst "
        f"{_pct(g['worst'])} (FLOPs-only peer {g['flops_only_mean'] * 100:.1f}%, "
        f"{_pct(g['flops_only_worst'])})" for g in data["summary"][:2]) + "\n"
    fits = markdown_table(["device", "software", "constants", "fitted on"], [
        [g["device"], g["software"] + (" (the device's default)" if g["default"] else ""),
         ", ".join(f"{k} {v:g}" for k, v in g["constants"].items()), g["fitted_on"]]
        for g in data["generations"]])
    return {"rows": table, "summary": summary_table, "headline": headline, "generations": fits}


if __name__ == "__main__":
    sys.exit(main())
