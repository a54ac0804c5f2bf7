"""Everything about blame in seconds lives here: for one batch of whole
iterations, how much earlier each iteration would have ended had a suspect
taken its expected time.

The suspects are each rank's compute, each rank's host time (the gaps in
which it ran no op) and each link's transfers (``expected``). Those that ran
over their expected time (the ``shortlist`` most over it, measured against
the batch's own noise) are replayed over the batch's dependency graph
(``replay``): once with all of them at their expected time, and once for
each with all but it so. A suspect's blame in an iteration is how much
longer that iteration took with it left as recorded than with none left: the
delay it alone causes, whatever else is slow at the same time (two slow
ranks in one data-parallel group are each blamed their own delay, not
nothing because the other would still hold the iteration). Its delay by an
iteration's end is the running sum of its blame: how much earlier that
iteration would have ended. An iteration can make up part of an earlier
one's delay (its blame is then below zero), and the rest still stands.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Mapping

import numpy as np

from megatronapp.scan.align.inputs import ScanInput

from .expected import Table, Work, link_table, rank_tables
from .graph import Graph, graph_of
from .replay import CriticalShare, Replayer, Suspects, critical_share

KINDS = ("compute", "host", "link")
MAD_TO_SIGMA = 1.4826  # a normal sample's standard deviation over its median absolute deviation


@dataclass(frozen=True)
class Finding:
    """One suspect over one batch's iterations (seconds, per iteration)."""

    kind: str  # compute | host | link
    key: int | tuple[int, int]  # a rank, or a link's (low, high) ranks
    iterations: np.ndarray
    actual: np.ndarray
    expected: np.ndarray
    blame: np.ndarray
    basis: str  # where the expected time came from
    # by each iteration's end: how much later the batch stood than with the
    # suspect at its expected time (the running sum of ``blame``), and how
    # long the batch had run
    delay: np.ndarray
    elapsed: np.ndarray
    each_way: np.ndarray  # links: the least slowdown of their directions (``Table``); ranks: NaN


Samples = Mapping[object, np.ndarray]  # suspect -> its excess per iteration, as noise samples


@dataclass(frozen=True)
class BatchBlame:
    iterations: np.ndarray
    duration: np.ndarray  # each iteration's recorded seconds (from the previous one's end)
    findings: tuple[Finding, ...]
    noise: Mapping[str, Samples] = field(default_factory=dict)  # kind -> suspect -> samples
    partners: Mapping[str, Mapping[object, object]] = field(default_factory=dict)
    bases: Mapping[str, Mapping[str, int]] = field(default_factory=dict)  # kind -> basis -> count
    critical: CriticalShare | None = None  # who held each iteration's critical path


def noise_samples(kind: str, table: Table) -> dict[object, np.ndarray]:
    """Each suspect's excess over the iterations it has an expectation in,
    relative to the expectation for compute and links (their noise scales
    with the work), in seconds for host time (OS noise adds time whatever
    the work)."""
    x, e = table.excess, table.expected
    ok = np.isfinite(x) & np.isfinite(e) & ((e > 0) | (kind == "host"))
    values = np.where(ok, x / np.where(e > 0, e, 1.0), np.nan) if kind != "host" else x
    return {key: values[i][ok[i]] for i, key in enumerate(table.keys) if ok[i].any()}


def sigma_of(samples: np.ndarray) -> float:
    if not len(samples):
        return float("nan")
    return MAD_TO_SIGMA * float(np.median(np.abs(samples - np.median(samples))))


def scale_of(kind: str, sigma: float, expected: np.ndarray) -> np.ndarray:
    """The noise, in seconds, of a suspect's quantity per iteration."""
    return sigma * expected if kind != "host" else np.full(expected.shape, sigma)


def _pooled(samples: Samples) -> np.ndarray:
    return np.concatenate(list(samples.values())) if samples else np.zeros(0)


