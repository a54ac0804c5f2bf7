"""Who waits for whom (``megatronapp.scan.evidence.waits``) as MegaScan's evidence:
on traces where a slowed rank's extra work hides among many equal ops, the
others' waits at the collectives name it; the accumulator gives the same
answer however its input is cut; annotations holding communication count
without the wait. Traces are built to the schema gloo jobs write."""
from __future__ import annotations

import numpy as np
import pytest

from megatronapp.cli import main
from megatronapp.scan.evidence.detect import megascan, stage_peers, wait_members
from megatronapp.scan.align.inputs import load_scan_input
from megatronapp.scan.ingest.kineto import kineto_files, load_kineto
from megatronapp.scan.evidence.waits import WaitAccumulator

from .support import GLOO, MAIN, collective, gloo_file, kineto_event, write_kineto

WORLD, STEPS, SMALL_OPS, STEP_US = 4, 6, 30, 4000.0


Steps = dict[tuple[int, int], float]  # (rank, step) -> µs


def ddp_like_rank(rank: int, matmul_us: Steps, small_us: float = 20.0,
                  idle_us: Steps | None = None) -> list[dict]:
    """Each step: many small ops alike on every rank, one matmul (its length
    per (rank, step): ``matmul_us``, or 500 µs), an idle gap (``idle_us``,
    none by default), then a gradient all-reduce that ends when the last
    rank has arrived."""
    idle = idle_us or {}
    events = []
    for n in range(STEPS):
        t = 1000.0 + n * STEP_US
        events.append(kineto_event(f"ProfilerStep#{n}", "user_annotation", rank, MAIN, t,
                                   STEP_US - 10))
        at = t + 5
        for _ in range(SMALL_OPS):
            events.append(kineto_event("aten::add", "cpu_op", rank, MAIN, at, small_us))
            at += small_us + 1
        last = t + 5 + SMALL_OPS * (small_us + 1) + max(
            matmul_us.get((r, n), 500.0) + idle.get((r, n), 0.0) for r in range(WORLD))
        mine = matmul_us.get((rank, n), 500.0)
        events.append(kineto_event("aten::mm", "cpu_op", rank, MAIN, at, mine))
        arrive = at + mine + idle.get((rank, n), 0.0)
        events += collective(rank, "allreduce_", "all_reduce", arrive, last + 100.0)
    return events


def job(tmp_path, matmul_us, small_us=None, idle_us=None, extra=None) -> object:
    """``extra``: rank -> events it runs besides the others' (none by default)."""
    small, more = small_us or {}, extra or {}
    files = {r: gloo_file(r, WORLD, ddp_like_rank(r, matmul_us, small.get(r, 20.0), idle_us)
                          + more.get(r, []))
             for r in range(WORLD)}
    return load_scan_input(write_kineto(tmp_path, files))


def causes(scan) -> list[tuple[str, int, tuple[str, ...]]]:
    return [(c.kind, c.rank, tuple(c.evidence.get("rests_on", ())))
            for c in megascan(scan).root_causes]


def test_the_rank_everyone_waits_for_is_named_though_most_of_its_ops_match(tmp_path):
    # rank 1's matmul is 3x: one op of 31 per step, so its median op is its peers'
    scan = job(tmp_path, {(1, n): 1500.0 for n in range(STEPS)})
    assert causes(scan) == [("compute", 1, ("waits",))]


def test_when_the_last_to_arrive_changes_from_step_to_step_nobody_is_named(tmp_path):
    scan = job(tmp_path, {(n % WORLD, n): 1500.0 for n in range(STEPS)})
    assert causes(scan) == []


def test_a_rank_slow_at_small_ops_that_nobody_waits_for_is_not_named_first(tmp_path):
    # rank 0 is 1.5x slower at every op, at its best too, but still arrives
    # before rank 1's long matmul: the others wait for rank 1 alone
    slow = {**{(0, n): 750.0 for n in range(STEPS)}, **{(1, n): 2500.0 for n in range(STEPS)}}
    scan = job(tmp_path, slow, small_us={0: 30.0})
    assert causes(scan) == [("compute", 1, ("waits",))]


