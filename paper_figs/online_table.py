"""On-line MegaScan and the closed loop in simulation: for each fault kind and
severity, the detection latency (iterations from onset to verdict, median and
worst over seeds), false alarms per 1,000 healthy iterations, and goodput
(tokens/s over the job) with the loop off and on.

    .venv/bin/python paper_figs/online_table.py [--gpus 16,1024] [--seeds 20]
        [--healthy-seeds 50] [--healthy-iterations 40] [--goodput-gpus 16]

Jobs: 16 GPUs (scenarios/throttle.yaml: tp 2, pp 4, dp 2), 1,024 GPUs
(scenarios/scan_1024.yaml with 8 microbatches: tp 8, pp 8, dp 16) and 12,288
GPUs (scenarios/megascale_12288.yaml), each with its background jitter and
one fault. A throttle starts half-way through iteration ``ONSET``
(``start_s``); its onset is the first iteration the rank computes in after
it. A slow link is slow from the start (onset 0). Latency counts the
iterations completed from the onset's to the verdict's: 1 = named at the end
of the onset iteration. A false alarm is a verdict naming anything else.
Goodput: a job of ``GOODPUT_ITERATIONS`` with the fault from iteration 40,
``mitigation: {action: exclude, spares: 1, checkpoint_every: 10}`` and a
restart costing 20 iterations' time, against the same job with the loop off.
Every run is the compiled engine (static schedules).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's packages, not an installed copy

from megatronapp.mitigate.loop import close_loop  # noqa: E402
from megatronapp.scan.online import OnlineScan, iterations_of  # noqa: E402
from megatronapp.scenario.config import Scenario, load_scenario  # noqa: E402
from megatronapp.trace.columns import EventColumns, source_of  # noqa: E402
from megatronapp.trace.summary import run_iteration_times  # noqa: E402
from sim import simulate  # noqa: E402


@dataclass(frozen=True)
class Job:
    scenario: str
    overrides: tuple[str, ...]
    throttled: int
    link: tuple[int, int]  # a pipeline link between two nodes
    iterations: int  # per latency trial


JOBS = {
    16: Job("throttle.yaml", (), 5, (5, 9), 8),
    1024: Job("scan_1024.yaml", ("parallel.microbatches=8",), 300, (427, 555), 5),
    12288: Job("megascale_12288.yaml", (), 5000, (8403, 9939), 4),
}
CASES = (("throttle", 1.2), ("throttle", 1.5), ("slow_link", 2.0), ("slow_link", 3.0))
ONSET = 1  # a throttle starts half-way through this iteration
GOODPUT_ITERATIONS, GOODPUT_ONSET = 200, 40


def scenario(job: Job, seed: int, iterations: int, faults: str, *extra: str) -> Scenario:
    return load_scenario(ROOT / "scenarios" / job.scenario,
                         [*job.overrides, f"seed={seed}", f"iterations={iterations}",
                          f"faults={faults}", *extra])


def fault(job: Job, kind: str, factor: float, start_s: float) -> str:
    if kind == "throttle":
        return f"[{{kind: throttle, rank: {job.throttled}, factor: {factor}, start_s: {start_s}}}]"
    return f"[{{kind: slow_link, ranks: [{job.link[0]}, {job.link[1]}], factor: {factor}}}]"


def iteration_s(job: Job) -> float:
    """The healthy job's iteration time (seed 0), to place onsets in time."""
    times = run_iteration_times(simulate(scenario(job, 0, 2, "[]")))
    return statistics.mean(times)


def onset_of(parts: list[tuple[int, EventColumns]], rank: int, start_s: float) -> int:
    return min(i for i, c in parts if bool(((c.rank == rank) & (c.start_s >= start_s)).any()))


def target(job: Job, kind: str) -> tuple[str, int, int | None]:
    return ("compute", job.throttled, None) if kind == "throttle" else ("link", *job.link)


