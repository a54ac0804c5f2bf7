"""The closed loop on a simulated job: on-line MegaScan watches each segment's
iterations; a verdict that reaches the confidence threshold and still stands
``hold_iterations`` later stops the job at that iteration boundary; the node
of the named rank is dropped (or a spare swapped in), the job re-planned,
restarted from its last checkpoint after the restart cost, and watched again.
A verdict withdrawn before the boundary leaves the job running; with
``only_if_faster`` a verdict whose re-planned job is predicted slower than
staying (the iteration less the cause's cost, on the smaller layout) is not
acted on.

Iterations are numbered over the whole job: a segment restarted from the
checkpoint at iteration C numbers its own iteration 0 as C.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

import numpy as np

from megatronapp.errors import UserError
from megatronapp.scan.online.live import on_device
from megatronapp.scan.online.online import (SIMULATED, Detection, OnlineConfig, OnlineScan,
                                     iterations_of)
from megatronapp.faults import ground_truth
from megatronapp.scenario.config import Mitigation, Scenario, fault_job
from megatronapp.trace.classes import StandIns, kept_rows
from megatronapp.trace.columns import EventColumns, EventSource, source_of
from megatronapp.trace.events import RunResult

from .plan import Replan, global_batch, replan, restart_plan, shrunk_parallel, work_ratio

__all__ = ["LiveStop", "LoopRun", "Segment", "Watch", "close_loop", "faulty_keys",
           "summary_lines"]

RunFn = Callable[[Scenario], RunResult]
# a job on real ranks stops itself (the loop's watch beside it): the verdict it
# stopped on and the last iteration it ran, or None when it ran to its end
LiveStop = Callable[[], "tuple[Detection, int] | None"]
MAX_RESTARTS = 16  # a job that keeps failing stops being restarted


@dataclass(frozen=True)
class Segment:
    """One stretch of the job between restarts (``stopped_by`` None: it ran to the end)."""

    scenario: Scenario
    result: RunResult  # the iterations it ran
    first_iteration: int  # the job's iteration number of its iteration 0
    iterations: int
    seconds: float  # from its first iteration's start to its last one's end
    redone_s: float = 0.0  # time of its iterations after the checkpoint it restarts from
    stopped_by: Detection | None = None
    replan: Replan | None = None

    def to_json(self) -> dict[str, Any]:
        p = self.scenario.parallel
        out: dict[str, Any] = {
            "first_iteration": self.first_iteration, "iterations": self.iterations,
            "seconds": self.seconds, "world_size": self.scenario.world_size,
            "dp": p.dp, "microbatches": p.microbatches}
        if self.stopped_by is not None and self.replan is not None:
            out.update(stopped_by=self.stopped_by.to_json(), node_left_out=self.replan.node,
                       spare=self.replan.spare, redone_s=self.redone_s)
        return out


@dataclass(frozen=True)
class LoopRun:
    segments: tuple[Segment, ...]
    detections: tuple[Detection, ...]
    restart_s: float
    baseline_s: float  # the same job without the loop, start to end
    tokens: float  # the job's tokens (every iteration, once)
    false_alarm_s: float  # restarts and redone work caused by verdicts naming healthy parts
    notes: tuple[str, ...] = ()
    checkpoints_s: float = 0.0  # writing the checkpoints (mitigation.checkpoint_s each)

    @property
    def seconds(self) -> float:
        return (sum(s.seconds for s in self.segments) + self.restart_s * (len(self.segments) - 1)
                + self.checkpoints_s)

    def to_json(self) -> dict[str, Any]:
        return {"segments": [s.to_json() for s in self.segments],
                "restarts": len(self.segments) - 1, "restart_s": self.restart_s,
                "seconds": self.seconds, "seconds_without_loop": self.baseline_s,
                "tokens_per_s": self.tokens / self.seconds,
                "tokens_per_s_without_loop": self.tokens / self.baseline_s,
                "false_alarm_s": self.false_alarm_s, "checkpoints_s": self.checkpoints_s,
                "notes": list(self.notes)}


def faulty_keys(s: Scenario) -> set[tuple[int, int | None]]:
    """What a true verdict may name: the ranks and links the faults' ground
    truth says a detector should name (each kind says which)."""
    keys: set[tuple[int, int | None]] = set()
    for t in ground_truth(s.faults, fault_job(s)):
        if t.should_name is not None and t.rank is not None:
            keys.add((min(t.rank, t.peer), max(t.rank, t.peer)) if t.peer is not None
                     else (t.rank, None))
    return keys


def _shifted(d: Detection, offset: int, segment: int) -> Detection:
    window = [w + offset for w in d.evidence.get("window", [])]
    return replace(d, iteration=d.iteration + offset, first_seen=d.first_seen + offset,
                   evidence={**d.evidence, "window": window, "segment": segment})


def _truncated(result: RunResult, iterations: int) -> RunResult:
    """``result`` cut to its first ``iterations``."""
    return kept_rows(result, lambda b: (b.iteration >= 0) & (b.iteration < iterations))


def _stand_ins(source: EventSource, world: int) -> StandIns:
    """The run's classes of identical pipelines (none unless it was reduced)."""
    return StandIns.of(source.stand_ins(), world)


