"""Ranges of one name are compared across ranks only when they hold the same
work: a pipeline's last stage annotates its output layer and loss inside
``forward`` as its peers annotate their layers, and is no straggler for it
(``scan/range_work.py``; the Kineto reader names such ranges apart), and
without a model of each stage's work the end stages are not judged on their
compute (``detect.end_stages``)."""
from __future__ import annotations

from hypothesis import given, strategies as st

from megatronapp.scan.evidence.detect import megascan
from megatronapp.scan.align.inputs import load_scan_input
from megatronapp.scan.ingest.kineto import kineto_files, load_kineto
from megatronapp.scan.ingest.range_work import OpMix, op_mixes, same_work, work_names

from .support import GLOO, MAIN, gloo_file, kineto_event, write_kineto

STAGES, MICROBATCHES, STEPS = 4, 6, 3
LOSS = "_VocabParallelCrossEntropy"


def mix(**ops: tuple[int, float]) -> OpMix:
    return OpMix({op: n for op, (n, _) in ops.items()}, {op: us for op, (_, us) in ops.items()})


def test_a_range_holding_a_big_op_its_peers_lack_is_other_work():
    layer = mix(mm=(4, 100.0), add=(2, 10.0))
    assert same_work(layer, layer)
    assert not same_work(layer, mix(mm=(4, 100.0), add=(2, 10.0), **{LOSS: (1, 300.0)}))
    assert not same_work(mix(mm=(4, 100.0)), mix(mm=(4, 100.0), embedding=(1, 50.0)))


def test_a_slowed_ranks_bigger_or_repeated_ops_and_few_small_extras_are_the_same_work():
    layer = mix(mm=(4, 100.0), add=(2, 10.0))
    # the rows a slowed rank concatenates to grow its matmuls
    assert same_work(layer, mix(mm=(4, 200.0), add=(2, 10.0), cat=(1, 15.0), randn=(1, 20.0)))
    assert same_work(layer, mix(mm=(12, 100.0), add=(6, 10.0)))  # its matmuls three times over


@given(st.lists(st.integers(1, 5), min_size=3, max_size=8), st.integers(0, 7))
def test_only_the_rank_holding_other_work_than_most_is_renamed(counts, odd):
    odd %= len(counts)
    mixes = {r: {"forward": mix(mm=(4, 100.0))} for r in range(len(counts))}
    mixes[odd] = {"forward": mix(mm=(4, 100.0), **{LOSS: (counts[odd], 500.0)})}
    renamed = work_names(mixes)
    assert set(renamed) == {odd}
    assert renamed[odd]["forward"] == f"forward (+{LOSS})"


def test_a_ranks_mix_is_its_commonest_occurrence_of_the_range():
    ops = {MAIN: [(0.0, 100.0, "mm"), (100.0, 150.0, "add"),
                  (1000.0, 1100.0, "mm"), (1100.0, 1150.0, "add"),
                  (2000.0, 2100.0, "mm"), (2100.0, 2150.0, "add"), (2150.0, 2900.0, "zeros")]}
    ranges = [("forward", MAIN, 0.0, 200.0), ("forward", MAIN, 1000.0, 1200.0),
              ("forward", MAIN, 2000.0, 3000.0)]  # the first step's one-off allocation
    assert op_mixes(ranges, ops)["forward"].counts == {"mm": 1, "add": 1}


def annotated_pipeline(slow_rank: int | None = None) -> dict[int, dict]:
    """A 4-stage pipeline annotated as Megatron-core is: each stage's
    ``forward`` and ``backward`` ranges hold its layer's matmuls; the last
    stage's ``forward`` also holds the loss (twice a layer's time) and its
    ``backward`` the loss's backward. ``slow_rank`` sleeps inside its ranges
    as long again as its work."""
    events: dict[int, list[dict]] = {r: [] for r in range(STAGES)}
    free = {r: 0.0 for r in range(STAGES)}
    for step in range(STEPS):
        for r in range(STAGES):
            events[r].append(kineto_event(f"ProfilerStep#{step}", "user_annotation", r, MAIN,
                                          free[r], 1.0))
        ready: dict[tuple[int, int], float] = {}
        for direction, name in ((1, "forward"), (-1, "backward")):
            order = range(STAGES) if direction == 1 else range(STAGES - 1, -1, -1)
            for m in range(MICROBATCHES):
                for r in order:
                    source, start = r - direction, free[r]
                    if 0 <= source < STAGES:
                        arrive = max(start, ready[(source, m)]) + 50.0
                        events[r] += [kineto_event("c10d::recv_", "cpu_op", r, MAIN, start, 20.0),
                                      kineto_event("gloo:recv", "user_annotation", r, GLOO,
                                                   start + 10, arrive - start - 10)]
                        start = arrive
                    ops = [("aten::mm", 200.0 * (1 if direction == 1 else 2))] * 2
                    if r == STAGES - 1:
                        ops.append((LOSS if direction == 1 else "LossBackward", 800.0))
                    work = sum(us for _, us in ops) + 10.0 * len(ops)
                    span = work * (2.0 if r == slow_rank else 1.0)
                    events[r].append(kineto_event(name, "user_annotation", r, MAIN, start, span))
                    at = start + 5.0
                    for op, us in ops:
                        events[r].append(kineto_event(op, "cpu_op", r, MAIN, at, us))
                        at += us + 10.0
                    done = start + span
                    if 0 <= r + direction < STAGES:
                        events[r] += [kineto_event("c10d::send", "cpu_op", r, MAIN, done, 20.0),
                                      kineto_event("gloo:send", "user_annotation", r, GLOO + 1,
                                                   done + 10, 30.0)]
                        done += 20.0
                    ready[(r, m)] = done
                    free[r] = done
        end = max(free.values()) + 100.0
        for r in range(STAGES):  # the step: zeroing more gradients on the last stage
            zeroing = 60.0 * (1.6 if r == STAGES - 1 else 1.0)
            events[r] += [kineto_event("Optimizer.zero_grad#Adam.zero_grad", "user_annotation",
                                       r, MAIN, end, zeroing + 10.0),
                          kineto_event("aten::zero_", "cpu_op", r, MAIN, end + 5.0, zeroing)]
            free[r] = end + 200.0
    for r, evs in events.items():  # each step's range spans the step
        steps = [e for e in evs if e["name"].startswith("ProfilerStep")]
        for e, nxt in zip(steps, steps[1:] + [None]):
            e["dur"] = (nxt["ts"] if nxt else free[r]) - e["ts"] - 1.0
    return {r: gloo_file(r, STAGES, evs) for r, evs in events.items()}


def test_the_last_stages_forward_holding_the_loss_is_named_apart(tmp_path):
    target = write_kineto(tmp_path, annotated_pipeline())
    names = {r: {e.name for e in evs if e.args.get("kind") == "compute"}
             for r, evs in load_kineto(kineto_files(target)).events.items()}
    assert f"forward (+{LOSS})" in names[STAGES - 1] and "forward" not in names[STAGES - 1]
    assert all("forward" in names[r] for r in range(STAGES - 1))


def test_the_last_stages_loss_and_bigger_step_do_not_make_it_a_straggler(tmp_path):
    target = write_kineto(tmp_path, annotated_pipeline())
    assert not [c for c in megascan(load_scan_input(target)).root_causes if c.kind == "compute"]


def test_a_middle_stage_slow_inside_its_ranges_is_still_named(tmp_path):
    target = write_kineto(tmp_path, annotated_pipeline(slow_rank=1))
    causes = megascan(load_scan_input(target)).root_causes
    assert causes and (causes[0].kind, causes[0].rank) == ("compute", 1)
