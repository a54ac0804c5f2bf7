"""MegaScan on ordinary pipeline jobs' traces (``megatronapp.scan.evidence.held``):
a slowed stage is the one the other stages wait for in their receives,
with or without recorded peers; a slow link holds even its fastest
receive, and is named only between ranks the trace shows exchanging
messages. Traces are built to the schema a gloo job profiled with
``torch.profiler`` writes: ``c10d::recv_`` posts the receive and the
``gloo:recv`` range runs until ``wait()`` returns; ``record_shapes`` keeps
each send's and receive's peer in its ``Concrete Inputs``."""
from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from megatronapp.cli import main
from megatronapp.scan.evidence.detect import megascan
from megatronapp.scan.align.inputs import load_scan_input

from .support import MAIN, gloo_file, kineto_event, write_kineto

STAGES, MICROBATCHES, STEPS, MM_US, WAKE_US = 4, 6, 3, 400.0, 2000.0
USED = {frozenset((s, s + 1)) for s in range(STAGES - 1)}


class Pipeline:
    """All forwards of a step, then all backwards (twice as long), stage by
    stage; each stage posts its receive as soon as it is free, then waits.
    ``slow``: rank -> factor of its matmuls; ``descheduled``: rank -> factor
    of every third of its matmuls only; ``link_delay_us``: on link 1-2 each
    receiver sleeps that long between posting a receive and ``wait()``;
    ``starved``: rank -> microseconds each of its own receives finishes late
    (a slowed process on a CPU: its transport threads share its busy cores).
    The machine is loaded: every third receive of a rank wakes ``WAKE_US`` late."""

    def __init__(self, slow: dict[int, float] | None = None, link_delay_us: float = 0.0,
                 shapes: bool = False, descheduled: dict[int, float] | None = None,
                 starved: dict[int, float] | None = None) -> None:
        self.slow, self.delay, self.shapes = slow or {}, link_delay_us, shapes
        self.descheduled, self.starved = descheduled or {}, starved or {}
        self.events: dict[int, list[dict[str, Any]]] = {r: [] for r in range(STAGES)}
        self.free = {r: 0.0 for r in range(STAGES)}
        self.received = {r: 0 for r in range(STAGES)}

    def files(self) -> dict[int, dict]:
        for step in range(STEPS):
            begin = max(self.free.values()) + 100.0
            self.free = {r: begin + 10.0 for r in range(STAGES)}
            ready: dict[tuple[int, int], float] = {}
            for direction in (1, -1):
                for m in range(MICROBATCHES):
                    for r in (range(STAGES) if direction == 1 else reversed(range(STAGES))):
                        self.stage(r, m, step, direction, ready)
            end = max(self.free.values()) + 10.0
            for r in range(STAGES):
                self.events[r].append(kineto_event(f"ProfilerStep#{step}", "user_annotation",
                                                   r, MAIN, begin, end - begin))
        return {r: gloo_file(r, STAGES, evs) for r, evs in self.events.items()}

    def stage(self, r: int, m: int, step: int, direction: int,
              ready: dict[tuple[int, int], float]) -> None:
        source, start = r - direction, self.free[r]
        if 0 <= source < STAGES:
            start = self.receive(r, source, start, ready[(source, m)])
        dur = self.matmul_us(r, m, step) * (1 if direction == 1 else 2)
        self.events[r].append(kineto_event("aten::mm", "cpu_op", r, MAIN, start, dur))
        done = start + dur
        if 0 <= r + direction < STAGES:
            done = self.send(r, r + direction, done)
        ready[(r, m)] = done
        self.free[r] = done

    def matmul_us(self, r: int, m: int, step: int) -> float:
        jitter = 1 + 0.1 * ((5 * m + 3 * r + step) % 4) / 3
        burst = self.descheduled.get(r, 1.0) if m % 3 == 0 else 1.0
        return MM_US * self.slow.get(r, 1.0) * burst * jitter

    def receive(self, r: int, source: int, posted: float, sent: float) -> float:
        sleep = self.delay if {r, source} == {1, 2} else 0.0
        self.received[r] += 1
        late = WAKE_US if self.received[r] % 3 == 0 else 0.0
        arrived = max(posted + 10.0 + sleep, sent + 50.0) + late + self.starved.get(r, 0.0)
        self.events[r] += [
            kineto_event("c10d::recv_", "cpu_op", r, MAIN, posted, 8.0, **self.peer(source)),
            kineto_event("gloo:recv", "user_annotation", r, MAIN, posted + 5, arrived - posted - 5)]
        return arrived + 5.0

    def send(self, r: int, dest: int, at: float) -> float:
        self.events[r] += [
            kineto_event("c10d::send", "cpu_op", r, MAIN, at, 20.0, **self.peer(dest)),
            kineto_event("gloo:send", "user_annotation", r, MAIN, at + 18, 30.0)]
        return at + 50.0

    def peer(self, rank: int) -> dict[str, Any]:
        return {"Concrete Inputs": ["", "", str(rank), "0"]} if self.shapes else {}


