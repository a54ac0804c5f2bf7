"""Calibrating the efficiency model from a measured run.

A measured run (our run directory or trace file: per-rank events with
iteration, microbatch, chunk, bytes, peer, group) is reduced to medians over
steady-state iterations (the first is warm-up), and each constant is fitted
from the events that expose it:

- forward compute of a chunk = layers·(Σ GEMM FLOPs/R + GEMMs·GEMM overhead)
  + module calls·module overhead (each layer, the first chunk's embedding, the
  last chunk's output layer with its GEMM and loss) + elementwise time at the
  scenario's traffic: linear in (1/R, GEMM overhead, module overhead), fitted by
  non-negative least squares over the distinct chunk kinds (first / middle /
  last / only);
- backward compute / forward compute of the same chunk kind: ``backward_ratio``;
- the spread of the same task's compute times (log scale, robust): the
  machine's noise, ``cluster.jitter.compute_sigma``; in a pipeline every stage
  waits for the slowest of its inputs, so noise lengthens iterations beyond
  what median durations add up to;
- the optimizer step (memory-bound: read and write every state byte): HBM bandwidth;
- the time between operations that none of them covers, per operation issued:
  ``op_overhead_us``;
- a collective's shortest member time (the last to arrive waits for no one):
  ring latency per link class;
- a message's transfer time (receive end minus send post, for messages whose
  receiver was already waiting, less the latency): bandwidth per link class.

Identifiability: the three compute constants need three independent chunk
kinds, e.g. an interleaved run with first, middle and last chunks; with fewer,
the non-negative fit keeps the constants that explain the times best.
"""
from __future__ import annotations

import argparse
import itertools
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import yaml

from ..scenario.config import Scenario, ScenarioError, load_scenario, parse_scenario, read_scenario_data
from ..errors import UserError
from ..costs.flops import layer_gemms, logits_forward_flops
from ..trace.kinds import event_kind, p2p_side
from ..program.layout import pipe_shape, topology_of
from ..costs.memory import BYTES, layer_activation_bytes, state_bytes
from ..trace.summary import iteration_times
from ..trace.events import Event
from .fit import with_settings

Events = Mapping[int, list[Event]]
GEMMS_PER_LAYER = 6
MAD_TO_SIGMA = 1.4826
CHECK_ITERATIONS = 21


@dataclass(frozen=True)
class Measured:
    """A measured run: its scenario and its events (true time, seconds)."""

    scenario: Scenario
    events: dict[int, list[Event]]
    profiled: bool = False  # a torch.profiler trace: it times only the ranges it annotates


@dataclass
class Calibration:
    settings: dict[str, float] = field(default_factory=dict)  # dotted key -> value
    evidence: dict[str, Any] = field(default_factory=dict)  # what each fit used


# ----------------------------------------------------------------- input
def load_measured(path: Path, scenario_path: Path) -> Measured:
    """A run directory (its summary.json names the scenario that ran), one of
    our trace files, or a torch.profiler trace (a file, or a directory of one
    per rank), the last two described by ``scenario_path``."""
    from ..scan.ingest.load import read_events
    from ..trace.summary_file import SUMMARY_FILE, read_summary
    from .profiled import annotate, is_profile, load_profile

    path = Path(path)
    if not path.exists():
        raise UserError(f"measured: {path} not found")
    if is_profile(path):
        ran = load_scenario(scenario_path)
        return Measured(ran, annotate(load_profile(path), ran), profiled=True)
    trace = path / "trace.json" if path.is_dir() else path
    if not trace.is_file():
        raise UserError(f"measured: {trace} not found (a run directory or its trace.json)")
    summary = trace.parent / SUMMARY_FILE
    if summary.is_file():
        try:
            ran = parse_scenario(read_summary(summary).scenario)
        except ValueError as err:
            raise UserError(f"measured: {summary} has no usable scenario ({err})") from None
    else:
        ran = load_scenario(scenario_path)
    return Measured(ran, read_events(trace))


def steady(events: Events) -> dict[int, list[Event]]:
    """Events of every iteration but the first (warm-up), when there are several."""
    its: set[int] = {e.args["iteration"] for ev in events.values() for e in ev
                     if e.args.get("iteration") is not None}
    skip = min(its) if len(its) > 1 else None
    return {r: [e for e in ev if e.args.get("iteration", -1) != skip]
            for r, ev in events.items()}


# --------------------------------------------------------------- compute
def chunk_kind(s: Scenario, pp_rank: int, chunk: int) -> tuple[bool, bool]:
    shape = pipe_shape(s)
    return shape.is_first(pp_rank, chunk), shape.is_last(pp_rank, chunk)