# rank 1 is the last, by 1000 µs, in steps 0-3; ranks 0 and 2 in steps 4 and 5
LATE_IN_FOUR = {**{(1, n): 1000.0 for n in range(4)}, (0, 4): 1000.0, (2, 5): 1000.0}


def test_a_rank_waited_for_in_four_of_six_steps_is_named_when_it_computed_longer(tmp_path):
    slower = {key: 500.0 + late for key, late in LATE_IN_FOUR.items()}
    slower.update({(1, 4): 800.0, (1, 5): 800.0})  # slower at its best too
    assert causes(job(tmp_path, slower)) == [("compute", 1, ("waits",))]


def test_a_late_rank_whose_main_op_is_as_fast_as_its_peers_at_its_best_is_not_named(tmp_path):
    # rank 3's matmul is 5x in four steps, its peers' length in two: a
    # process the machine deschedules, not a slower device or bigger work
    descheduled = {(3, n): 2500.0 for n in range(4)}
    assert causes(job(tmp_path, descheduled)) == []


def test_a_rank_waited_for_in_four_of_six_steps_is_not_named_when_it_idled(tmp_path):
    # the same arrivals, made of idle time: no compute says it was slow
    assert causes(job(tmp_path, {}, idle_us=LATE_IN_FOUR)) == []


