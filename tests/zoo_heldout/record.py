"""Record a set of real traces: every job of a plan run healthy (a few
times) and once under each fault, its torch.profiler traces kept in
``OUT/<run>/`` and what was injected, with what the traces show of it, in
``OUT/manifest.json``. Run as a module it records the held-out set of
``tests/zoo_heldout`` (four healthy runs per job); other sets
(``tests/zoo_heldout2/record.py``, ``experiments.zoo_tuning``) pass their
own ``Plan`` to ``record`` or ``main``.

Every run: 4 gloo ranks, 4 traced steps (``ProfilerStep#2`` to ``#5``; a plan may say more),
gzipped traces, the job in a network namespace of its own (so shaped links
and healthy runs share one loopback setup), under ``nice -n 10``. Ranks,
links and which runs record shapes are drawn from a generator seeded with
the run's name; a stall lasts half the job's median iteration in its first
healthy run (so each job's first healthy run comes first; the other runs
follow in an order shuffled once, so that the machine's changing load is
not confounded with the faults).

    python -m tests.zoo_heldout.record [--out tests/data/heldout] [--resume]

Refuses (status 2) while the jobs, the launcher or this recorder have
uncommitted changes: the manifest names the commit that froze them.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from tests.zoo.injection import steps_hit
from tests.zoo.measure import (by_rank, calls_per_step, excess_over_peers_ms, healthy_spread,
                               link_waits_ms, median_step_ms, over_peers, run_measures)

ROOT = Path(__file__).resolve().parents[2]
JOBS_DIR, LAUNCHER_DIR = Path("tests/zoo_heldout"), Path("tests/zoo")  # JOBS_DIR: the recorder
WORLD, STEPS, FIRST_TRACED = 4, 4, 2  # the launcher skips one step and warms up one
TRACED = list(range(FIRST_TRACED, FIRST_TRACED + STEPS))
HEALTHY_RUNS, SHAPES_SHARE, LINK_MS = 4, 1 / 3, (3.0, 10.0)
SLOWDOWNS = (1.5, 2.0)  # the factors of the runs with one slowed rank


@dataclass(frozen=True)
class Channel:
    """A kind of point-to-point channel of a job: its (sender, receiver)
    pairs and the bytes of one message on it."""
    kind: str
    pairs: tuple[tuple[int, int], ...]
    message_bytes: int


@dataclass(frozen=True)
class Job:
    name: str
    channels: tuple[Channel, ...] = ()
    readers: tuple[int, ...] = tuple(range(WORLD))  # the ranks whose data loader runs
    # rank pairs that may not both be slowed: no healthy rank would do their work
    exclusive: tuple[frozenset[int], ...] = ()
    home: Path | None = None  # the folder of its module, when not the plan's jobs_dir


RING_DOWN = tuple((r, (r + 1) % WORLD) for r in range(WORLD))
RING_UP = tuple((r, (r - 1) % WORLD) for r in range(WORLD))
CHAIN_DOWN = tuple((r, r + 1) for r in range(WORLD - 1))
JOBS = (
    Job("ddp_convnet"), Job("ddp_gpt"), Job("ddp_accumulate"), Job("fsdp1_mlp"),
    Job("zero_adam"), Job("alltoall_moe"),
    Job("halo_ring", (Channel("halo down", RING_DOWN, 4 * 32 * 128 * 4),
                      Channel("halo up", RING_UP, 4 * 32 * 128 * 4))),
    Job("gpipe", (Channel("forward", CHAIN_DOWN, 64 * 512 * 4),
                  Channel("backward", tuple((b, a) for a, b in CHAIN_DOWN), 64 * 512 * 4)),
        readers=(0, WORLD - 1)),
    Job("pipeline_dp", (Channel("forward", ((0, 2), (1, 3)), 128 * 512 * 4),
                        Channel("backward", ((2, 0), (3, 1)), 128 * 512 * 4)),
        exclusive=(frozenset({0, 1}), frozenset({2, 3}))),
)


@dataclass(frozen=True)
class Plan:
    """What a set records: its jobs (modules of ``jobs_dir``), each run
    ``healthy`` times and once per fault, a single slowed rank at each of
    ``slowdowns``; the runs after the first healthy ones in an order
    shuffled by ``shuffle_seed``; ``shapes_share`` of the fault runs drawn
    to record shapes (traces with shapes are larger); ``steps`` traced
    iterations a run; ``faults``, when given, the labels of the fault runs
    kept (``step-stall``, ``slow-2x``...; every fault when None)."""
    jobs: tuple[Job, ...]
    jobs_dir: Path
    healthy: int = HEALTHY_RUNS
    slowdowns: tuple[float, ...] = SLOWDOWNS
    shuffle_seed: str = "heldout"
    shapes_share: float = SHAPES_SHARE  # of the fault runs other than slow links
    steps: int = STEPS
    faults: tuple[str, ...] | None = None

    def runs(self, job: Job, stall_ms: float) -> list[Run]:
        """``job``'s healthy runs, then its fault runs."""
        return (healthy_runs(job, self.healthy)
                + fault_runs(job, stall_ms, self.slowdowns, self.shapes_share, self.faults))


