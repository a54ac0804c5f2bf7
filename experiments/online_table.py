"""On-line MegaScan and the closed loop in simulation: for each fault kind and
severity, the detection latency (iterations from onset to verdict, median and
worst over seeds), false alarms per 10,000 healthy iterations with their
95% upper bound, and goodput (tokens/s over the job) with the loop off and on:
simulated end to end (``--goodput-gpus``) or estimated from measured
iteration times with the loop's accounting (``--estimate-gpus``,
``LoopEstimate``), with the restart cost at which the loop breaks even.

    .venv/bin/python -m experiments.online_table [--gpus 16,1024] [--seeds 20]
        [--healthy-seeds 50] [--healthy-iterations 40] [--goodput-gpus 16]
        [--kinds throttle,slow_link] [--factors 1.5] [--healthy-only] [--healthy-first-seed 0]
        [--estimate-gpus 1024,12288]

Jobs: 16 GPUs (scenarios/throttle.yaml: tp 2, pp 4, dp 2), 1,024 GPUs
(scenarios/scan_1024.yaml with 8 microbatches: tp 8, pp 8, dp 16) and 12,288
GPUs (scenarios/megascale_12288.yaml), each with one fault; the 16- and
1,024-GPU jobs with their background jitter, the 12,288-GPU job without (so
its identical pipelines are simulated and scanned once per class: the scan is
fed the stored rows, ``iterations_of(compact=True)``; its healthy row is its one
healthy run, since every seed of it is the same run). Each seed places its
fault (``placed``): any rank, or any pipeline link between consecutive
stages, starting anywhere in iteration ``ONSET`` (``start_s``), so seeds are
different runs even without jitter. Its onset is the first iteration the
throttled rank computes in, or the link carries a transfer in, after it.
Latency counts the iterations completed from the onset's to the verdict's:
1 = named at the end of the onset iteration. A false alarm is a verdict naming anything else.
Goodput: a job of ``GOODPUT_ITERATIONS`` with the fault from iteration 40,
``mitigation: {action: exclude, spares: 1, checkpoint_every: 10}`` and a
restart costing 20 iterations' time, against the same job with the loop off.
Every run is the compiled engine (static schedules).

Torch rows (``--backend torch``): real runs on this machine, see
``torch_table``; kept under runs/online_torch/ and scored again
with ``--replay``; each compute op judged by its time on the device (wall
time less its wait to run). ``--realized``: the factor the throttle realized,
on device and wall time (``realized_line``).

    .venv/bin/python -m experiments.online_table --backend torch [--ranks 4]
        [--seeds 20] [--first-seed 0] [--cases throttle-1.5,healthy-0] [--replay]
        [--realized]
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from experiments import results
from megatronapp.io.outdirs import staged_dir
from megatronapp.mitigate.loop import close_loop
from megatronapp.mitigate.plan import global_batch
from megatronapp.run.write import write_run
from megatronapp.scan.online.live import on_device, scan_for
from megatronapp.scan.online.online import (SIMULATED, Detection, OnlineConfig, OnlineScan,
                                     iterations_of)
from megatronapp.scan.align.table import COMPUTE_KIND
from megatronapp.scan.eval.trials import REAL_P2P_S
from megatronapp.scan.ingest.work import scenario_of_run
from megatronapp.scenario.config import Scenario, load_scenario, parse_scenario
from megatronapp.trace.columns import EventColumns, TableSource, source_of
from megatronapp.trace.store import TRACE_FILE, read_columns
from megatronapp.trace.summary import run_iteration_times
from sim import simulate

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Job:
    scenario: str
    overrides: tuple[str, ...]
    throttled: int
    link: tuple[int, int]  # a pipeline link between two nodes
    iterations: int  # per latency trial
    jitter: bool = True  # False: its healthy pipelines are identical (no false alarm to measure)


JOBS = {
    16: Job("throttle.yaml", (), 5, (5, 9), 8),
    1024: Job("scan_1024.yaml", ("parallel.microbatches=8",), 300, (427, 555), 5),
    12288: Job("megascale_12288.yaml", (), 5000, (8403, 9939), 6, jitter=False),
}
CASES = (("throttle", 1.2), ("throttle", 1.5), ("slow_link", 2.0), ("slow_link", 3.0))
ONSET = 1  # a throttle starts half-way through this iteration
GOODPUT_ITERATIONS, GOODPUT_ONSET = 200, 40


def scenario(job: Job, seed: int, iterations: int, faults: str, *extra: str) -> Scenario:
    return load_scenario(ROOT / "scenarios" / job.scenario,
                         [*job.overrides, f"seed={seed}", f"iterations={iterations}",
                          f"faults={faults}", *extra])


@dataclass(frozen=True)
class Placement:
    """Which rank a throttle slows or which pipeline link a slow link slows,
    and how far into iteration ``ONSET`` (0 to 1) the fault starts."""

    rank: int
    link: tuple[int, int]  # a stage's rank and its next stage's (a link between two nodes)
    into: float = 0.5

    def fault(self, kind: str, factor: float, start_s: float) -> str:
        if kind == "throttle":
            return (f"[{{kind: throttle, rank: {self.rank}, factor: {factor}, "
                    f"start_s: {start_s}}}]")
        return (f"[{{kind: slow_link, ranks: [{self.link[0]}, {self.link[1]}], "
                f"factor: {factor}, start_s: {start_s}}}]")

    def target(self, kind: str) -> tuple[str, int, int | None]:
        return ("compute", self.rank, None) if kind == "throttle" else ("link", *self.link)


def fixed(job: Job) -> Placement:
    """The job's own fault, half-way through the iteration (goodput, estimates)."""
    return Placement(job.throttled, job.link)