def trial(job: Job, kind: str, factor: float, seed: int, period_s: float
          ) -> tuple[int | None, int]:
    """(latency in iterations or None if never named, false alarms) of one run."""
    start_s = (ONSET + 0.5) * period_s if kind == "throttle" else 0.0
    s = scenario(job, seed, job.iterations, fault(job, kind, factor, start_s))
    parts = list(iterations_of(source_of(simulate(s))))
    onset = onset_of(parts, job.throttled, start_s) if kind == "throttle" else 0
    scan = OnlineScan(gpus_per_node=s.cluster.gpus_per_node, scenario=s)
    latency, false = None, 0
    for i, cols in parts:
        for d in scan.feed(i, cols):
            if d.event != "named":
                continue
            if d.key == target(job, kind) and latency is None:
                latency = d.iteration - onset + 1
            elif d.key != target(job, kind):
                false += 1
    return latency, false


def healthy_false_alarms(job: Job, seeds: int, iterations: int) -> tuple[int, int]:
    """(verdicts, iterations) over healthy runs."""
    verdicts = 0
    for seed in range(seeds):
        s = scenario(job, seed, iterations, "[]")
        scan = OnlineScan(gpus_per_node=s.cluster.gpus_per_node, scenario=s)
        for i, cols in iterations_of(source_of(simulate(s))):
            verdicts += sum(d.event == "named" for d in scan.feed(i, cols))
    return verdicts, seeds * iterations


def poisson_upper(count: int, exposure: float, level: float = 0.95) -> float:
    """The exact one-sided upper bound on a Poisson rate seen ``count`` times
    in ``exposure``: the rate whose P(X <= count) is 1 - level (bisection)."""
    def below(rate: float) -> float:
        mean = rate * exposure
        return sum(math.exp(-mean + k * math.log(mean) - math.lgamma(k + 1)) if mean > 0 else
                   float(k == 0) for k in range(count + 1))
    lo, hi = 0.0, (count + 10) * 10 / exposure
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if below(mid) > 1 - level else (lo, mid)
    return hi


def false_alarm_row(gpus: int, verdicts: int, iterations: int) -> str:
    per = 10_000
    return (f"| {gpus:,} | healthy | | | | {verdicts} in {iterations:,} iterations: "
            f"{per * verdicts / iterations:.2f} per {per:,} (95% upper bound "
            f"{per * poisson_upper(verdicts, iterations):.2f}) | | |")


def goodput(job: Job, kind: str, factor: float, period_s: float) -> tuple[float, float]:
    """tokens/s with the loop off and on (seed 0)."""
    start_s = GOODPUT_ONSET * period_s if kind == "throttle" else 0.0
    s = scenario(job, 0, GOODPUT_ITERATIONS, fault(job, kind, factor, start_s),
                 f"mitigation={{action: exclude, spares: 1, checkpoint_every: 10, "
                 f"restart_s: {20 * period_s}}}")
    loop = close_loop(s, simulate(s), simulate, lambda _: None).to_json()
    return loop["tokens_per_s_without_loop"], loop["tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="16,1024")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--healthy-seeds", type=int, default=50)
    ap.add_argument("--healthy-iterations", type=int, default=40)
    ap.add_argument("--goodput-gpus", default="16")
    ap.add_argument("--healthy-only", action="store_true", help="only the false-alarm rows")
    args = ap.parse_args()
    print("| GPUs | fault | latency median | latency worst | named | false alarms "
          "| goodput off (tokens/s) | goodput on |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for gpus in [int(g) for g in args.gpus.split(",")]:
        job = JOBS[gpus]
        period = iteration_s(job)
        for kind, factor in () if args.healthy_only else CASES:
            results = [trial(job, kind, factor, seed, period) for seed in range(args.seeds)]
            named = [r[0] for r in results if r[0] is not None]
            off, on = goodput(job, kind, factor, period) \
                if str(gpus) in args.goodput_gpus.split(",") else (None, None)
            print(f"| {gpus:,} | {kind} {factor:g}x "
                  f"| {statistics.median(named) if named else '-'} "
                  f"| {max(named) if len(named) == len(results) else 'missed'} "
                  f"| {len(named)}/{len(results)} | {sum(r[1] for r in results)} "
                  f"| {'-' if off is None else f'{off:,.0f}'} "
                  f"| {'-' if on is None else f'{on:,.0f}'} |", flush=True)
        verdicts, iterations = healthy_false_alarms(job, args.healthy_seeds,
                                                    args.healthy_iterations)
        print(false_alarm_row(gpus, verdicts, iterations), flush=True)


if __name__ == "__main__":
    main()
