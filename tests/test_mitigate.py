"""The closed loop (megatronapp/mitigate): re-planning without a node keeps the
global batch; a simulated job stops on a verdict, restarts from its checkpoint
without the slow node, and accounts for the goodput; a withdrawn verdict
leaves the job running."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, strategies as st

from megatronapp.mitigate.loop import LoopRun, Spans, close_loop
from megatronapp.mitigate.plan import global_batch, replan, shrunk_parallel, work_ratio
from megatronapp.program.ranks import static_compute_ops
from megatronapp.scan.ingest.work import ModelledWork, modelled_work
from megatronapp.scenario.config import Parallel, ScenarioError, load_scenario, parse_scenario
from megatronapp.trace.columns import RankEventsView, TableSource, concat_same, source_of
from megatronapp.trace.events import RunResult
from megatronapp.trace.metrics import iteration_spans
from sim import simulate

from .support import ROOT, run_cli

THROTTLE = ROOT / "scenarios/throttle.yaml"
# 16 GPUs on 2 nodes: node 0 holds pipeline stage 0 of all four replicas
SHAPE = ["parallel.dp=4", "parallel.pp=2", "model.layers=8"]
ONSET = "faults=[{kind: throttle, rank: 5, factor: 1.5, start_s: 0.4}]"


@given(tp=st.sampled_from([1, 2, 4]), pp=st.integers(1, 4), dp=st.integers(2, 16),
       microbatches=st.integers(1, 12), per_node=st.sampled_from([1, 2, 4, 8]),
       mbs=st.integers(1, 4))
def test_a_shrunk_plan_keeps_the_global_batch_on_the_gpus_left(
        tp: int, pp: int, dp: int, microbatches: int, per_node: int, mbs: int) -> None:
    p = Parallel(tp=tp, pp=pp, dp=dp, microbatches=microbatches)
    left = p.world_size - per_node
    shrunk = shrunk_parallel(p, left)
    if shrunk is None:
        assert left < tp * pp
        return
    assert global_batch(shrunk, mbs) == global_batch(p, mbs)
    assert shrunk.world_size <= left and (shrunk.tp, shrunk.pp) == (tp, pp) and shrunk.dp <= dp


@given(dp=st.sampled_from([2, 4, 8]), microbatches=st.integers(1, 8), rank=st.integers(0, 31),
       spares=st.integers(0, 1))
def test_replanning_a_scenario_without_a_node_keeps_its_global_batch(
        dp: int, microbatches: int, rank: int, spares: int) -> None:
    s = parse_scenario({"parallel": {"tp": 2, "pp": 2, "dp": dp, "microbatches": microbatches},
                        "cluster": {"gpus_per_node": 4},
                        "mitigation": {"action": "exclude", "spares": spares},
                        "faults": [{"kind": "throttle", "rank": rank % (4 * dp), "factor": 2}]})
    plan = replan(s, rank % s.world_size, elapsed_s=1.0)
    after = plan.scenario
    assert global_batch(after.parallel, 1) == global_batch(s.parallel, 1)
    assert plan.spare == bool(spares)
    if spares:
        assert after.parallel == s.parallel and after.mitigation.spares == 0  # type: ignore[union-attr]
    else:
        assert after.world_size <= s.world_size - 4 and after.parallel.dp < dp
    assert after.faults == ()  # the throttled GPU left with its node (every rank is on one)
    assert plan.node == rank % s.world_size // 4


def test_a_verdict_stops_the_job_which_restarts_from_its_checkpoint_without_the_node() -> None:
    s = load_scenario(THROTTLE, ["iterations=20", *SHAPE, ONSET,
                                 "mitigation={action: exclude, restart_s: 0.5, checkpoint_every: 5}"])
    loop = close_loop(s, simulate(s), simulate, lambda _: None)
    first, second = loop.segments
    verdict = first.stopped_by
    assert verdict is not None and (verdict.kind, verdict.rank) == ("compute", 5)
    stop = first.first_iteration + first.iterations - 1
    assert stop == verdict.iteration + 1  # the next iteration boundary
    assert second.first_iteration == (stop + 1) // 5 * 5  # the last checkpoint
    assert second.first_iteration + second.iterations == s.iterations
    assert (second.scenario.parallel.dp, second.scenario.parallel.microbatches) == (2, 16)
    assert second.scenario.faults == ()
    assert loop.seconds == pytest.approx(first.seconds + 0.5 + second.seconds)
    report = loop.to_json()
    assert report["tokens_per_s"] == pytest.approx(loop.tokens / loop.seconds)
    assert report["false_alarm_s"] == 0


@pytest.mark.parametrize("factor, spares, acts", [(1.5, 0, False), (4, 0, True), (1.5, 1, True)])
def test_only_if_faster_acts_when_the_replanned_job_beats_staying(
        factor: float, spares: int, acts: bool) -> None:
    """dp 4 -> 2 doubles pp 2's microbatches (8 + 1 -> 16 + 1 with the bubble):
    worth it against a 4x stage, not a 1.5x one; a spare costs no throughput."""
    onset = f"faults=[{{kind: throttle, rank: 5, factor: {factor}, start_s: 0.4}}]"
    policy = f"mitigation={{action: exclude, restart_s: 0.5, only_if_faster: true, spares: {spares}}}"
    s = load_scenario(THROTTLE, ["iterations=20", *SHAPE, onset, policy])
    loop = close_loop(s, simulate(s), simulate, lambda _: None)
    assert (len(loop.segments) > 1) == acts
    named = [d for d in loop.detections if d.event == "named" and d.rank == 5]
    assert named  # named either way: the policy decides what is acted on


def test_the_plan_ratio_counts_the_pipeline_bubble() -> None:
    before = Parallel(tp=1, pp=4, dp=4, microbatches=8)
    assert work_ratio(before, before) == 1
    assert work_ratio(before, before.model_copy(update={"dp": 2, "microbatches": 16})) == \
        pytest.approx((16 + 3) / (8 + 3))
    no_pipeline = Parallel(tp=1, pp=1, dp=4, microbatches=2)
    assert work_ratio(no_pipeline, no_pipeline.model_copy(update={"microbatches": 4})) == 2


def test_a_verdict_on_a_healthy_rank_is_a_false_alarm_whose_cost_is_counted() -> None:
    s = load_scenario(THROTTLE, ["iterations=12", *SHAPE, ONSET,
                                 "mitigation={action: exclude, restart_s: 0.5, spares: 1}"])
    healthy = s.model_copy(update={"faults": ()})  # the truth says nothing is wrong
    loop = close_loop(healthy.model_copy(update={"mitigation": s.mitigation}), simulate(s),
                      simulate, lambda _: None)
    assert len(loop.segments) == 2 and loop.false_alarm_s >= 0.5


def test_a_withdrawn_false_alarm_leaves_the_job_running(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = run_cli("run", str(THROTTLE), "--set", "iterations=12", "--set",
                   "faults=[{kind: throttle, rank: 5, factor: 1.5, end_s: 0.35}]", "--set",
                   "mitigation={action: exclude, hold_iterations: 6}", "--out", str(out))
    assert done.returncode == 0, done.stderr
    events = [json.loads(line)["event"] for line in (out / "detections.jsonl").read_text().splitlines()]
    assert events == ["named", "withdrawn"]
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["iteration_times_s"]) == 12
    assert summary["mitigation"]["restarts"] == 0 and not (out / "segment1").exists()


def test_the_run_directory_holds_each_segment_and_the_restart(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = run_cli("run", str(THROTTLE), "--set", "iterations=12", *[a for kv in SHAPE for a in
                   ("--set", kv)], "--set", ONSET, "--set", "mitigation={action: exclude}",
                   "--out", str(out))
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    restart = summary["mitigation"]["segments"][1]
    stopped = len(summary["iteration_times_s"])
    assert restart["first_iteration"] == stopped < 12
    again = json.loads((out / "segment1" / "summary.json").read_text())
    assert len(again["iteration_times_s"]) == 12 - stopped and again["world_size"] == 8
    files = json.loads((out / "manifest.json").read_text())["files"]
    assert "segment1/trace.parquet" in files
    assert f"restarted from iteration {stopped}" in done.stdout


def test_a_mitigation_beside_an_fbd_section_is_refused() -> None:
    with pytest.raises(ScenarioError, match="mitigation"):
        load_scenario(ROOT / "scenarios/fbd_hetero.yaml", ["mitigation={action: exclude}"])


@pytest.mark.parametrize("max_rows", [1000, 7777])
def test_spans_gathered_batch_by_batch_are_the_whole_tables(max_rows: int) -> None:
    source = source_of(simulate(load_scenario(THROTTLE, ["iterations=5"])))
    spans = Spans()
    for batch in reversed(list(source.batches(max_rows))):  # any order, any cut
        spans.add(batch)
    assert spans.of == iteration_spans(source.compact()[0])


def expanded(result: RunResult) -> RunResult:
    """A reduced run with every rank's rows held as a table (as read whole)."""
    source = TableSource(concat_same(list(source_of(result).batches())).sorted_by_rank_and_start())
    return replace(result, events=RankEventsView(source), source=source)