def placed(s: Scenario, seed: int) -> Placement:
    """A fault placed by ``seed``: any rank of the job, any pipeline link
    between consecutive stages (tp fastest, then dp, then pp: the next stage's
    rank is ``tp * dp`` on), anywhere in the onset iteration."""
    p = s.parallel
    rng = np.random.default_rng(seed)
    stride = p.tp * p.dp
    sender = int(rng.integers(stride * (p.pp - 1)))
    return Placement(int(rng.integers(s.world_size)), (sender, sender + stride),
                     float(rng.uniform(0.0, 1.0)))


def iteration_s(job: Job) -> float:
    """The healthy job's iteration time (seed 0), to place onsets in time."""
    times = run_iteration_times(simulate(scenario(job, 0, 2, "[]")))
    return statistics.mean(times)


def onset_of(parts: list[tuple[int, EventColumns]], place: Placement, kind: str,
             start_s: float) -> int:
    """The first iteration the fault acts in: the throttled rank computes, or
    the link carries a transfer, at or after ``start_s``."""
    def acts(c: EventColumns) -> np.ndarray:
        if kind == "throttle":
            return c.rank == place.rank
        a, b = place.link
        return ((c.rank == a) & (c.peer == b)) | ((c.rank == b) & (c.peer == a))
    return first_acting(parts, acts, start_s)


def first_acting(parts: list[tuple[int, EventColumns]],
                 acts: Callable[[EventColumns], np.ndarray], start_s: float) -> int:
    """The first iteration holding an event ``acts`` picks at or after ``start_s``."""
    return min(i for i, c in parts if bool((acts(c) & (c.start_s >= start_s)).any()))


def trial(job: Job, kind: str, factor: float, seed: int, period_s: float
          ) -> tuple[int | None, int]:
    """(latency in iterations or None if never named, false alarms) of one run,
    its fault placed by ``seed``."""
    place = placed(scenario(job, seed, 1, "[]"), seed)
    start_s = (ONSET + place.into) * period_s
    s = scenario(job, seed, job.iterations, place.fault(kind, factor, start_s))
    parts = list(iterations_of(source_of(simulate(s)), compact=True))
    onset = onset_of(parts, place, kind, start_s)
    scan = OnlineScan(SIMULATED, gpus_per_node=s.cluster.gpus_per_node, scenario=s)
    latency, false = None, 0
    for i, cols in parts:
        for d in scan.feed(i, cols):
            if d.event != "named":
                continue
            if d.key == place.target(kind) and latency is None:
                latency = d.iteration - onset + 1
            elif d.key != place.target(kind):
                false += 1
    print(f"{s.world_size} {kind} {factor:g}x seed {seed}: {place.target(kind)} from "
          f"{place.into:.2f} into iteration {ONSET}, onset {onset}: latency {latency}, "
          f"{false} false alarms", file=sys.stderr, flush=True)
    return latency, false