def test_detect_says_who_waited_for_the_rank_and_which_evidence_it_rests_on(tmp_path, capsys):
    job(tmp_path, {(1, n): 1500.0 for n in range(STEPS)})
    assert main(["detect", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("root cause: rank 1 (compute")
    assert "the others in group [0, 1, 2, 3] waited for it: 100% of their wait" in lines[1]
    assert "most in 6 of 6 iterations; last to arrive at 6 of 6" in lines[1]
    assert lines[1].endswith("; at its fastest its aten::mm takes 3.00x theirs")
    assert lines[2] == "  evidence: waits"


def test_detect_leaves_out_the_iterations_a_trace_without_profiler_steps_lacks(
        tmp_path, capsys):
    slow = {(1, n): 1500.0 for n in range(STEPS)}
    files = {r: gloo_file(r, WORLD, [e for e in ddp_like_rank(r, slow)
                                     if not e["name"].startswith("ProfilerStep")])
             for r in range(WORLD)}
    write_kineto(tmp_path, files)
    assert main(["detect", str(tmp_path)]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert "last to arrive at 6 of 6" in line
    assert "iterations" not in line


# rank 1's matmul is 2x in every step: the last by 500 µs in steps 0-3; in
# steps 4 and 5 the machine holds rank 0, then rank 2, back by 1000 µs, so
# rank 1 imposes 55% of all the waiting: more than any other member
DESCHEDULED_TWICE = {(0, 4): 1000.0, (2, 5): 1000.0}


def test_a_busier_rank_waited_for_more_than_any_other_is_named_though_others_added_waits(
        tmp_path):
    doubled = {(1, n): 1000.0 for n in range(STEPS)}
    assert causes(job(tmp_path, doubled, idle_us=DESCHEDULED_TWICE)) == [
        ("compute", 1, ("waits",))]


def test_the_same_arrivals_made_of_idle_time_name_nobody(tmp_path):
    idle = {**{(1, n): 500.0 for n in range(4)}, **DESCHEDULED_TWICE}
    assert causes(job(tmp_path, {}, idle_us=idle)) == []


def test_a_rank_slowed_in_one_step_only_is_not_named(tmp_path):
    once = {(1, 0): 3000.0}
    assert causes(job(tmp_path, once, idle_us=DESCHEDULED_TWICE)) == []


# rank 0 stalls 2000 µs after its work in steps 0-3 (FSDP2's rank 0 does,
# after each step's last reduce-scatter): last there, and most of the waiting
STALLS_IN_FOUR = {(0, n): 2000.0 for n in range(4)}


def test_a_rank_three_times_slower_at_its_best_is_named_though_another_stalls_more(tmp_path):
    # rank 1's matmul is 3.5x in every step: last only in steps 4 and 5
    slow = {(1, n): 1750.0 for n in range(STEPS)}
    assert causes(job(tmp_path, slow, idle_us=STALLS_IN_FOUR)) == [("compute", 1, ("waits",))]


def test_a_rank_slow_in_two_steps_while_another_stalls_is_not_named(tmp_path):
    # the same arrivals, but rank 1 runs its peers' matmul in four steps:
    # at its best it is as fast as they are
    twice = {(1, n): 1750.0 for n in (4, 5)}
    assert causes(job(tmp_path, twice, idle_us=STALLS_IN_FOUR)) == []


def test_a_healthy_job_with_two_descheduled_steps_names_nobody(tmp_path):
    assert causes(job(tmp_path, {}, idle_us=DESCHEDULED_TWICE)) == []


# rank 1's small ops are its peers' (40 µs, 30 a step: its main op), its
# matmul 1.8x in every step: 43% of its compute, slow there at its best
SLOW_IN_ITS_SECOND_OP = {(1, n): 900.0 for n in range(STEPS)}


def test_a_rank_last_everywhere_and_slow_at_its_best_in_a_second_op_is_named(tmp_path):
    # the waits are unanimous (last at 6 of 6, all the waiting): the
    # matmul, not only the main op, may show it slow at its best
    scan = job(tmp_path, SLOW_IN_ITS_SECOND_OP, small_us={r: 40.0 for r in range(WORLD)})
    assert causes(scan) == [("compute", 1, ("waits",))]


def test_the_same_rank_is_not_named_when_another_came_last_in_one_step(tmp_path):
    # rank 0 held back 1000 µs in step 5: rank 1 still leads 5 of 6 steps and
    # 70% of the waiting, but is no longer last everywhere, and as fast as
    # its peers at its best in its main op
    scan = job(tmp_path, SLOW_IN_ITS_SECOND_OP, small_us={r: 40.0 for r in range(WORLD)},
               idle_us={(0, STEPS - 1): 1000.0})
    assert causes(scan) == []


def extra_ops(rank: int, name: str, us: float) -> list[dict]:
    """One more op of ``us`` µs in each step, once its all-reduce is done."""
    return [kineto_event(name, "cpu_op", rank, MAIN, 1000.0 + n * STEP_US + 2000.0, us)
            for n in range(STEPS)]


def test_ranks_are_peers_though_one_runs_a_few_small_ops_more(tmp_path):
    # rank 1 concatenates its batch each step (a bigger batch, or rank 0's
    # logging): 10 µs of its ~1100 µs of compute a step
    scan = job(tmp_path, {}, extra={1: extra_ops(1, "aten::cat", 10.0)})
    assert set(stage_peers(scan).values()) == {(0, 1, 2, 3)}


def test_ranks_are_not_peers_when_one_runs_much_work_the_others_do_not(tmp_path):
    # rank 1's extra op is 600 µs a step: a third of its compute, not alike
    scan = job(tmp_path, {}, extra={1: extra_ops(1, "aten::cat", 600.0)})
    assert stage_peers(scan)[1] == (1,)


@pytest.mark.parametrize("cuts", [1, 2, 7, 40])
def test_the_waits_are_the_same_however_the_members_are_batched(tmp_path, cuts):
    scan = job(tmp_path, {(1, n): 1500.0 + 100 * n for n in range(STEPS)})
    cols, op = wait_members(scan)
    whole_feed = WaitAccumulator()
    whole_feed.feed(cols, op)
    waits = WaitAccumulator()
    for part in np.array_split(np.random.default_rng(cuts).permutation(len(op)), cuts):
        waits.feed(cols.take(part), op[part])
    assert waits.pending is None
    got, whole = waits.scores(), whole_feed.scores()
    assert [counts(w) for w in got.ranks] == [counts(w) for w in whole.ranks]
    assert [w.imposed_s for w in got.ranks] == pytest.approx([w.imposed_s for w in whole.ranks])


def counts(w) -> tuple:
    return (w.rank, w.group, w.joined, w.last, w.iterations, w.topped)


def annotated_rank(rank: int, sleep_us: float, wait_us: float) -> list[dict]:
    """A ``backward`` annotation: an op, a sleep with no communication, an
    op launching the all-reduce, then idle until the all-reduce (run on
    gloo's thread) is done."""
    return [kineto_event("ProfilerStep#0", "user_annotation", rank, MAIN, 0.0, 9000.0),
            kineto_event("backward", "user_annotation", rank, MAIN, 100.0,
                         1400.0 + sleep_us + wait_us),
            kineto_event("aten::mm", "cpu_op", rank, MAIN, 100.0, 800.0),
            kineto_event("aten::add_", "cpu_op", rank, MAIN, 900.0 + sleep_us, 500.0),
            *collective(rank, "allreduce_", "all_reduce", 1000.0 + sleep_us,
                        1500.0 + sleep_us + wait_us)]


def test_an_annotation_holding_a_collective_counts_without_the_wait_but_with_the_sleep(tmp_path):
    files = {r: gloo_file(r, 2, annotated_rank(r, sleep_us=300.0 * r, wait_us=2000.0 * (1 - r)))
             for r in (0, 1)}
    events = load_kineto(kineto_files(write_kineto(tmp_path, files))).events
    for rank, sleep in ((0, 0.0), (1, 300.0)):
        backward = [e for e in events[rank] if e.name == "backward"]
        assert len(backward) == 1  # the range stays, under its name
        assert backward[0].dur_s == pytest.approx((800.0 + sleep + 500.0) * 1e-6)


LAYERS = 4  # collectives per step in the layer-by-layer job below


def long_step(rank: int, n: int) -> dict:
    """Profiler step ``n`` of a job whose steps take three times ``STEP_US``."""
    return kineto_event(f"ProfilerStep#{n}", "user_annotation", rank, MAIN,
                        1000.0 + n * 3 * STEP_US, 3 * STEP_US - 10)


def long_step_start(n: int) -> float:
    return 1000.0 + n * 3 * STEP_US + 5


def small_ops(rank: int, start: float) -> list[dict]:
    """``SMALL_OPS`` ops of 20 µs, alike on every rank, from ``start`` on."""
    return [kineto_event("aten::add", "cpu_op", rank, MAIN, start + 21 * k, 20.0)
            for k in range(SMALL_OPS)]


def layered_rank(rank: int, matmul_us: Steps, idle_us: Steps) -> list[dict]:
    """Each step: ``LAYERS`` rounds of many small ops alike on every rank,
    one matmul (per (rank, step): ``matmul_us``, or 500 µs), then a
    collective that ends when the last rank has arrived, as FSDP gathers and
    reduces layer by layer; ``idle_us`` holds a rank back before the step's
    first collective."""
    events = []
    for n in range(STEPS):
        events.append(long_step(rank, n))
        start = long_step_start(n)
        for layer in range(LAYERS):
            events += small_ops(rank, start)
            start += 21 * SMALL_OPS
            held = idle_us if layer == 0 else {}
            arrive = {r: start + matmul_us.get((r, n), 500.0) + held.get((r, n), 0.0)
                      for r in range(WORLD)}
            done = max(arrive.values()) + 100.0
            events.append(kineto_event("aten::mm", "cpu_op", rank, MAIN, start,
                                       matmul_us.get((rank, n), 500.0)))
            events += collective(rank, "allreduce_", "all_reduce", arrive[rank], done)
            start = done + 5
    return events


def layered_job(tmp_path, matmul_us: Steps, idle_us: Steps) -> object:
    files = {r: gloo_file(r, WORLD, layered_rank(r, matmul_us, idle_us)) for r in range(WORLD)}
    return load_scan_input(write_kineto(tmp_path, files))


# the machine holds ranks 0, 2 and 3 back by 2500 µs, each in one step: the
# most waiting of those steps, so rank 1 is waited for most in three of six
HELD_IN_THREE = {(0, 1): 2500.0, (2, 3): 2500.0, (3, 5): 2500.0}


def test_a_busier_rank_last_at_almost_every_collective_is_named_though_it_led_half_the_steps(
        tmp_path):
    # rank 1's matmul is 2x at every layer (1.4x its peers' compute): last
    # at 21 of 24 collectives, waited for over twice as long as for any
    # other rank, but the most in only three steps of six
    slower = {(1, n): 1000.0 for n in range(STEPS)}
    assert causes(layered_job(tmp_path, slower, HELD_IN_THREE)) == [("compute", 1, ("waits",))]


def test_a_rank_as_late_but_as_fast_at_its_best_is_not_named(tmp_path):
    # rank 1's matmul is 2x in four steps, its peers' length in two: the
    # machine held it back, it is not slower
    slower = {(1, n): 1000.0 for n in range(4)}
    assert causes(layered_job(tmp_path, slower, HELD_IN_THREE)) == []


def shaped_rank(rank: int, layer_us: dict[tuple[int, int], list[float]]) -> list[dict]:
    """Each step: many small ops alike on every rank, four matmuls of
    different shapes (per (rank, step): ``layer_us``), then a gradient
    all-reduce that ends when the last rank has arrived."""
    events = []
    for n in range(STEPS):
        events.append(long_step(rank, n))
        events += small_ops(rank, long_step_start(n))
        at = long_step_start(n) + 21 * SMALL_OPS
        arrive = {r: at + sum(layer_us[(r, n)]) + 4 for r in range(WORLD)}
        for us in layer_us[(rank, n)]:
            events.append(kineto_event("aten::mm", "cpu_op", rank, MAIN, at, us))
            at += us + 1
        events += collective(rank, "allreduce_", "all_reduce", arrive[rank],
                             max(arrive.values()) + 100.0)
    return events


# the model's first layer is the smallest (150 µs; 600 the others); the
# machine holds the peers back in that layer in four steps (700 µs), so
# their fastest calls are mostly of large layers, rank 1's of its small one
PEER_LAYERS = {(r, n): [150.0 if n < 2 else 700.0, 600.0, 600.0, 600.0]
               for r in range(WORLD) for n in range(STEPS)}


def shaped_job(tmp_path, slowed_steps: range | tuple[int, ...]) -> object:
    """Rank 1 runs every layer 2x in ``slowed_steps``."""
    layers = {**PEER_LAYERS, **{(1, n): [300.0, 1200.0, 1200.0, 1200.0] for n in slowed_steps}}
    files = {r: gloo_file(r, WORLD, shaped_rank(r, layers)) for r in range(WORLD)}
    return load_scan_input(write_kineto(tmp_path, files))


def test_a_rank_slow_at_every_layer_is_named_by_its_iterations_when_shapes_blur_its_calls(
        tmp_path, capsys):
    # its fastest calls (its small layer) are half its peers' fastest (their
    # large ones); its fastest iteration (3900 µs of matmul) is 1.56x their
    # typical one (2500: the small layer held back in most steps)
    assert causes(shaped_job(tmp_path, range(STEPS))) == [("compute", 1, ("waits",))]
    assert main(["detect", str(tmp_path)]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert line.endswith("; in its fastest iterations its aten::mm takes 1.56x theirs")


def test_a_rank_as_fast_as_its_peers_in_one_whole_iteration_is_not_named(tmp_path):
    # slowed in five steps of six, in step 1 (a whole one) it runs theirs:
    # the machine held it back, its device is not slower
    assert causes(shaped_job(tmp_path, (0, 2, 3, 4, 5))) == []


def test_a_rank_slower_than_the_others_fastest_iterations_but_not_their_typical_is_not_named(
        tmp_path):
    # rank 1's large layers are 850 µs (2700 a step): last at every all-reduce,
    # 1.38x the peers' fastest steps (1950) but 1.08x their typical one (2500)
    layers = {**PEER_LAYERS, **{(1, n): [150.0, 850.0, 850.0, 850.0] for n in range(STEPS)}}
    files = {r: gloo_file(r, WORLD, shaped_rank(r, layers)) for r in range(WORLD)}
    assert causes(load_scan_input(write_kineto(tmp_path, files))) == []