def chunk_features(s: Scenario, first: bool, last: bool) -> np.ndarray:
    """Coefficients of (1/R, GEMM overhead, module overhead) in one chunk's
    forward, and the elementwise seconds at the scenario's own traffic."""
    p, m = s.parallel, s.model
    layers = m.layers // (p.pp * p.vpp)
    flops = layers * layer_gemms(s).total / p.tp
    gemms = layers * GEMMS_PER_LAYER
    modules = layers + int(first) + int(last)
    nbytes = layers * layer_activation_bytes(s, "none")
    if first:
        nbytes += m.micro_batch_size * m.seq_len * m.hidden * BYTES[s.training.precision]
    if last:
        flops += logits_forward_flops(s) / p.tp
        gemms += 1
        nbytes += m.micro_batch_size * m.seq_len * m.vocab // p.tp * 4
    gpu = s.cluster.gpu
    return np.array([flops, gemms, modules,
                     gpu.elementwise_traffic * nbytes / (gpu.hbm_tbps * 1e12)], dtype=float)


def task_durations(s: Scenario, events: Events, name: str
                   ) -> dict[tuple[bool, bool], list[float]]:
    """Durations of ``name`` per chunk kind (pieces of one task summed)."""
    topo = topology_of(s)
    per_task: dict[tuple[Any, ...], float] = defaultdict(float)
    for rank, ev in events.items():
        pp = topo.coord(rank).pp
        for e in ev:
            if e.name == name and "chunk" in e.args:
                kind = chunk_kind(s, pp, e.args["chunk"])
                per_task[(kind, rank, e.args.get("iteration"), e.args["microbatch"],
                          e.args["chunk"])] += e.dur_s
    by_kind: dict[tuple[bool, bool], list[float]] = defaultdict(list)
    for key, dur in per_task.items():
        by_kind[key[0]].append(dur)
    return dict(by_kind)


def log_spread(samples: Iterable[list[float]]) -> float:
    """Pooled robust sigma of log durations around each group's median: the
    lognormal noise (``cluster.jitter.compute_sigma``) that makes the same work
    take different times."""
    deviations = []
    for durs in samples:
        logs = np.log([d for d in durs if d > 0])
        if len(logs) > 1:
            deviations += list(np.abs(logs - np.median(logs)))
    return MAD_TO_SIGMA * float(np.median(deviations)) if deviations else 0.0


def nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 and the first one (the FLOP
    rate's) always used: the best over column subsets whose unconstrained
    solution is non-negative (a handful of columns)."""
    best, best_err = np.zeros(a.shape[1]), float("inf")
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            if cols[0] != 0:
                continue
            sub = a[:, cols]
            if np.linalg.matrix_rank(sub) < k:
                continue
            x = np.linalg.lstsq(sub, b, rcond=None)[0]
            if np.all(x >= 0):
                err = float(np.sum((sub @ x - b) ** 2))
                if err < best_err - 1e-30:
                    best, best_err = np.zeros(a.shape[1]), err
                    best[list(cols)] = x
    return best


def fit_compute(s: Scenario, events: Events, cal: Calibration) -> None:
    fwd_samples = task_durations(s, events, "forward")
    bwd_samples = task_durations(s, events, "backward")
    forward = {k: median(v) for k, v in fwd_samples.items()}
    backward = {k: median(v) for k, v in bwd_samples.items()}
    if not forward:
        raise UserError("measured: no forward events with a chunk to calibrate compute from")
    kinds = sorted(forward)
    features = np.array([chunk_features(s, *k) for k in kinds])
    a, elementwise = features[:, :3], features[:, 3]
    b = np.array([forward[k] for k in kinds]) - elementwise
    scale = np.where(np.abs(a).max(axis=0) > 0, np.abs(a).max(axis=0), 1.0)
    inv_rate, overhead, module = nonnegative_lstsq(a / scale, b) / scale
    if inv_rate <= 0:
        raise UserError("measured: forward times do not grow with FLOPs; cannot fit a FLOP rate")
    gpu = s.cluster.gpu
    cal.settings["cluster.gpu.efficiency"] = min(1.0, float(1.0 / inv_rate / (gpu.tflops * 1e12)))
    cal.settings["cluster.gpu.gemm_overhead_us"] = float(overhead * 1e6)
    cal.settings["cluster.gpu.module_overhead_us"] = float(module * 1e6)
    cal.evidence["forward_s_by_chunk_kind"] = {_kind_name(k): forward[k] for k in kinds}
    cal.evidence["forward_fit_residual_s"] = (a @ np.array([inv_rate, overhead, module])
                                               - b).tolist()
    cal.evidence["effective_tflops"] = float(1.0 / inv_rate / 1e12)
    if cal.evidence["effective_tflops"] * 1e12 > gpu.tflops * 1e12:
        cal.evidence["note"] = "measured rate above the scenario's peak: efficiency capped at 1"
    sigma = log_spread(list(fwd_samples.values()) + list(bwd_samples.values()))
    cal.settings["cluster.jitter.compute_sigma"] = min(sigma, 1.0)
    common = [k for k in kinds if k in backward]
    if common:
        cal.settings["cluster.gpu.backward_ratio"] = (sum(backward[k] for k in common)
                                                      / sum(forward[k] for k in common))


def _kind_name(kind: tuple[bool, bool]) -> str:
    return {(True, True): "only", (True, False): "first", (False, True): "last",
            (False, False): "middle"}[kind]


def fit_memory_bound(s: Scenario, events: Events, cal: Calibration) -> None:
    """HBM bandwidth from the optimizer step (memory-bound: every state byte
    read and written once). The elementwise traffic keeps the scenario's value:
    three chunk kinds tell only three compute constants apart."""
    steps = [e.dur_s for ev in events.values() for e in ev if e.name == "optimizer"]
    if not steps:
        return
    from ..costs.memory import max_stage_params

    t = s.training
    per = state_bytes(t, s.parallel.dp_cp)
    shard = max_stage_params(s) / (s.parallel.dp_cp if t.distributed_optimizer else 1)
    moved = 2 * shard * (per.weights + per.grads + state_bytes(t, 1).optimizer)
    hbm = moved / median(steps)
    cal.settings["cluster.gpu.hbm_tbps"] = hbm / 1e12
    cal.evidence["optimizer_s"] = median(steps)


def fit_op_overhead(events: Events, cal: Calibration) -> None:
    """Host time per issued operation: per rank, the time between its
    operations that no blocking one covers (sends run in the background),
    over the operations issued after its first."""
    per_rank = []
    for ev in events.values():
        blocking = sorted((e for e in ev if not _is_send(e)),
                          key=lambda e: e.start_s)
        gaps = sum(max(0.0, b.start_s - a.end_s) for a, b in zip(blocking, blocking[1:]))
        if len(ev) > 1:
            per_rank.append(gaps / (len(ev) - 1))
    if per_rank:
        cal.settings["cluster.gpu.op_overhead_us"] = median(per_rank) * 1e6


def _is_send(e: Event) -> bool:
    side = p2p_side(e.name, e.args)
    return side is not None and side[0] == "send"


# ----------------------------------------------------------------- links
def fit_links(s: Scenario, events: Events, cal: Calibration) -> None:
    topo = topology_of(s)
    latency = _collective_latency(events, topo.same_node)
    for cls, alpha in latency.items():
        cal.settings[f"cluster.links.{cls}_node_latency_us"] = alpha * 1e6
    for cls, (nbytes, secs) in _transfers(events, topo.same_node).items():
        alpha = latency.get(cls, 0.0)
        if secs > alpha:
            cal.settings[f"cluster.links.{cls}_node_gbps"] = nbytes / (secs - alpha) * 8 / 1e9
    cal.evidence["latency_s"] = latency


def _link_class(group: Iterable[int], same_node: Callable[[int, int], bool]) -> str:
    members = list(group)
    return "intra" if all(same_node(members[0], r) for r in members) else "inter"


def _collective_latency(events: Events, same_node: Callable[[int, int], bool]) -> dict[str, float]:
    """Per link class: the median over small collectives of their shortest member
    time, over the ring's 2(n-1) latency steps."""
    instances: dict[tuple[Any, ...], list[Event]] = defaultdict(list)
    for ev in events.values():
        seen: dict[tuple[int, ...], int] = defaultdict(int)
        for e in sorted(ev, key=lambda e: e.start_s):
            if event_kind(e.name, e.args) == "collective" and "group" in e.args:
                g = tuple(e.args["group"])
                instances[(g, seen[g])].append(e)
                seen[g] += 1
    per_class: dict[str, list[float]] = defaultdict(list)
    for (group, _), members in instances.items():
        if len(members) == len(group) > 1 and members[0].args.get("bytes", 0) <= 64:
            steps = 2 * (len(group) - 1)
            per_class[_link_class(group, same_node)].append(
                min(e.dur_s for e in members) / steps)
    return {cls: median(v) for cls, v in per_class.items()}


def _transfers(events: Events, same_node: Callable[[int, int], bool]
               ) -> dict[str, tuple[float, float]]:
    """Per link class: (median bytes, median seconds) of the messages whose
    receiver was already waiting, from the send's post to the receive's end."""
    sends: dict[tuple[Any, ...], list[Event]] = defaultdict(list)
    recvs: dict[tuple[Any, ...], list[Event]] = defaultdict(list)
    for rank, ev in events.items():
        for e in sorted(ev, key=lambda e: e.start_s):  # a stream pairs up in order
            side = p2p_side(e.name, e.args)
            if side is None:
                continue
            role, stream = side
            src, dst = (rank, e.args["peer"]) if role == "send" else (e.args["peer"], rank)
            key = (src, dst, stream, e.args.get("iteration"))
            (sends if role == "send" else recvs)[key].append(e)
    per_class: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for key, sent in sends.items():
        for s_ev, r_ev in zip(sent, recvs.get(key, [])):
            if r_ev.args.get("bytes", 0) <= 0:  # a profile may not know a message's size
                continue
            if r_ev.start_s <= s_ev.start_s:  # the receiver waited: the whole transfer shows
                per_class[_link_class(key[:2], same_node)].append(
                    (r_ev.args["bytes"], r_ev.end_s - s_ev.start_s))
    return {cls: (median(b for b, _ in v), median(t for _, t in v))
            for cls, v in per_class.items() if v}


# ------------------------------------------------------------------ all
def calibrate(m: Measured) -> Calibration:
    events = steady(m.events)
    cal = Calibration()
    fit_compute(m.scenario, events, cal)
    fit_memory_bound(m.scenario, events, cal)
    if m.profiled:  # gaps between a profile's ranges are not gaps between operations
        cal.evidence["kept_from_scenario"] = ["cluster.gpu.op_overhead_us"]
    else:
        fit_op_overhead(events, cal)
    fit_links(m.scenario, events, cal)
    cal.evidence["measured_iteration_s"] = median(iteration_times(events))
    return cal


def calibrated_data(scenario_path: Path, cal: Calibration) -> dict[str, Any]:
    """The scenario file's data with the fitted constants written in."""
    data = read_scenario_data(scenario_path)
    for key, value in sorted(cal.settings.items()):
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = float(f"{value:.6g}")
    return data


def default_out(scenario: str) -> Path:
    path = Path(scenario)
    return path.with_name(path.stem + ".calibrated.yaml")


def calibrate_command(args: argparse.Namespace, simulate: Callable[[Scenario], list[float]]
                      ) -> int:
    from ..io.outdirs import check_file, new_file

    out = Path(args.out) if args.out else default_out(args.scenario)
    inputs = [Path(args.scenario), Path(args.measured)]
    check_file(out, "--out", args.force, inputs)  # before the work, not after it
    measured = load_measured(Path(args.measured), Path(args.scenario))
    cal = calibrate(measured)
    data = calibrated_data(Path(args.scenario), cal)
    try:
        parse_scenario(data)
    except ScenarioError as err:
        raise UserError(f"calibrate: the fitted constants make an invalid scenario ({err})"
                        ) from None
    # the fitted noise makes simulated iterations differ: compare over many
    iterations = max(measured.scenario.iterations, CHECK_ITERATIONS)
    check = with_settings(measured.scenario, {**cal.settings, "iterations": iterations})
    simulated = simulate(check)
    sim_s = median(simulated[1:] if len(simulated) > 1 else simulated)
    measured_s = cal.evidence["measured_iteration_s"]
    with new_file(out, "--out", args.force, inputs) as tmp:
        tmp.write_text("# Calibrated by megatronapp calibrate from " + str(args.measured) + "\n"
                       + yaml.safe_dump(data, sort_keys=False))
    report = {"settings": cal.settings, "evidence": cal.evidence,
              "measured_iteration_s": measured_s, "simulated_iteration_s": sim_s,
              "written": str(out)}
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    print(f"calibrated {measured.scenario.name} from {args.measured}:")
    for key, value in sorted(cal.settings.items()):
        print(f"  {key} = {value:.6g}")
    for key in cal.evidence.get("kept_from_scenario", []):
        print(f"  {key}: kept from the scenario (a profile does not show it)")
    print(f"  measured iteration {measured_s * 1e3:.3f} ms, the calibrated simulator "
          f"gives {sim_s * 1e3:.3f} ms ({(sim_s / measured_s - 1) * 100:+.1f}%)")
    print(f"  wrote {out}")
    return 0