HELDOUT = Plan(JOBS, JOBS_DIR)


@dataclass
class Run:
    name: str
    job: Job
    faults: list[dict[str, Any]] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)
    record_shapes: bool = False


# ------------------------------------------------------------------ the plan
def healthy_runs(job: Job, count: int = HEALTHY_RUNS) -> list[Run]:
    return [Run(f"{job.name}-healthy-{i}", job, record_shapes=i % 2 == 1)
            for i in range(count)]


def fault_runs(job: Job, stall_ms: float, slowdowns: tuple[float, ...] = SLOWDOWNS,
               shapes_share: float = SHAPES_SHARE,
               faults: tuple[str, ...] | None = None) -> list[Run]:
    """One run of ``job`` per fault (of ``faults``' labels, when given), ranks
    and links drawn per run."""
    makers: list[tuple[str, Any]] = [
        (f"slow-{factor:g}x", lambda g, f=factor: slowed(g, job, f, 1)) for factor in slowdowns]
    makers += [("extra-calls-2x", lambda g: extra_calls(g)),
              ("loader-stall", lambda g: loader_stall(g, job, stall_ms)),
              ("step-stall", lambda g: step_stall(g, stall_ms)),
              ("intermittent-2x-every-3", lambda g: slowed(g, job, 2.0, 1, every=3)),
              ("noisy-neighbour", lambda g: noisy(g)),
              ("two-slowed-2x", lambda g: slowed(g, job, 2.0, 2))]
    if faults is not None:
        assert set(faults) <= {label for label, _ in makers}, faults
        makers = [(label, make) for label, make in makers if label in faults]
    runs = [drawn(f"{job.name}-{label}", job, make, share=shapes_share) for label, make in makers]
    for channel in job.channels if faults is None else ():
        for shapes in (True, False):
            kind = channel.kind.replace(" ", "-")
            label = f"{job.name}-link-{kind}-{'shapes' if shapes else 'plain'}"
            runs.append(drawn(label, job, lambda g, c=channel: shaped(g, c), shapes))
    if job.channels and faults is None:
        runs.append(drawn(f"{job.name}-slow-2x-and-link", job,
                          lambda g: merged(slowed(g, job, 2.0, 1), shaped(g, job.channels[0]))))
    return runs


def drawn(name: str, job: Job, make: Any, shapes: bool | None = None,
          share: float = SHAPES_SHARE) -> Run:
    """A run whose choices come from a generator seeded with its name
    (``record_shapes`` too, with chance ``share``, unless ``shapes`` says)."""
    g = random.Random(name)
    faults, flags = make(g)
    record_shapes = g.random() < share if shapes is None else shapes
    return Run(name, job, faults, flags, record_shapes)


Drawn = tuple[list[dict[str, Any]], list[str]]


def slowed(g: random.Random, job: Job, factor: float, count: int, every: int = 1) -> Drawn:
    while True:
        ranks = sorted(g.sample(range(WORLD), count))
        if frozenset(ranks) not in job.exclusive:
            break
    fault = {"kind": "slow_rank", "ranks": ranks, "factor": factor,
             "how": "bigger matmuls: (F-1)x extra rows of input", "every": every}
    flags = ["--slow-rank", *map(str, ranks), "--factor", str(factor)]
    return [fault], flags + (["--every", str(every)] if every > 1 else [])


def extra_calls(g: random.Random) -> Drawn:
    rank = g.randrange(WORLD)
    return ([{"kind": "extra_calls", "ranks": [rank], "factor": 2.0,
              "how": "each matmul, convolution, attention and LSTM called twice, same shapes"}],
            ["--extra-rank", str(rank), "--extra-factor", "2"])