def outcome(loop: LoopRun) -> tuple[dict[str, Any], list[tuple[Any, ...]]]:
    """The loop's account and its verdicts' iterations (not their evidence,
    which counts the rows fed)."""
    report = loop.to_json()
    for segment in report["segments"]:
        segment.pop("stopped_by", None)
    return report, [(d.event, d.key, d.first_seen, d.iteration) for d in loop.detections]


def test_a_reduced_run_is_looped_on_its_stored_rows_with_the_answer_of_every_rank() -> None:
    """A 128-GPU cut of the 12,288-GPU job (no jitter: one pipeline per class
    stored): the loop reads only the stored rows, keeps a stopped segment
    reduced, and decides and times what it decides and times on every rank's."""
    s = load_scenario(ROOT / "scenarios/megascale_12288.yaml", [
        "parallel.dp=2", "parallel.microbatches=8", "model.layers=48", "iterations=6",
        "faults=[{kind: throttle, rank: 90, factor: 1.5, start_s: 1}]",
        "mitigation={action: exclude, spares: 1, checkpoint_every: 2, restart_s: 5}"])
    reduced = close_loop(s, simulate(s), simulate, lambda _: None)
    whole = close_loop(s, expanded(simulate(s)), lambda x: expanded(simulate(x)), lambda _: None)
    assert [(d.event, d.key) for d in reduced.detections] == [("named", ("compute", 90, None))]
    assert len(reduced.segments) == 2 and outcome(reduced) == outcome(whole)
    stopped = source_of(reduced.segments[0].result)
    assert len(stopped.compact()[0]) < stopped.events  # stored rows only, every rank's counted
    assert stopped.events == source_of(whole.segments[0].result).events


