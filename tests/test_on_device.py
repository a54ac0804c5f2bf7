"""On-line MegaScan on real CPU ranks judges each compute op by the time it held
its core (``queued_s``: the time its thread waited to run is left out). Here a
healthy rank that a loaded machine descheduled for a few iterations is built
from a simulated run: its ops last longer, and say by how much they waited."""
from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from experiments import online_table as table
from megatronapp.scan.online.live import QUEUED, LiveFeed, scan_for
from megatronapp.scenario.config import Scenario, parse_scenario
from megatronapp.trace.events import Event, RunResult
from megatronapp.trace.kinds import event_kind
from megatronapp.trace.summary import run_iteration_times
from sim import simulate

from .support import run_cli

DESCHEDULED = 0  # the throttled rank's dp peer: their ops are compared
LOAD_FACTOR = 2.5  # its ops last this much longer while others hold the cores


def job(kind: str, iterations: int = 20) -> Scenario:
    """The table's torch job on the simulator, with computes long enough that
    the throttle starts a few iterations in."""
    s = table.torch_scenario(4, kind, 1.5, 0)
    return s.model_copy(update={"iterations": iterations, "costs": s.costs.model_copy(
        update={"forward_s": 0.005, "backward_s": 0.01})})


def period_s(s: Scenario) -> float:
    return statistics.mean(run_iteration_times(simulate(s.model_copy(update={"faults": ()}))))


def descheduled(s: Scenario, windows: list[tuple[float, float]]) -> RunResult:
    """``s`` run with rank ``DESCHEDULED`` kept off its core ``windows`` of the time:
    its computes there last ``LOAD_FACTOR`` times longer, the difference in ``queued_s``."""
    load = [{"kind": "throttle", "rank": DESCHEDULED, "factor": LOAD_FACTOR, "start_s": a,
             "end_s": b} for a, b in windows]
    result = simulate(parse_scenario({**s.model_dump(mode="json", exclude_none=True),
                                      "faults": [f.model_dump(mode="json") for f in s.faults]
                                      + load}))

    def queued(e: Event) -> float:
        inside = sum(max(0.0, min(e.end_s, b) - max(e.start_s, a)) for a, b in windows)
        return inside * (1 - 1 / LOAD_FACTOR)

    def with_queue(rank: int, e: Event) -> Event:
        if event_kind(e.name, e.args) != "compute":
            return e
        return Event(e.name, e.start_s, e.dur_s,
                     {**e.args, QUEUED: queued(e) if rank == DESCHEDULED else 0.0})

    events = {r: [with_queue(r, e) for e in es] for r, es in result.events.items()}
    return replace(result, events=events, source=None)


def bursts(s: Scenario) -> list[tuple[float, float]]:
    """A spell of several of its (slowed) iterations off the core, from the
    third on: long enough that wall times name the rank."""
    p = period_s(s)
    return [(2 * p, (2 + 5 * LOAD_FACTOR) * p)]


def kept(tmp: Path, s: Scenario, result: RunResult) -> Path:
    out = tmp / "run"
    out.mkdir(parents=True)
    table.write_run(s, result, out)
    (out / "load.txt").write_text("1.0\n")
    return out


def test_a_throttle_beside_a_descheduled_peer_is_named_in_time_and_the_peer_never(
        tmp_path: Path) -> None:
    s = job("throttle")
    scored = table.score_torch_run(kept(tmp_path, s, descheduled(s, bursts(s))), "throttle", 4)
    assert scored.latency is not None and scored.latency <= 5
    assert scored.wrong == 0 and scored.correct_at_end


def test_watch_of_a_torch_run_directory_names_the_throttle_not_the_descheduled_peer(
        tmp_path: Path) -> None:
    """``megatronapp watch`` reads each op's ``queued_s`` from the run directory
    and judges its time on the device, as ``run --detect`` does: on wall
    times the descheduled healthy rank is named."""
    s = job("throttle")
    done = run_cli("watch", str(kept(tmp_path, s, descheduled(s, bursts(s)))), "--json")
    assert done.returncode == 0, done.stderr
    named = {json.loads(line)["rank"] for line in done.stdout.splitlines()
             if json.loads(line)["event"] == "named"}
    assert named == {table.TORCH_THROTTLED}


def feed_live(s: Scenario, result: RunResult, drop_queue: bool) -> list[tuple[str, int]]:
    """What ``run --detect`` names, fed the events as ranks report them
    (``drop_queue``: as if the ranks had not said how long they waited)."""
    made: list = []
    feed = LiveFeed(scan_for(s, live=True), s.world_size, made.extend)
    stream = sorted(((e.end_s, r, e) for r, es in result.events.items() for e in es),
                    key=lambda x: x[0])
    for _, rank, e in stream:
        args = {k: v for k, v in e.args.items() if not (drop_queue and k == QUEUED)}
        feed.record(rank, Event(e.name, e.start_s, e.dur_s, args))
    feed.finish()
    return [(d.event, d.rank) for d in made]


def test_a_healthy_rank_descheduled_for_iterations_on_end_is_named_by_nobody_live() -> None:
    s = job("healthy")
    result = descheduled(s, bursts(s))
    assert feed_live(s, result, drop_queue=False) == []
    # the same run judged on wall times names the rank the machine slowed
    assert ("named", DESCHEDULED) in feed_live(s, result, drop_queue=True)


def test_the_loops_record_of_a_live_job_judges_ops_on_their_device_too() -> None:
    """Real ranks that never stopped: the record the loop scans again after the
    run says what the live scan said (nothing), not what wall times say."""
    from megatronapp.mitigate.loop import close_loop
    from megatronapp.scenario.config import Mitigation

    s = job("healthy").model_copy(update={"mitigation": Mitigation(action="exclude")})
    result = descheduled(s, bursts(s))
    loop = close_loop(s, result, simulate, lambda _: None, scan_for(s, live=True).config,
                      live=lambda: None)
    assert loop.detections == () and len(loop.segments) == 1


def test_the_realized_factor_is_the_throttles_on_device_time_and_hidden_on_wall_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run kept like the table's: the throttled rank's ops take 1.5x its
    peer's on device time in every iteration after the onset; on wall time the
    peer's waits to run hide it in some."""
    monkeypatch.setattr(table, "TORCH_OUT", tmp_path)
    s = job("throttle")
    run_dir = table.torch_run_dir(4, "throttle", 1.5, 0)
    run_dir.mkdir(parents=True)
    table.write_run(s, descheduled(s, bursts(s)), run_dir)
    device, wall = table.realized_line(4, "throttle", 1.5, range(1)).split("; wall ")
    assert "on device median 1.50 (5-95% 1.50-1.50), >= 1.5x in 100%" in device
    assert ">= 1.5x in 100%" not in wall