def loader_stall(g: random.Random, job: Job, ms: float) -> Drawn:
    rank = g.choice(job.readers)
    return ([{"kind": "loader_stall", "ranks": [rank], "ms": ms,
              "how": "CPU-bound Python in the dataset's __getitems__, ms per batch"}],
            ["--loader-rank", str(rank), "--loader-ms", str(ms)])


def step_stall(g: random.Random, ms: float) -> Drawn:
    rank = g.randrange(WORLD)
    return ([{"kind": "optimizer_step_stall", "ranks": [rank], "ms": ms,
              "how": "sleeps before each optimizer.step()"}],
            ["--step-stall-rank", str(rank), "--step-stall-ms", str(ms)])


def noisy(g: random.Random) -> Drawn:
    rank = g.randrange(WORLD)
    return ([{"kind": "noisy_neighbour", "ranks": [rank],
              "how": "a thread in the rank's process: Python arithmetic and torch sorts"}],
            ["--noisy-rank", str(rank)])


def shaped(g: random.Random, channel: Channel) -> Drawn:
    sender, receiver = g.choice(channel.pairs)
    delay_ms = round(g.uniform(*LINK_MS), 1)
    mbit = round(channel.message_bytes * 8 / (delay_ms * 1e3), 2)
    return ([{"kind": "slow_link", "channel": channel.kind, "sender": sender,
              "receiver": receiver, "mbit": mbit, "message_bytes": channel.message_bytes,
              "nominal_delay_ms": delay_ms,
              "how": "kernel rate limit (HTB) on everything the sender sends the receiver"}],
            ["--shaped-link", str(sender), str(receiver), "--link-mbit", str(mbit)])


def merged(*parts: Drawn) -> Drawn:
    return [f for faults, _ in parts for f in faults], [x for _, flags in parts for x in flags]


# ------------------------------------------------------------------ a run
def command(run: Run, out: Path, jobs_dir: Path = JOBS_DIR, steps: int = STEPS) -> list[str]:
    return (["nice", "-n", "10", "python", str((run.job.home or jobs_dir) / f"{run.job.name}.py"),
             "--out", str(out), "--world", str(WORLD), "--steps", str(steps), "--gzip",
             "--private-network"] + (["--record-shapes"] if run.record_shapes else [])
            + run.flags)


def execute(run: Run, out: Path, jobs_dir: Path = JOBS_DIR, steps: int = STEPS) -> dict[str, Any]:
    """Run it, ``steps`` iterations traced; its manifest entry (without the
    realized effects)."""
    argv = command(run, out, jobs_dir, steps)
    env = {**os.environ, "PYTHONPATH": str(LAUNCHER_DIR)}
    load_before, start = os.getloadavg(), time.monotonic()
    result = subprocess.run([*argv[:3], sys.executable, *argv[4:]], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"{run.name} failed:\n{result.stderr[-3000:]}")
    for fault in run.faults:
        fault["steps_hit"] = steps_hit(fault.get("every", 1), FIRST_TRACED, steps)
    traced = list(range(FIRST_TRACED, FIRST_TRACED + steps))
    return {"run": run.name, "job": run.job.name, "command": shlex.join(argv),
            "record_shapes": run.record_shapes, "traced_steps": traced, "faults": run.faults,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "wall_s": round(time.monotonic() - start, 1),
            "load": {"before": [round(x, 2) for x in load_before],
                     "after": [round(x, 2) for x in os.getloadavg()]}}


def realized(entry: dict[str, Any], out: Path) -> dict[str, Any]:
    """What the run's traces show of each injected fault (and of noise)."""
    measures = run_measures(out)
    found: dict[str, Any] = {"median_step_ms": round(median_step_ms(measures), 2),
                             **rounded(healthy_spread(measures))}
    for fault in entry["faults"]:
        found[fault["kind"]] = rounded(effect(fault, measures, out))
    return found


