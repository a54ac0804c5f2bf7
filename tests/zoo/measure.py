"""What a zoo job's traces say about its ranks' own compute.

A rank's compute is the summed duration of its ``aten::mm`` / ``aten::addmm``
/ ``aten::bmm`` cpu_ops: every matmul of forward and backward (nothing else
in the zoo's jobs computes much), and none of the time spent waiting. A
profiled megatronapp run marks each of its compute ops with a range of its
own (``forward``, ``backward``), which also holds what a throttle adds:
there a rank's compute is the summed duration of those ranges."""
from __future__ import annotations

import gzip
import json
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterable

MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::bmm"})
WORK_RANGES = frozenset({"forward", "backward"})


def traces(out: Path) -> Iterable[dict[str, Any]]:
    """Each rank's trace file in ``out`` (gzipped or not), read."""
    for path in sorted(out.glob("*.pt.trace.json*")):
        opened = gzip.open(path, "rt") if path.suffix == ".gz" else path.open()
        with opened as f:
            yield json.load(f)


def durations_of(out: Path, category: str, names: Collection[str]) -> dict[int, list[float]]:
    """Each rank's durations (µs) of its events named ``names`` in ``category``."""
    return {int(t["distributedInfo"]["rank"]): [
        e["dur"] for e in t["traceEvents"] if e.get("cat") == category and e.get("name") in names]
        for t in traces(out)}


def matmul_durations(out: Path) -> dict[int, list[float]]:
    """Each rank's matmul durations (µs), from its trace file in ``out``."""
    return durations_of(out, "cpu_op", MATMULS)


def work_range_seconds(out: Path) -> dict[int, float]:
    """Each rank's summed ``forward`` / ``backward`` ranges (s)."""
    return {rank: sum(d) / 1e6
            for rank, d in durations_of(out, "user_annotation", WORK_RANGES).items()}


def compute_seconds(out: Path) -> dict[int, float]:
    """Each rank's summed matmul time (s), from its trace file in ``out``."""
    return {rank: sum(d) / 1e6 for rank, d in matmul_durations(out).items()}


def fastest_matmul_us(out: Path) -> dict[int, float]:
    """Each rank's shortest matmul (µs): its speed when it had a core to
    itself. Sums are wall time: with four ranks on two cores, the peers'
    matmuls share the cores while the slowed rank often runs alone (they wait
    for it), which can hide even a 3x slowdown in the sums."""
    return {rank: min(d) for rank, d in matmul_durations(out).items()}


def realized_slowdown(seconds: dict[int, float], slow_rank: int | None,
                      alike: Collection[int] | None = None) -> float:
    """The slowed rank's compute over the median of its peers'; without a
    slowed rank, the largest such ratio over the ranks. ``alike``: the ranks
    that do the same work (all, if not given), the only ones compared."""
    seconds = {r: v for r, v in seconds.items() if alike is None or r in alike}

    def over_peers(rank: int) -> float:
        return seconds[rank] / statistics.median(v for r, v in seconds.items() if r != rank)
    if slow_rank is not None:
        return over_peers(slow_rank)
    return max(over_peers(rank) for rank in seconds)


# ---------------------------------------------------------------- per step
# What one rank's trace says about each of its ProfilerStep#N iterations.
# Compute: the matmuls above, the convolutions, CPU attention and oneDNN's
# LSTM layers (forward and backward; a CPU LSTM does its matmuls inside
# them), each counted at one level (``aten::convolution`` holds the
# ``aten::_convolution`` that does its work, which is not counted again).
COMPUTE = MATMULS | {"aten::convolution", "aten::convolution_backward",
                     "aten::_scaled_dot_product_flash_attention_for_cpu",
                     "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
                     "aten::mkldnn_rnn_layer", "aten::mkldnn_rnn_layer_backward"}
STEP_PREFIX = "ProfilerStep#"
RECV_POST, RECV_WAIT = "c10d::recv_", "gloo:recv"


@dataclass(frozen=True)
class StepMeasure:
    """One rank's iteration ``step`` (the N of ``ProfilerStep#N``), in µs:
    its length, its compute (duration and calls, by name and input shapes
    where recorded), and its time outside ops: covered by no cpu_op of the
    training thread and no ``gloo:*`` communication range of any thread
    (gloo runs DDP's and FSDP's collectives on threads of its own, and the
    training thread's wait for them is in no op): Python work, sleeps, a
    data loader's own work."""
    step: int
    duration: float
    compute: float
    calls: Counter[str]
    outside: float


def by_rank(out: Path) -> dict[int, dict[str, Any]]:
    """Each rank's trace in ``out``, by the rank in its ``distributedInfo``."""
    return {int(t["distributedInfo"]["rank"]): t for t in traces(out)}