def healthy_verdicts(job: Job, seed: int, iterations: int) -> int:
    """The verdicts of one healthy run (each a false alarm); a job without
    jitter is fed its stored rows, one pipeline per class, as its faulty
    runs are (``trial``)."""
    return named_verdicts(scenario(job, seed, iterations, "[]"), compact=not job.jitter)


def named_verdicts(s: Scenario, compact: bool) -> int:
    """How many verdicts on-line MegaScan names over a simulated run of ``s``
    (``compact``: fed the stored rows, one pipeline per class)."""
    scan = OnlineScan(SIMULATED, gpus_per_node=s.cluster.gpus_per_node, scenario=s)
    parts = iterations_of(source_of(simulate(s)), compact=compact)
    return sum(d.event == "named" for i, cols in parts for d in scan.feed(i, cols))


def healthy_false_alarms(job: Job, seeds: int, iterations: int, first_seed: int = 0
                         ) -> tuple[int, int]:
    """(verdicts, iterations) over healthy runs (``seeds`` seeds from
    ``first_seed``), each run's count on stderr as it ends."""
    verdicts = 0
    for seed in range(first_seed, first_seed + seeds):
        found = healthy_verdicts(job, seed, iterations)
        print(f"healthy seed {seed}: {found} verdicts in {iterations} iterations",
              file=sys.stderr, flush=True)
        verdicts += found
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
            f"{per * poisson_upper(verdicts, iterations):.2f}) | | | |")


def deterministic_false_alarm_row(gpus: int, verdicts: int, iterations: int) -> str:
    """A job without jitter: its healthy iterations are alike, so what one run
    draws is its rate (no sampling bound applies)."""
    return (f"| {gpus:,} | healthy, no jitter | | | | {verdicts} in {iterations:,} iterations "
            f"of its one healthy run (every seed and iteration alike) | | | |")


def progress(gpus: int, every: int = 10) -> Callable[[list[Detection]], None]:
    """The loop's report: a line on stderr every ``every`` scanned iterations
    (with the CPU seconds so far) and at each detection, so a long loop shows
    how far it got."""
    scanned = 0

    def report(decided: list[Detection]) -> None:
        nonlocal scanned
        scanned += 1
        for d in decided:
            print(f"{gpus} loop: {d.line()}", file=sys.stderr, flush=True)
        if scanned % every == 0:
            print(f"{gpus} loop: {scanned} iterations scanned, {time.process_time():.0f} CPU s",
                  file=sys.stderr, flush=True)
    return report


def goodput(job: Job, kind: str, factor: float, period_s: float
            ) -> tuple[float, float, float | None]:
    """tokens/s with the loop off and on (seed 0), simulated end to end, and
    the restart cost at which the loop breaks even (None: it did not act)."""
    start_s = GOODPUT_ONSET * period_s
    s = scenario(job, 0, GOODPUT_ITERATIONS, fixed(job).fault(kind, factor, start_s),
                 f"mitigation={{action: exclude, spares: 1, checkpoint_every: 10, "
                 f"restart_s: {20 * period_s}}}")
    loop = close_loop(s, simulate(s), simulate, progress(s.world_size)).to_json()
    print(f"{s.world_size} {kind} {factor:g}x loop: " + "; ".join(
        f"iterations {g['first_iteration']}-{g['first_iteration'] + g['iterations'] - 1} "
        f"in {g['seconds']:.2f} s on dp {g['dp']}" for g in loop["segments"]),
        file=sys.stderr, flush=True)
    restarts = loop["restarts"]
    working_s = loop["seconds"] - restarts * loop["restart_s"]
    even = (loop["seconds_without_loop"] - working_s) / restarts if restarts else None
    return loop["tokens_per_s_without_loop"], loop["tokens_per_s"], even