def effect(fault: dict[str, Any], measures: Any, out: Path) -> dict[str, Any]:
    hit = fault["steps_hit"]
    if fault["kind"] == "slow_link":
        return link_waits_ms(by_rank(out), fault["sender"], fault["receiver"])
    ranks = fault["ranks"]
    compute = over_peers(measures, ranks, "compute", hit)
    outside = excess_over_peers_ms(measures, ranks, "outside", hit)
    step = median_step_ms(measures)
    found: dict[str, Any] = {"compute_over_peers": keyed(compute),
                             "outside_ops_excess_ms": keyed(outside),
                             "outside_ops_excess_share": keyed({r: v / step
                                                                for r, v in outside.items()})}
    if fault["kind"] == "extra_calls":
        typical = statistics.median(calls_per_step(measures, r, hit)
                                    for r in measures if r not in ranks)
        found["calls_over_peers"] = keyed({r: calls_per_step(measures, r, hit) / typical
                                           for r in ranks})
    return found


def keyed(values: dict[int, float]) -> dict[str, float]:
    return {str(k): v for k, v in values.items()}


def rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    return value


# ------------------------------------------------------------------ the set
def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()


def machine() -> dict[str, Any]:
    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"host": platform.node(), "platform": platform.platform(), "cpu": model,
            "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__}


def stall_ms(entries: list[dict[str, Any]], job: Job) -> float:
    """Half the median iteration of the job's first healthy run, to 5 ms."""
    first = healthy_runs(job)[0].name
    step = next(e["realized"]["median_step_ms"] for e in entries if e["run"] == first)
    return max(5.0, 5.0 * round(step / 2 / 5.0))


def save(path: Path, manifest: dict[str, Any]) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(manifest, indent=1) + "\n")
    partial.replace(path)


def record(out: Path, resume: bool, plan: Plan = HELDOUT) -> int:
    manifest_path = out / "manifest.json"
    if manifest_path.exists() and not resume:
        print(f"--out: {manifest_path} exists (the set is frozen; --resume to finish it)",
              file=sys.stderr)
        return 2
    frozen_paths = sorted({str(plan.jobs_dir), str(JOBS_DIR), str(LAUNCHER_DIR),
                           *(str(job.home) for job in plan.jobs if job.home)})
    if git("status", "--porcelain", "--", *frozen_paths):
        print("tests/zoo*: uncommitted changes; commit the jobs first, the manifest names "
              "the commit that froze them", file=sys.stderr)
        return 2
    manifest: dict[str, Any] = (
        json.loads(manifest_path.read_text()) if manifest_path.exists() else
        {"frozen_at_commit": git("rev-parse", "HEAD"), "machine": machine(),
         "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "runs": []})
    frozen = manifest["frozen_at_commit"]
    if git("diff", frozen, "HEAD", "--", *frozen_paths):
        print(f"--resume: tests/zoo* changed since {frozen}, which froze the runs recorded",
              file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    sizing = [healthy_runs(job)[0] for job in plan.jobs]
    record_runs(sizing, out, manifest, manifest_path, 0, plan.jobs_dir, plan.steps)
    rest = [run for job in plan.jobs for run in
            plan.runs(job, stall_ms(manifest["runs"], job))[1:]]
    random.Random(plan.shuffle_seed).shuffle(rest)
    record_runs(rest, out, manifest, manifest_path, len(sizing), plan.jobs_dir, plan.steps)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{len(manifest['runs'])} runs, {size / 1e6:.1f} MB in {out}")
    return 0


def record_runs(runs: list[Run], out: Path, manifest: dict[str, Any], manifest_path: Path,
                done_before: int, jobs_dir: Path = JOBS_DIR, steps: int = STEPS) -> None:
    recorded = {e["run"] for e in manifest["runs"]}
    for i, run in enumerate(runs, done_before + 1):
        if run.name in recorded:
            continue
        folder = out / run.name
        if folder.exists():  # left by an interrupted run
            for path in folder.iterdir():
                path.unlink()
        entry = execute(run, folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder,
                        jobs_dir, steps)
        entry["realized"] = realized(entry, folder)
        manifest["runs"].append(entry)
        save(manifest_path, manifest)
        print(f"[{i}] {run.name}: {entry['wall_s']} s, load {entry['load']['after'][0]}",
              flush=True)


def main(argv: list[str] | None = None, plan: Plan = HELDOUT,
         out: Path = ROOT / "tests" / "data" / "heldout", description: str = __doc__) -> int:
    parser = argparse.ArgumentParser(description=description.splitlines()[0])
    parser.add_argument("--out", type=Path, default=out)
    parser.add_argument("--resume", action="store_true",
                        help="finish an interrupted recording (the runs it lacks)")
    args = parser.parse_args(argv)
    return record(args.out.resolve(), args.resume, plan)


if __name__ == "__main__":
    sys.exit(main())