def main_thread_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The complete events of the thread that holds the ProfilerStep ranges
    (the one that trained; other threads' events are left out), by start."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    tids = {e["tid"] for e in events if str(e.get("name")).startswith(STEP_PREFIX)}
    return sorted((e for e in events if e["tid"] in tids), key=lambda e: e["ts"])


def step_measures(trace: dict[str, Any]) -> list[StepMeasure]:
    events = main_thread_events(trace)
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    communication = [e for e in trace["traceEvents"]
                     if e.get("ph") == "X" and str(e.get("name")).startswith("gloo:")]
    return [measure_step(step, ops, communication) for step in events
            if step["name"].startswith(STEP_PREFIX)]


def measure_step(step: dict[str, Any], ops: list[dict[str, Any]],
                 communication: list[dict[str, Any]]) -> StepMeasure:
    start, end = step["ts"], step["ts"] + step["dur"]
    inside = [e for e in ops if start <= e["ts"] < end]
    compute = [e for e in inside if e["name"] in COMPUTE]
    busy = [(max(e["ts"], start), min(e["ts"] + e["dur"], end))
            for e in inside + communication if e["ts"] < end and e["ts"] + e["dur"] > start]
    return StepMeasure(int(step["name"][len(STEP_PREFIX):]), step["dur"],
                       sum(e["dur"] for e in compute), Counter(map(call_key, compute)),
                       step["dur"] - covered(busy))


def call_key(event: dict[str, Any]) -> str:
    """An op's name with its input shapes, where the trace records them."""
    dims = event.get("args", {}).get("Input Dims")
    return f"{event['name']} {dims}" if dims is not None else event["name"]


def covered(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of ``intervals``."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def receive_waits(trace: dict[str, Any]) -> dict[int | None, list[float]]:
    """This rank's waits for point-to-point data (µs), by sender: each
    ``gloo:recv`` range (posted receive to data in hand) belongs to the
    ``c10d::recv_`` op that posted it, the last one before it; its sender
    is known only where the trace records shapes (``None`` otherwise)."""
    waits: dict[int | None, list[float]] = {}
    sender: int | None = None
    for e in main_thread_events(trace):
        if e["name"] == RECV_POST:
            inputs = e.get("args", {}).get("Concrete Inputs")
            sender = int(inputs[2]) if inputs and inputs[2] != "" else None
        elif e["name"] == RECV_WAIT:
            waits.setdefault(sender, []).append(e["dur"])
    return waits


# ------------------------------------------------------- realized effects
# What a run's traces show of what was injected into it, from each rank's
# step measures: ``RunMeasures`` maps rank -> its steps.
RunMeasures = dict[int, list[StepMeasure]]


def run_measures(out: Path) -> RunMeasures:
    return {rank: step_measures(trace) for rank, trace in by_rank(out).items()}


def per_step_mean(measures: RunMeasures, rank: int, field: str,
                  steps: Collection[int] | None = None) -> float:
    """The mean of ``field`` (µs) over ``rank``'s steps (those in ``steps``)."""
    values = [getattr(m, field) for m in measures[rank] if steps is None or m.step in steps]
    return statistics.fmean(values)


def peers_median(measures: RunMeasures, ranks: Collection[int], field: str,
                 steps: Collection[int] | None = None) -> float:
    """The median over the ranks not in ``ranks`` of their mean ``field``."""
    return statistics.median(per_step_mean(measures, r, field, steps)
                             for r in measures if r not in ranks)


def over_peers(measures: RunMeasures, ranks: Collection[int], field: str,
               steps: Collection[int] | None = None) -> dict[int, float]:
    """Each of ``ranks``' mean ``field`` per step over the median of the
    other ranks' (those not in ``ranks``)."""
    typical = peers_median(measures, ranks, field, steps)
    return {r: per_step_mean(measures, r, field, steps) / typical for r in ranks}


def excess_over_peers_ms(measures: RunMeasures, ranks: Collection[int], field: str,
                         steps: Collection[int] | None = None) -> dict[int, float]:
    """Each of ``ranks``' mean ``field`` per step minus the median of the
    other ranks' (ms)."""
    typical = peers_median(measures, ranks, field, steps)
    return {r: (per_step_mean(measures, r, field, steps) - typical) / 1e3 for r in ranks}


def calls_per_step(measures: RunMeasures, rank: int, steps: Collection[int] | None = None
                   ) -> float:
    return statistics.fmean(sum(m.calls.values()) for m in measures[rank]
                            if steps is None or m.step in steps)


def median_step_ms(measures: RunMeasures) -> float:
    """The median iteration (ms) over every rank's steps."""
    return statistics.median(m.duration for steps in measures.values() for m in steps) / 1e3


def healthy_spread(measures: RunMeasures) -> dict[str, float]:
    """What the machine's noise alone makes of a run: the largest compute
    over its peers' and the largest time outside ops over its peers' (ms)."""
    ranks = list(measures)
    return {"max_compute_over_peers": max(over_peers(measures, [r], "compute")[r] for r in ranks),
            "max_outside_excess_ms": max(excess_over_peers_ms(measures, [r], "outside")[r]
                                         for r in ranks)}


def link_waits_ms(traces_by_rank: dict[int, dict[str, Any]], sender: int, receiver: int
                  ) -> dict[str, float | None]:
    """The receiver's waits for data: with peers recorded, the median wait
    for a message from ``sender`` and the median of every other
    (receiver, sender) pair's median; without, the receiver's total receive
    wait per trace against the median of the other receivers' totals."""
    waits = {r: receive_waits(t) for r, t in traces_by_rank.items()}
    if all(None not in w for w in waits.values()):
        pairs = {(r, s): statistics.median(v) / 1e3 for r, w in waits.items()
                 for s, v in w.items() if s is not None}
        others = [v for k, v in pairs.items() if k != (receiver, sender)]
        return {"pair_wait_ms": pairs.get((receiver, sender)),
                "other_pairs_wait_ms": statistics.median(others) if others else None}
    totals = {r: sum(sum(v) for v in w.values()) / 1e3 for r, w in waits.items() if w}
    others = [v for r, v in totals.items() if r != receiver]
    return {"receiver_wait_ms": totals.get(receiver),
            "other_receivers_wait_ms": statistics.median(others) if others else None}
