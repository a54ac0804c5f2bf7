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
from megatronapp.scan.evidence.detect import durations_of, megascan, wait_members
from megatronapp.scan.evidence.held import held_links, holding_stages
from megatronapp.scan.align.inputs import load_scan_input
from megatronapp.scan.evidence.waits import WaitAccumulator

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


@pytest.mark.parametrize("shapes", [False, True])
def test_a_slowed_stage_is_the_one_the_others_wait_for_with_or_without_peers(tmp_path, shapes):
    diagnosis = megascan(scan_of(tmp_path, slow={2: 1.5}, shapes=shapes))
    first = diagnosis.root_causes[0]
    assert (first.kind, first.rank) == ("compute", 2)
    assert first.evidence["rests_on"] == ["compute", "waits"]
    held = first.evidence["held_stages"]
    assert held["receive_s"] < held["others_receive_s"]
    assert not [c for c in diagnosis.root_causes if c.kind == "link"]


@pytest.mark.parametrize("shapes", [False, True])
def test_a_healthy_pipeline_names_nobody(tmp_path, shapes):
    assert causes(scan_of(tmp_path, shapes=shapes)) == []


def held_ranks(scan) -> list[int]:
    return [h.rank for h in holding_stages(waits_of(scan), durations_of(scan),
                                           {r: (r,) for r in range(STAGES)})]


@pytest.mark.parametrize("end", [0, STAGES - 1])
def test_an_end_stage_with_more_work_of_its_own_is_not_judged_against_the_middle_ones(
        tmp_path, end):
    # the first and last stages receive from one side only and do work of
    # their own (the loss, an embedding, an output layer): 1.5x the middle
    # stages' matmuls there is how the job is built, not a fault
    assert held_ranks(scan_of(tmp_path, slow={end: 1.5})) == []


@pytest.mark.parametrize("shapes", [False, True])
def test_a_slowed_middle_stage_is_judged_against_the_middle_stages_only(tmp_path, shapes):
    # Megatron's end stages hold the embedding and the output layer: twice
    # a middle stage's work; rank 2 slowed 1.5x is still the one held
    assert held_ranks(scan_of(tmp_path, slow={0: 2.0, 2: 1.5, STAGES - 1: 2.0},
                              shapes=shapes)) == [2]


def test_a_middle_stage_slowed_in_two_microbatches_of_three_is_held(tmp_path):
    # every third microbatch runs at the others' speed (the machine gave it
    # a core of its own now and then): its fastest tenth is theirs, its
    # lower quartile and median are slow
    assert held_ranks(scan_of(tmp_path, slow={2: 2.0}, descheduled={2: 0.5})) == [2]


def test_a_stage_slow_only_now_and_then_is_not_named(tmp_path):
    # every third matmul of rank 1 is 3x (a process the machine deschedules):
    # the others wait for it, but its typical and fastest runs are theirs
    assert causes(scan_of(tmp_path, descheduled={1: 3.0})) == []


def test_a_link_whose_receivers_sleep_before_wait_is_named_slow_from_its_fastest_receive(tmp_path):
    diagnosis = megascan(scan_of(tmp_path, link_delay_us=3000.0, shapes=True))
    assert [(c.kind, c.rank, c.peer) for c in diagnosis.root_causes] == [("link", 1, 2)]
    evidence = diagnosis.root_causes[0].evidence
    assert evidence["problem"] == "slow"
    assert evidence["receive_floor_s"] >= 3e-3 > 3 * evidence["class_receive_floor_s"]


def test_without_peers_a_slow_link_is_named_from_the_peers_its_timing_forces(tmp_path):
    # no receive says whom it was from; the peers that every matching of
    # sends to receives gives them name the link, and no stage is named
    assert causes(scan_of(tmp_path, link_delay_us=3000.0)) == [("link", 1, 2)]