@dataclass(frozen=True)
class LoopEstimate:
    """The loop's accounting (``mitigate.loop``: a spare, act one iteration
    after the verdict, a checkpoint every 10, restart = 20 healthy
    iterations) over iteration times measured on short runs."""

    healthy_s: float  # an iteration, no fault (and after the spare is in)
    faulty_s: float  # an iteration with the fault
    verdict: int  # the iteration whose end names the fault
    tokens: float  # the job's tokens

    @property
    def stop(self) -> int:
        return self.verdict + 1  # hold_iterations

    @property
    def restart_s(self) -> float:
        return 20 * self.healthy_s

    @property
    def off_s(self) -> float:
        return (GOODPUT_ONSET * self.healthy_s
                + (GOODPUT_ITERATIONS - GOODPUT_ONSET) * self.faulty_s)

    @property
    def on_s(self) -> float:
        checkpoint = (self.stop + 1) // 10 * 10
        return (GOODPUT_ONSET * self.healthy_s + (self.stop + 1 - GOODPUT_ONSET) * self.faulty_s
                + self.restart_s + (GOODPUT_ITERATIONS - checkpoint) * self.healthy_s)

    @property
    def break_even_s(self) -> float:
        """The restart cost at which the loop neither gains nor loses."""
        return self.off_s - (self.on_s - self.restart_s)


def mean_iteration_s(s: Scenario) -> float:
    return statistics.mean(run_iteration_times(simulate(s))[1:])  # past the warm-up


def loop_estimate(job: Job, kind: str, factor: float, latency: int) -> LoopEstimate:
    """``LoopEstimate`` from 3-iteration runs (seed 0), the fault from the start."""
    healthy = scenario(job, 0, 3, "[]")
    faulty = scenario(job, 0, 3, fixed(job).fault(kind, factor, 0.0))
    tokens = (GOODPUT_ITERATIONS * global_batch(healthy.parallel, healthy.model.micro_batch_size)
              * healthy.model.seq_len)
    return LoopEstimate(mean_iteration_s(healthy), mean_iteration_s(faulty),
                        GOODPUT_ONSET + latency - 1, float(tokens))


def estimate_row(gpus: int, kind: str, factor: float, e: LoopEstimate) -> str:
    return (f"| {gpus:,} | {kind} {factor:g}x | {e.healthy_s:.4f} | {e.faulty_s:.4f} "
            f"| {e.verdict} | {e.tokens / e.off_s:,.0f} | {e.tokens / e.on_s:,.0f} "
            f"| {e.restart_s:.2f} | {e.break_even_s:.2f} |")


# ------------------------------------------------------------ torch rows
# Real runs (torch backend, gloo, this machine's CPU): a tiny GPT, tp 1, pp 2,
# dp RANKS/2, 1F1B. A throttle starts TORCH_ONSET_S into the run (on the
# throttled rank's clock); its onset is the first iteration that rank computes
# in after it. An erratic link (link jitter) is erratic from the start. Each
# run is kept (a run directory) and scored by feeding its iterations in order
# to the detector ``run --detect`` uses on torch (``scan_for(live=True)``).
TORCH_CASES = (("throttle", 1.2), ("throttle", 1.3), ("throttle", 1.5),
               ("link_jitter", 0.75), ("healthy", 0.0))
TORCH_ITERATIONS = 20
TORCH_ONSET_S = 0.4
TORCH_THROTTLED = 1
TORCH_OUT = ROOT / "runs" / "online_torch"


def torch_scenario(ranks: int, kind: str, severity: float, seed: int) -> Scenario:
    dp = ranks // 2
    faults = {"throttle": [{"kind": "throttle", "rank": TORCH_THROTTLED, "factor": severity,
                            "start_s": TORCH_ONSET_S}],
              "link_jitter": [{"kind": "link_jitter", "ranks": list(torch_link(ranks)),
                               "sigma": severity}],
              "healthy": []}[kind]
    return parse_scenario({
        "name": f"online-{kind}", "seed": seed, "iterations": TORCH_ITERATIONS,
        "schedule": "1f1b", "parallel": {"tp": 1, "pp": 2, "dp": dp, "microbatches": 4},
        "model": {"layers": 4, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 64,
                  "micro_batch_size": 2},
        "costs": {"p2p_s": REAL_P2P_S}, "faults": faults})


def torch_link(ranks: int) -> tuple[int, int]:
    """The pipeline link of the throttled rank (stage 0) to its stage-1 peer."""
    return TORCH_THROTTLED, TORCH_THROTTLED + ranks // 2


def torch_run_dir(ranks: int, kind: str, severity: float, seed: int) -> Path:
    return TORCH_OUT / f"ranks{ranks}" / torch_case_key(kind, severity) / f"seed{seed}" / "run"