class OneFOneB(Pipeline):
    """The same stages run 1F1B: each stage keeps at most (stages − rank)
    microbatches in flight, so a stage's upstream neighbour cannot run ahead
    of it: it waits for the stage's gradient before its next forward, and the
    stage's own forward receives then wait for that neighbour."""

    def files(self) -> dict[int, dict]:
        for step in range(STEPS):
            begin = max(self.free.values()) + 100.0
            self.free = {r: begin + 10.0 for r in range(STAGES)}
            ready: dict[int, dict[tuple[int, int], float]] = {1: {}, -1: {}}
            todo = {r: self.order(r) for r in range(STAGES)}
            while any(todo.values()):
                for r in range(STAGES):
                    while todo[r] and self.can_run(r, *todo[r][0], ready):
                        direction, m = todo[r].pop(0)
                        self.stage(r, m, step, direction, ready[direction])
            end = max(self.free.values()) + 10.0
            for r in range(STAGES):
                self.events[r].append(kineto_event(f"ProfilerStep#{step}", "user_annotation",
                                                   r, MAIN, begin, end - begin))
        return {r: gloo_file(r, STAGES, evs) for r, evs in self.events.items()}

    @staticmethod
    def order(r: int) -> list[tuple[int, int]]:
        """(direction, microbatch) in 1F1B order: warm-up forwards, then one
        forward and one backward at a time, then the last backwards."""
        warm = min(STAGES - r - 1, MICROBATCHES)
        steady = [op for m in range(MICROBATCHES - warm) for op in ((1, m + warm), (-1, m))]
        return ([(1, m) for m in range(warm)] + steady
                + [(-1, m) for m in range(MICROBATCHES - warm, MICROBATCHES)])

    @staticmethod
    def can_run(r: int, direction: int, m: int,
                ready: dict[int, dict[tuple[int, int], float]]) -> bool:
        source = r - direction
        return not 0 <= source < STAGES or (source, m) in ready[direction]


def scan_of(tmp_path, schedule: type[Pipeline] = Pipeline, **pipeline: Any):
    return load_scan_input(write_kineto(tmp_path, schedule(**pipeline).files()))


def causes(scan) -> list[tuple[str, int, int | None]]:
    return [(c.kind, c.rank, c.peer) for c in megascan(scan).root_causes]




def named(scan) -> list[tuple[str, int, int | None]]:
    return [(c.kind if c.kind == "link" else "rank", c.rank, c.peer)
            for c in megascan(scan).root_causes]


@pytest.mark.parametrize("schedule", [Pipeline, OneFOneB])
@pytest.mark.parametrize("shapes", [False, True])
def test_a_slowed_middle_stage_is_named_against_the_other_middle_stage(tmp_path, schedule, shapes):
    """Stages 1 and 2 communicate alike (a receive and a send each way): each
    is the other's peer; the end stages, which do not, are not compared."""
    d = megascan(scan_of(tmp_path, schedule, slow={2: 2.0}, shapes=shapes))
    first = d.root_causes[0]
    assert (first.rank, first.kind) == (2, "compute")
    assert first.evidence["expected_from"] == "peers" and first.evidence["blame_s"] > 0
    assert 1 in d.victims  # its peer stage waited for it


@pytest.mark.parametrize("schedule", [Pipeline, OneFOneB])
def test_a_healthy_pipeline_names_nobody(tmp_path, schedule):
    assert named(scan_of(tmp_path, schedule)) == []


def test_an_end_stage_with_more_work_is_not_judged_against_the_middle_ones(tmp_path):
    # the last stage communicates with one neighbour only: it has no peer, and
    # is the bottleneck (where the time goes) without being a root cause
    d = megascan(scan_of(tmp_path, slow={STAGES - 1: 1.5}))
    assert d.healthy
    assert d.bottleneck["rank"] == STAGES - 1


def test_a_slow_link_is_named_as_the_link_it_is(tmp_path):
    d = megascan(scan_of(tmp_path, link_delay_us=3000.0, shapes=True))
    top = d.root_causes[0]
    assert (top.kind, {top.rank, top.peer}) == ("link", {1, 2})


@pytest.mark.parametrize("fault", [dict(slow={2: 2.0}), dict(link_delay_us=3000.0)])
def test_a_link_the_job_never_used_is_never_named(tmp_path, fault):
    for c in megascan(scan_of(tmp_path, shapes=True, **fault)).root_causes:
        if c.kind == "link":
            assert frozenset((c.rank, c.peer)) in USED


def test_detect_leads_with_the_blame_of_the_slowed_stage(tmp_path, capsys):
    folder = write_kineto(tmp_path, OneFOneB(slow={2: 2.0}).files())
    assert main(["detect", str(folder)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("root cause: rank 2 (compute")
    assert lines[1].startswith("  blame: ") and "% )" not in lines[1]
    assert "bottleneck: rank" in "\n".join(lines)