def _rows_of(source: EventSource, stand_ins: StandIns) -> Iterable[EventColumns]:
    """Rows that hold every iteration's times: a reduced run's stored rows
    (a member's are its representative's, moved to its ranks, at the same
    times), else every rank's, batch by batch."""
    return [source.compact()[0]] if stand_ins.reduced else source.batches()


@dataclass
class Spans:
    """Each iteration's (first start, last end) over every rank, gathered from
    batches of rows in any order (``of``), so that no iteration's rows are kept."""

    of: dict[int, tuple[float, float]] = field(default_factory=dict)

    def add(self, cols: EventColumns) -> None:
        has = cols.iteration >= 0
        if not has.any():
            return
        its, inverse = np.unique(cols.iteration[has], return_inverse=True)
        first = np.full(len(its), np.inf)
        last = np.full(len(its), -np.inf)
        np.minimum.at(first, inverse, cols.start_s[has])
        np.maximum.at(last, inverse, cols.end_s[has])
        for it, a, b in zip(its.tolist(), first.tolist(), last.tolist()):
            lo, hi = self.of.get(it, (a, b))
            self.of[it] = (min(lo, a), max(hi, b))


def _span_s(spans: dict[int, tuple[float, float]], first: int, last: int) -> float:
    return spans[last][1] - spans[first][0] if last >= first else 0.0


@dataclass
class Watch:
    """One segment's scan: which verdict is due to stop the job, and when."""

    scan: OnlineScan
    policy: Mitigation
    scenario: Scenario  # the segment watched (its layout prices a re-plan)
    due: tuple[Detection, int] | None = None  # the verdict, the boundary it stops at

    def pays(self, verdict: Detection) -> bool:
        """Whether acting on ``verdict`` is allowed by ``only_if_faster``: the
        iteration less the cause's cost, on the re-planned layout (a spare's
        the same), is shorter than the iteration seen."""
        blame, seen = verdict.evidence.get("blame_s"), verdict.evidence.get("iteration_s")
        if not self.policy.only_if_faster or blame is None or not seen:
            return True
        return (float(seen) - float(blame)) * self.plan_ratio() < float(seen)

    def plan_ratio(self) -> float:
        """An iteration of the job re-planned without a node over one of this
        segment's, at the same microbatch cost (inf: no plan fits)."""
        s = self.scenario
        if s.mitigation is not None and s.mitigation.spares:  # replan's choice
            return 1.0
        shrunk = shrunk_parallel(s.parallel, s.world_size - s.cluster.gpus_per_node)
        return float("inf") if shrunk is None else work_ratio(s.parallel, shrunk)

    def step(self, iteration: int, decided: list[Detection]) -> Detection | None:
        """The verdict that stops the job at the end of ``iteration``, if any."""
        if self.due is None:
            named = [d for d in decided if d.event == "named"
                     and d.confidence >= self.policy.min_confidence and self.pays(d)]
            if named:
                self.due = (named[0], iteration + self.policy.hold_iterations)
        if self.due is None or iteration < self.due[1]:
            return None
        verdict, self.due = self.due[0], None
        standing = {d.key for d in self.scan.named}
        return verdict if verdict.key in standing else None  # withdrawn: the job goes on

    def acts(self, iteration: int, decided: list[Detection], restarts: int, done: int,
             job_iterations: int) -> Detection | None:
        """The verdict the loop acts on at the end of ``iteration``: due, standing,
        and with iterations of the job still to run after it."""
        verdict = self.step(iteration, decided) if self.policy.action == "exclude" else None
        more = done + iteration + 1 < job_iterations
        return verdict if verdict is not None and restarts < MAX_RESTARTS and more else None