@pytest.mark.parametrize("fault", [{"slow": {1: 2.0}}, {"link_delay_us": 3000.0}, {}])
def test_a_link_the_job_never_used_is_never_named(tmp_path, fault):
    for shapes in (False, True):
        named = {frozenset((c.rank, c.peer)) for c in megascan(
            scan_of(tmp_path / str(shapes), shapes=shapes, **fault)).root_causes
            if c.kind == "link"}
        assert named <= USED


def test_a_link_is_judged_against_the_others_of_its_class_only(tmp_path):
    # on one node the three pipeline links are one class; on nodes of two
    # ranks link 1-2 is the only one between nodes, with none to judge against
    scores = waits_of(scan_of(tmp_path, link_delay_us=3000.0, shapes=True))
    assert [(c.rank, c.peer) for c in held_links(scores, gpus_per_node=8)] == [(1, 2)]
    assert held_links(scores, gpus_per_node=2) == []


def waits_of(scan, cuts: int = 1):
    cols, op = wait_members(scan)
    acc = WaitAccumulator()
    for part in np.array_split(np.arange(len(op)), cuts):
        acc.feed(cols.take(part), op[part])
    for part in np.array_split(np.arange(len(scan.cols)), cuts):
        acc.feed_receives(scan.cols.take(part))
    return acc.scores()


@pytest.mark.parametrize("cuts", [2, 7])
def test_receive_times_and_fastest_receives_are_the_same_however_the_input_is_cut(tmp_path, cuts):
    scan = scan_of(tmp_path, slow={1: 1.5}, shapes=True)
    whole, cut = waits_of(scan), waits_of(scan, cuts)
    assert cut.receiving == pytest.approx(whole.receiving)
    assert cut.receives == whole.receives
    assert [c.fastest_receive_s for c in cut.channels] == [
        c.fastest_receive_s for c in whole.channels]


def test_detect_says_how_long_the_others_waited_for_the_stage(tmp_path, capsys):
    write_kineto(tmp_path, Pipeline(slow={2: 2.0}).files())
    assert main(["detect", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("root cause: rank 2 (compute")
    held = [line for line in lines if line.startswith("  the other stages waited in their")]
    assert len(held) == 1
    ratio = float(held[0].split("at its fastest its main op takes ")[1].removesuffix("x theirs"))
    assert 1.9 < ratio < 2.1  # its matmuls are twice the others'
    assert "  evidence: compute and waits" in lines


def test_detect_says_how_long_the_slow_links_fastest_receive_took(tmp_path, capsys):
    write_kineto(tmp_path, Pipeline(link_delay_us=3000.0, shapes=True).files())
    assert main(["detect", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("root cause: link 1 <-> 2 (slow")
    assert "its fastest receive (posted to done) took 3.0" in lines[1]


def test_in_1f1b_a_slowed_stage_is_named_not_the_links_its_pacing_makes_wait(tmp_path):
    # 1F1B keeps the upstream stage from running ahead, so the slowed
    # stage's own forward receives wait too; without peers the matching of
    # sends to receives then makes its link's deliveries look late: that
    # waiting is the stage's doing, not the link's
    assert causes(scan_of(tmp_path, OneFOneB, slow={1: 2.0})) == [("compute", 1, None)]


@pytest.mark.parametrize("shapes", [False, True])
def test_in_1f1b_a_healthy_pipeline_names_nobody(tmp_path, shapes):
    assert causes(scan_of(tmp_path, OneFOneB, shapes=shapes)) == []


def test_in_1f1b_a_slow_link_is_still_named_from_its_receives(tmp_path):
    assert causes(scan_of(tmp_path, OneFOneB, link_delay_us=3000.0, shapes=True)) == [
        ("link", 1, 2)]


def test_detect_names_the_slowed_1f1b_stage_and_no_link(tmp_path, capsys):
    # the command a user runs on the traces their 1F1B job wrote
    write_kineto(tmp_path, OneFOneB(slow={1: 2.0}).files())
    assert main(["detect", str(tmp_path), "--json"]) == 0
    causes = json.loads(capsys.readouterr().out)["root_causes"]
    assert [(c["kind"], c["rank"]) for c in causes] == [("compute", 1)]