CUT_128 = ["parallel.dp=2", "parallel.microbatches=8", "model.layers=48", "iterations=6",
           "faults=[{kind: throttle, rank: 90, factor: 1.5, start_s: 1}]",
           "mitigation={action: exclude, spares: 1, checkpoint_every: 2, restart_s: 5}"]


def test_the_loop_decides_the_same_when_each_window_works_out_the_modelled_work_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The modelled work is worked out once per segment; working it out again
    for every window (as before) gives the same segments, times, goodput and
    verdicts."""
    s = load_scenario(ROOT / "scenarios/megascale_12288.yaml", CUT_128)
    reused = close_loop(s, simulate(s), simulate, lambda _: None)
    monkeypatch.setattr(ModelledWork, "__call__",
                        lambda self, ranks: modelled_work(self.scenario, ranks))
    again = close_loop(s, simulate(s), simulate, lambda _: None)
    assert len(reused.segments) == 2 and outcome(reused) == outcome(again)


def test_a_segment_works_out_each_ranks_modelled_work_once(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """Rebuilding the ranks' programs for every window made the loop's cost
    per window grow with the job: a segment builds each rank's once (here the
    segment after the restart, whose 6 windows each compare lonely ranks)."""
    asked: list[int] = []

    def counted(scenario: Any, ranks: Any) -> Any:
        asked.extend(ranks)
        return static_compute_ops(scenario, ranks)
    monkeypatch.setattr("megatronapp.scan.ingest.work.static_compute_ops", counted)
    s = load_scenario(ROOT / "scenarios/megascale_12288.yaml",
                      [*CUT_128[:3], "iterations=10", *CUT_128[4:]])
    loop = close_loop(s, simulate(s), simulate, lambda _: None)
    assert [segment.iterations for segment in loop.segments] == [4, 6]
    assert asked and max(Counter(asked).values()) <= len(loop.segments)