def keep_torch_run(s: Scenario, out: Path) -> None:
    """Run ``s`` for real and keep it as a run directory (published whole or not at all)."""
    from backends.torch import run_scenario

    load = Path("/proc/loadavg").read_text().split()[0]
    result = run_scenario(s)
    with staged_dir(out, force=True) as tmp:
        write_run(s, result, tmp)
        (tmp / "load.txt").write_text(load + "\n")


@dataclass(frozen=True)
class TorchTrial:
    latency: int | None  # iterations from onset until the fault's verdict stands; None: never
    wrong: int  # verdicts naming anything else, or naming the fault before its onset
    correct_at_end: bool  # what stands after the last iteration is the fault (healthy: nothing)
    iterations: int
    load: float


def torch_target(kind: str, ranks: int) -> set[tuple[str, int, int | None]]:
    if kind == "throttle":
        return {("compute", TORCH_THROTTLED, None)}
    if kind == "link_jitter":
        a, b = torch_link(ranks)
        return {("link", a, b), ("link", b, a)}
    return set()


def kept_iterations(run_dir: Path, device: bool = True) -> list[tuple[int, EventColumns]]:
    """A kept run's iterations with their ops' args (the compute ops' ``queued_s``),
    each compute op timed on its device (``on_device``) as ``run --detect`` sees
    it (``device=False``: wall times)."""
    cols, _ = read_columns(run_dir / TRACE_FILE, with_args=True)
    return [(i, on_device(c) if device else c) for i, c in iterations_of(TableSource(cols))]


def score_torch_run(run_dir: Path, kind: str, ranks: int,
                    config: OnlineConfig | None = None) -> TorchTrial:
    """Feed the kept run's iterations in order, as its ranks reported them
    (``config``: the on-line detector's, else what ``run --detect`` uses on torch)."""
    s = scenario_of_run(run_dir)
    assert s is not None, f"{run_dir}: no scenario"
    parts = kept_iterations(run_dir)
    onset = first_acting(parts, lambda c: c.rank == TORCH_THROTTLED, TORCH_ONSET_S) if kind == "throttle" else 0
    scan = scan_for(s, config, live=True)
    target = torch_target(kind, ranks)
    latency, wrong = None, 0
    for i, cols in parts:
        decided = scan.feed(i, cols)
        wrong += sum(d.event == "named" and (d.key not in target or i < onset) for d in decided)
        if latency is None and i >= onset and any(d.key in target for d in scan.named):
            latency = i - onset + 1
    standing = {d.key for d in scan.named}
    correct = standing == target if not target else len(standing) == 1 and standing <= target
    load = float((run_dir / "load.txt").read_text())
    return TorchTrial(latency, wrong, correct, len(parts), load)


def torch_case_name(kind: str, severity: float) -> str:
    return {"throttle": f"throttle {severity:g}x", "link_jitter": f"link jitter sigma {severity:g}",
            "healthy": "healthy"}[kind]


def torch_latencies(kind: str, trials: list[TorchTrial]) -> str:
    """Median and worst latency over the runs that named the fault, how many
    named it within 5 iterations and at all (nothing for healthy runs)."""
    if kind == "healthy":
        return " | | | "
    named = [t.latency for t in trials if t.latency is not None]
    spread = f"{statistics.median(named):g} | {max(named)}" if named else "- | -"
    return f"{spread} | {sum(n <= 5 for n in named)}/{len(trials)} | {len(named)}/{len(trials)}"


def torch_row(ranks: int, kind: str, severity: float, trials: list[TorchTrial]) -> str:
    loads = [t.load for t in trials]
    return (f"| {ranks} | {torch_case_name(kind, severity)} | {len(trials)} "
            f"| {torch_latencies(kind, trials)} "
            f"| {sum(t.wrong for t in trials)} in {sum(t.iterations for t in trials):,} iterations "
            f"| {sum(t.correct_at_end for t in trials)}/{len(trials)} "
            f"| {min(loads):.1f}-{max(loads):.1f} |")


def torch_case_key(kind: str, severity: float) -> str:
    """A case as ``--cases`` names it (and its folder): throttle-1.5, healthy-0."""
    return f"{kind}-{severity:g}"


