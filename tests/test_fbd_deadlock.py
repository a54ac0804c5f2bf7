"""Deadlock freedom of the bit-vector coordinator (hypothesis, stateful) and
the paper's deadlock of a launch-on-first-request coordinator."""
from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, find, given, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from megatronapp.fbd.coordinator import GroupTable
from megatronapp.fbd.protocol import (CoordinatedSystem, ModelSystem, NaiveSystem, drive,
                                      project)
from megatronapp.parallel.topology import Topology

# The paper's example: rank 0 wants to talk to rank 2 (group 0), rank 2 wants
# rank 1 first (group 1); ranks 0 and 1 share control thread 0.
PAPER_TABLE = GroupTable(groups=((0, 2), (1, 2)), width=3)
PAPER_OWNER = {0: 0, 1: 0, 2: 1}
PAPER_PROGRAMS = {0: (0,), 1: (1,), 2: (1, 0)}


def naive_paper() -> NaiveSystem:
    return NaiveSystem(PAPER_TABLE, PAPER_OWNER, PAPER_PROGRAMS)


def coordinated_paper() -> CoordinatedSystem:
    return CoordinatedSystem(PAPER_TABLE, PAPER_OWNER, PAPER_PROGRAMS)


def replay(system, labels: list[str]) -> None:
    for label in labels:
        fire = dict(system.events())[label]
        fire()


def test_naive_coordinator_deadlock_is_found_by_hypothesis():
    def deadlocks(choices: list[int]) -> bool:
        system = naive_paper()
        drive(system, choices)
        return system.deadlocked()

    choices = find(st.lists(st.integers(0, 3), max_size=12), deadlocks,
                   settings=settings(max_examples=2000, database=None))
    system = naive_paper()
    fired = drive(system, choices)
    assert system.deadlocked()
    # Control thread 0 sits in rank 0's collective with rank 2 while rank 2
    # sits in its collective with rank 1, whose request thread 0 never serves.
    assert system.busy == {0: 0, 1: 1}
    assert "request 1" in fired and system.workers.waiting == {0, 1, 2}


def test_paper_deadlock_regression_naive_blocks_coordinator_does_not():
    # The interleaving hypothesis finds, kept as a fixed regression case.
    naive = naive_paper()
    replay(naive, ["request 0", "launch 0", "request 2", "launch 1", "request 1"])
    assert naive.deadlocked()
    coordinated = coordinated_paper()
    replay(coordinated, ["request 0", "request 2", "request 1"])
    drive(coordinated, [])
    assert coordinated.finished()
    assert [(e.group, e.members) for e in coordinated.workers.executed] == [(1, (1, 2)),
                                                                             (0, (0, 2))]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 7), max_size=40))
def test_coordinator_finishes_the_paper_example_under_any_interleaving(choices):
    system = coordinated_paper()
    drive(system, choices)
    assert system.finished()


# ------------------------------------------------------ random structures
def topology_groups(topo: Topology) -> tuple[tuple[int, ...], ...]:
    """TP and DP groups plus PP neighbour pairs (p2p) of a virtual topology."""
    groups = set(topo.tp_groups) | set(topo.dp_groups)
    for rank in range(topo.world_size):
        if topo.coord(rank).pp + 1 < topo.pp:
            groups.add(tuple(sorted((rank, topo.pp_neighbor(rank, 1)))))
    return tuple(sorted(g for g in groups if len(g) > 1))


SHAPES = [(t, p, d) for t in (1, 2, 4) for p in (1, 2, 4) for d in (1, 2, 4)
          if 2 <= t * p * d <= 16]


@st.composite
def structures(draw):
    tp, pp, dp = draw(st.sampled_from(SHAPES))
    topo = Topology(tp=tp, pp=pp, dp=dp)
    table = GroupTable(topology_groups(topo), width=topo.world_size)
    threads = draw(st.integers(1, topo.world_size))
    owner = {w: draw(st.integers(0, threads - 1)) for w in range(topo.world_size)}
    sequence = draw(st.lists(st.integers(0, len(table) - 1), min_size=1, max_size=24))
    return table, owner, sequence


class CoordinatorMachine(RuleBasedStateMachine):
    """Random requests, early/late alignment contributions and rounds, applied
    alike to the production round loop (``CoordinatedSystem``) and to the
    model (``ModelSystem``); they must run the same collectives each round."""

    @initialize(structure=structures())
    def build(self, structure):
        self.table, self.owner, self.sequence = structure
        programs = project(self.table, self.sequence)
        self.system = CoordinatedSystem(self.table, self.owner, programs)
        self.model = ModelSystem(self.table, self.owner, programs)

    @precondition(lambda self: self.system.workers.idle())
    @rule(data=st.data())
    def request(self, data):
        worker = data.draw(st.sampled_from(self.system.workers.idle()))
        self.system.request(worker)
        self.model.request(worker)

    @rule(data=st.data())
    def contribute_early(self, data):
        free = self.system.not_contributed()
        if free:
            thread = data.draw(st.sampled_from(free))
            self.system.contribute(thread)
            self.model.contribute(thread)

    @precondition(lambda self: not self.system.stopped and not self.system.finished())
    @rule()
    def align(self):
        self.system.complete_round()
        assert self.system.round_log[-1] == self.model.complete_round()

    @invariant()
    def production_and_model_agree(self):
        if not hasattr(self, "system"):
            return
        assert self.system.workers.executed == self.model.workers.executed
        assert self.system.not_contributed() == self.model.not_contributed()

    @invariant()
    def every_collective_runs_once_with_all_members(self):
        if not hasattr(self, "system"):
            return
        instances = [(e.group, e.seq) for e in self.system.workers.executed]
        assert len(instances) == len(set(instances))
        for e in self.system.workers.executed:
            assert e.members == self.table.groups[e.group]

    @invariant()
    def coordinators_launch_in_the_same_order(self):
        if not hasattr(self, "system"):
            return
        executed = [(e.group, e.seq) for e in self.system.workers.executed]
        for thread, coord in self.system.coordinators.items():
            mine = [(l.group, l.seq) for l in coord.launched]
            assert mine == [i for i in executed if any(
                self.owner[w] == thread for w in self.table.groups[i[0]])]

    def teardown(self):
        if not hasattr(self, "system"):
            return
        drive(self.system, [])
        assert self.system.finished(), "coordinated system deadlocked"
        ran = Counter(e.group for e in self.system.workers.executed)
        assert ran == Counter(self.sequence)
        self.system.complete_round()  # every control thread sees "nobody active" and stops
        assert len(self.system.stopped) == len(self.system.coordinators)


CoordinatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example])
TestCoordinatorNeverDeadlocks = CoordinatorMachine.TestCase