def _shortlist(tables: Mapping[str, Table], noise: Mapping[str, Samples], size: int
               ) -> list[tuple[str, int]]:
    """The ``size`` suspects most over their expected time, in units of their kind's noise."""
    scored: list[tuple[float, str, int]] = []
    for kind, table in tables.items():
        sigma = sigma_of(_pooled(noise[kind]))
        with np.errstate(all="ignore"):
            z = table.excess / np.maximum(scale_of(kind, sigma, table.expected), 1e-12)
        best = np.nanmax(np.where(np.isfinite(z), z, -np.inf), axis=1) if z.size else np.zeros(0)
        scored += [(float(b), kind, i) for i, b in enumerate(best.tolist()) if b > 0]
    scored.sort(key=lambda t: -t[0])
    return [(kind, i) for _, kind, i in scored[:size]]


def _iteration_seconds(start: float, ends: np.ndarray) -> np.ndarray:
    """Each iteration's length: from the previous one's end (the batch's ``start`` for the first)."""
    return np.diff(np.r_[start, np.maximum.accumulate(ends)])


def blame_batch(scan: ScanInput, work: Work, shortlist: int) -> BatchBlame:
    """The blame of the suspects of one batch of whole iterations."""
    g = graph_of(scan.cols, scan.sync)
    if not len(g):
        return BatchBlame(np.zeros(0, np.int64), np.zeros(0), ())
    compute, host = rank_tables(g, scan.cols, work)
    tables = {"compute": compute, "host": host, "link": link_table(g, scan.cols,
                                                                   scan.gpus_per_node)}
    noise = {kind: noise_samples(kind, t) for kind, t in tables.items()}
    partners = {kind: {k: p for k, p in zip(t.keys, t.partner or ()) if p is not None}
                for kind, t in tables.items()}
    bases = {kind: dict(Counter(t.basis)) for kind, t in tables.items()}
    chosen = _shortlist(tables, noise, shortlist)
    replayer = Replayer.of(g)
    start = float(np.min(np.where(g.pred >= 0, g.start, g.anchor)))
    recorded = _iteration_seconds(start, replayer.recorded_ends())
    critical = critical_share(replayer)
    if not chosen:
        return BatchBlame(g.iterations, recorded, (), noise, partners, bases, critical)
    suspects = _suspects(g, tables, chosen)
    every = np.ones(len(chosen), np.bool_)
    fixed_all = _iteration_seconds(start, replayer.ends(suspects, every))
    findings = []
    elapsed = np.cumsum(recorded)
    for s, (kind, i) in enumerate(chosen):
        alone = every.copy()
        alone[s] = False
        left = _iteration_seconds(start, replayer.ends(suspects, alone))
        t = tables[kind]
        blame = left - fixed_all
        each_way = t.each_way[i] if t.each_way is not None else np.full(len(blame), np.nan)
        findings.append(Finding(kind, t.keys[i], g.iterations, t.actual[i], t.expected[i],
                                blame, t.basis[i], np.cumsum(blame), elapsed, each_way))
    return BatchBlame(g.iterations, recorded, tuple(findings), noise, partners, bases, critical)


def _suspects(g: Graph, tables: Mapping[str, Table], chosen: list[tuple[str, int]]) -> Suspects:
    """The shortlisted suspects, each fixed at its expected time: its ratio
    of expected to actual time (only time over expected is taken away)."""
    out = Suspects.none(g)
    ratio = np.ones((len(chosen), len(g.iterations)))
    for s, (kind, i) in enumerate(chosen):
        t = tables[kind]
        with np.errstate(all="ignore"):
            r = np.where(t.actual[i] > 0, t.expected[i] / t.actual[i], 1.0)
        ratio[s] = np.clip(np.nan_to_num(r, nan=1.0), 0.0, 1.0)
        if kind == "link":
            out.link[(g.links[:, 0] == t.keys[i][0]) & (g.links[:, 1] == t.keys[i][1])] = s
        else:
            getattr(out, kind)[t.keys[i]] = s
    return replace(out, ratio=ratio)