def close_loop(s: Scenario, first: RunResult, run: RunFn,
               report: Callable[[list[Detection]], None],
               config: OnlineConfig = SIMULATED, live: LiveStop | None = None) -> LoopRun:
    """Run the loop over ``first`` (``s`` as simulated without it); ``run``
    simulates each re-planned job; ``report`` gets detections as they are made.
    ``live``: the jobs ran on real ranks that stopped where it says (their
    iterations are scanned here for the record), not where this scan would."""
    policy = s.mitigation or Mitigation()
    segments: list[Segment] = []
    detections: list[Detection] = []
    notes: list[str] = []
    truth, scenario, result, done, false_s = faulty_keys(s), s, first, 0, 0.0
    while True:
        scan = OnlineScan(config, gpus_per_node=scenario.cluster.gpus_per_node, scenario=scenario)
        watch, spans, stop = Watch(scan, policy, scenario), Spans(), None
        source = source_of(result)
        reduced = _stand_ins(source, scenario.world_size).reduced
        for i, cols in iterations_of(source, compact=reduced):
            spans.add(cols)  # the iteration's time is all the loop keeps of it
            cols = cols if live is None else on_device(cols)  # as the live scan saw them
            decided = [_shifted(d, done, len(segments)) for d in scan.feed(i, cols)]
            detections += decided
            report(decided)
            if live is None and (verdict := watch.acts(i, decided, len(segments), done,
                                                       s.iterations)) is not None:
                stop = _stop(scenario, verdict, i, spans.of, policy, done, notes)
                if stop is not None:
                    break
        if live is not None and (stopped := live()) is not None:
            stop = _stop(scenario, _shifted(stopped[0], done, len(segments)), stopped[1],
                         spans.of, policy, done, notes)
        if stop is None and result.stopped is not None:  # a fail-stop fault ended the segment
            stop = _crash_stop(scenario, result.stopped, policy, done)
        ran = len(spans.of)
        if stop is None:  # a simulated segment that ran to its end is kept as it is
            kept = result if live is None else _truncated(result, ran)
            segments.append(Segment(scenario, kept, done, ran,
                                    _span_s(spans.of, 0, ran - 1)))
            break
        verdict, plan, checkpoint = stop
        redone = _span_s(spans.of, checkpoint - done, ran - 1)
        segments.append(Segment(scenario, _truncated(result, ran), done, ran,
                                _span_s(spans.of, 0, ran - 1), redone, verdict, plan))
        if (verdict.rank, verdict.peer) not in truth:
            false_s += policy.restart_s + redone
        done = checkpoint
        scenario = plan.scenario.model_copy(update={"iterations": s.iterations - done})
        result = run(scenario)
    tokens = float(s.iterations * global_batch(s.parallel, s.model.micro_batch_size)
                   * s.model.seq_len)
    checkpoints = sum(seg.iterations // policy.checkpoint_every for seg in segments)
    return LoopRun(tuple(segments), tuple(detections), policy.restart_s,
                   _baseline_s(first, s, notes), tokens, false_s, tuple(notes),
                   checkpoints * policy.checkpoint_s)


def _baseline_s(first: RunResult, s: Scenario, notes: list[str]) -> float:
    """The job's time without the loop: its first run, start to end (a job
    stopped on real ranks has only its first iterations: their pace, and a note)."""
    spans, iterations = Spans(), s.iterations
    source = source_of(first)
    for batch in _rows_of(source, _stand_ins(source, s.world_size)):
        spans.add(batch)
    if first.stopped is not None and first.stopped["iterations_completed"]:  # cut short
        spans.of = {i: span for i, span in spans.of.items()
                    if i < first.stopped["iterations_completed"]}
    if len(spans.of) >= iterations:
        return _span_s(spans.of, 0, iterations - 1)
    notes.append(f"without the loop: {iterations} iterations at the pace of the first "
                 f"{len(spans.of)}, which were not stopped or cut short")
    return _span_s(spans.of, 0, len(spans.of) - 1) / len(spans.of) * iterations


def _stop(s: Scenario, verdict: Detection, iteration: int,
          spans: dict[int, tuple[float, float]], policy: Mitigation, done: int, notes: list[str]
          ) -> tuple[Detection, Replan, int] | None:
    """The stop a verdict causes at the end of ``iteration`` (the segment's own
    numbering): the re-plan and the checkpoint it restarts from; None (and a
    note) when no plan fits what is left."""
    elapsed = _span_s(spans, 0, iteration)
    try:
        plan = replan(s, verdict.rank, elapsed)
    except UserError as err:
        notes.append(f"iteration {done + iteration}: not acted on: {err}")
        return None
    completed = done + iteration + 1
    checkpoint = max(done, completed // policy.checkpoint_every * policy.checkpoint_every)
    return verdict, plan, checkpoint


def _crash_stop(s: Scenario, stopped: dict[str, Any], policy: Mitigation, done: int
                ) -> tuple[Detection, Replan, int]:
    """A segment a failure stopped: the restart from its last checkpoint."""
    completed = done + int(stopped["iterations_completed"])
    checkpoint = max(done, completed // policy.checkpoint_every * policy.checkpoint_every)
    rank = int(stopped["rank"])
    failure = Detection("named", "stop", rank, None, 1.0, completed, completed,
                        {"by": stopped["by"], "at_s": stopped["at_s"]})
    return failure, restart_plan(s, rank, float(stopped["at_s"])), checkpoint


def summary_lines(loop: dict[str, Any], segment_dirs: list[str]) -> list[str]:
    """What ``run`` prints about the loop (``loop``: ``LoopRun.to_json()``)."""
    lines = []
    segments = loop["segments"]
    for before, after, where in zip(segments, segments[1:], segment_dirs):
        v = before["stopped_by"]
        if v["kind"] == "stop":  # not a verdict: the rank failed and the job stopped
            lines.append(f"  mitigation: rank {v['rank']} failed ({v['evidence']['by']} at "
                         f"{v['evidence']['at_s']:.6g} s of the segment) after iteration "
                         f"{v['iteration'] - 1}; restarted from the checkpoint of iteration "
                         f"{after['first_iteration']} on the same layout (wrote {where})")
            continue
        named = f"link {v['rank']}-{v['peer']}" if v["peer"] is not None else f"rank {v['rank']}"
        plan = "a spare in its place" if before["spare"] else (
            f"dp {before['dp']} -> {after['dp']} with {after['microbatches']} microbatches")
        lines.append(f"  mitigation: {named} named at iteration {v['iteration']}; stopped after "
                     f"iteration {before['first_iteration'] + before['iterations'] - 1}, node "
                     f"{before['node_left_out']} left out, {plan}; restarted from iteration "
                     f"{after['first_iteration']} (wrote {where})")
    lines += [f"  note: {n}" for n in loop["notes"]]
    failed = any(seg.get("stopped_by", {}).get("kind") == "stop" for seg in segments)
    without = "without failures, at the first run's pace" if failed else "without"
    lines.append(f"  goodput: {loop['tokens_per_s']:,.0f} tokens/s with the loop, "
                 f"{loop['tokens_per_s_without_loop']:,.0f} {without} ({loop['restarts']} restarts "
                 f"of {loop['restart_s']:g} s; false alarms cost {loop['false_alarm_s']:.3f} s)")
    return lines