# ------------------------------------------------------ realized factor
def op_ratio(cols: EventColumns, rank: int, peer: int) -> float:
    """Median over the compute ops both ranks ran of ``rank``'s time over ``peer``'s."""
    def times(r: int) -> dict[tuple[int, int, int], float]:
        rows = np.flatnonzero((cols.kind == COMPUTE_KIND) & (cols.rank == r))
        return {(int(cols.name[i]), int(cols.microbatch[i]), int(cols.chunk[i])):
                float(cols.dur_s[i]) for i in rows}
    mine, theirs = times(rank), times(peer)
    shared = [k for k in mine if theirs.get(k, 0.0) > 0]
    return float(np.median([mine[k] / theirs[k] for k in shared])) if shared else math.nan


def realized_line(ranks: int, kind: str, severity: float, seeds: range) -> str:
    """How much slower the throttled rank's ops are than its dp peer's in each
    iteration after the onset (healthy runs: a stage-1 pair, every iteration),
    on device time and on wall time, over the kept runs."""
    rank, peer = ((TORCH_THROTTLED, TORCH_THROTTLED - 1) if kind == "throttle"
                  else (ranks // 2 + 1, ranks // 2))
    ratios: dict[bool, list[float]] = {True: [], False: []}
    for seed in seeds:
        run_dir = torch_run_dir(ranks, kind, severity, seed)
        if not run_dir.is_dir():
            continue
        for device in ratios:
            parts = kept_iterations(run_dir, device)
            onset = first_acting(parts, lambda c: c.rank == TORCH_THROTTLED,
                                 TORCH_ONSET_S) if kind == "throttle" else -1
            ratios[device] += [op_ratio(c, rank, peer) for i, c in parts if i > onset]

    def spread(v: list[float]) -> str:
        a = np.array([x for x in v if math.isfinite(x)])  # ">= 1.5" as printed
        return (f"median {np.median(a):.2f} (5-95% {np.percentile(a, 5):.2f}-"
                f"{np.percentile(a, 95):.2f}), >= 1.5x in {np.mean(a.round(2) >= 1.5):.0%}")
    return (f"{torch_case_name(kind, severity)}: rank {rank} / rank {peer}, "
            f"{len(ratios[True])} iterations: on device {spread(ratios[True])}; "
            f"wall {spread(ratios[False])}")


def torch_table(ranks: int, seeds: range, replay: bool, config: OnlineConfig | None,
                cases: tuple[tuple[str, float], ...] = TORCH_CASES,
                show: Callable[[str], None] = print) -> None:
    """Run (unless ``replay``) and score ``cases``' seeds, round-robin over the
    cases so that load drifts hit them alike; then print the table of kept runs."""
    if not replay:
        for seed in seeds:
            for kind, severity in cases:
                out = torch_run_dir(ranks, kind, severity, seed)
                if not out.is_dir():
                    keep_torch_run(torch_scenario(ranks, kind, severity, seed), out)
                    print(f"kept {out}", file=sys.stderr, flush=True)
    show("| ranks | fault | runs | latency median | latency worst | named within 5 | named "
         "| wrong names | right after 20 iterations | load (1-min) |")
    show("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for kind, severity in cases:
        kept = [torch_run_dir(ranks, kind, severity, seed) for seed in seeds]
        trials = [score_torch_run(d, kind, ranks, config) for d in kept if d.is_dir()]
        if trials:
            show(torch_row(ranks, kind, severity, trials))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("sim", "torch"), default="sim")
    ap.add_argument("--ranks", type=int, choices=(4, 8), default=4)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--replay", action="store_true",
                    help="torch: score the kept runs only, run nothing")
    ap.add_argument("--cases", default=",".join(torch_case_key(*c) for c in TORCH_CASES),
                    help="torch: the cases to run and score, e.g. throttle-1.5,healthy-0")
    ap.add_argument("--realized", action="store_true", help="torch: after the table, how "
                    "much slower the throttled rank's ops were, on device and wall time")
    ap.add_argument("--confirm", type=int, default=None,
                    help="torch: windows in a row a verdict needs (default: run --detect's)")
    ap.add_argument("--gpus", default="16,1024")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--healthy-seeds", type=int, default=50)
    ap.add_argument("--healthy-iterations", type=int, default=40)
    ap.add_argument("--healthy-first-seed", type=int, default=0)
    ap.add_argument("--goodput-gpus", default="16")
    ap.add_argument("--healthy-only", action="store_true", help="only the false-alarm rows")
    ap.add_argument("--kinds", default="throttle,slow_link", help="fault kinds to run")
    ap.add_argument("--factors", default="", help="only these severities (e.g. 1.5)")
    ap.add_argument("--estimate-gpus", default="", help="sizes whose goodput is estimated "
                    "from measured iteration times (LoopEstimate) after the table")
    results.results_dir_option(ap)
    args = ap.parse_args(argv)
    keys = args.cases.split(",")
    unknown = set(keys) - {torch_case_key(*c) for c in TORCH_CASES}
    if args.backend == "torch" and unknown:
        print(f"online_table.py: --cases: no case {sorted(unknown)[0]}", file=sys.stderr)
        raise SystemExit(2)
    experiment, show, realized = results.start("online_table", argv), results.Printed(), []
    if args.backend == "torch":
        config = None if args.confirm is None else OnlineConfig(confirm=args.confirm)
        seeds = range(args.first_seed, args.first_seed + args.seeds)
        picked = tuple(c for c in TORCH_CASES if torch_case_key(*c) in keys)
        torch_table(args.ranks, seeds, args.replay, config, picked, show)
        if args.realized:
            realized = [realized_line(args.ranks, kind, severity, seeds)
                        for kind, severity in picked]
            print("\n".join(realized))
    else:
        sim_table(args, show)
    parameters = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    recorded = experiment.record_part(args.backend, {"args": parameters, "cells": show.cells(),
                                                     "realized": realized}, args.results_dir)
    print(f"wrote {recorded}")


def sim_table(args: argparse.Namespace, show: Callable[[str], None]) -> None:
    """The simulated rows: detection, false alarms and goodput per job size."""
    show("| GPUs | fault | latency median | latency worst | named | false alarms "
         "| goodput off (tokens/s) | goodput on | break-even restart s |")
    show("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    estimates: list[tuple[int, str, float, LoopEstimate]] = []
    for gpus in [int(g) for g in args.gpus.split(",")]:
        job = JOBS[gpus]
        period = iteration_s(job)
        cases = [(k, f) for k, f in CASES if k in args.kinds.split(",")
                 and (not args.factors or f in [float(x) for x in args.factors.split(",")])]
        for kind, factor in () if args.healthy_only else cases:
            seeds = range(args.seeds)
            outcomes = [trial(job, kind, factor, seed, period) for seed in seeds]
            named = [r[0] for r in outcomes if r[0] is not None]
            if named and str(gpus) in args.estimate_gpus.split(","):
                estimates.append((gpus, kind, factor, loop_estimate(
                    job, kind, factor, int(statistics.median(named)))))
            off, on, even = goodput(job, kind, factor, period) \
                if str(gpus) in args.goodput_gpus.split(",") else (None, None, None)
            show(f"| {gpus:,} | {kind} {factor:g}x "
                 f"| {statistics.median(named) if named else '-'} "
                 f"| {max(named) if len(named) == len(outcomes) else 'missed'} "
                 f"| {len(named)}/{len(outcomes)} | {sum(r[1] for r in outcomes)} "
                 f"| {'-' if off is None else f'{off:,.0f}'} "
                 f"| {'-' if on is None else f'{on:,.0f}'} "
                 f"| {'-' if even is None else f'{even:.2f}'} |")
        if args.healthy_seeds == 0:
            continue
        if not job.jitter:  # every seed is the same run, every iteration the same
            verdicts, iterations = healthy_false_alarms(job, 1, args.healthy_iterations)
            show(deterministic_false_alarm_row(gpus, verdicts, iterations))
            continue
        verdicts, iterations = healthy_false_alarms(job, args.healthy_seeds,
                                                    args.healthy_iterations,
                                                    args.healthy_first_seed)
        show(false_alarm_row(gpus, verdicts, iterations))

    if estimates:
        print()
        show("| GPUs | fault | healthy s/iteration | faulty s/iteration | verdict at "
             "| goodput off (tokens/s) | goodput on | restart s | break-even restart s |")
        show("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for row in estimates:
            show(estimate_row(*row))


if __name__ == "__main__":
    main()
