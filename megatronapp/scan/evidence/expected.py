"""Everything about a suspect's expected time lives here: what each rank
computed and idled per iteration, what each link spent transferring, and
what each should have taken.

A rank's expected compute and host time come from its **peers**, ranks doing
the same work: ranks that communicate alike (the same collectives, on groups
of the same size; the same transfers, up or down the ranks), and, where the
scenario's cost model prices them, model the same work. A slow device,
extra calls or a stalled host change how long a rank computes, never how it
communicates. A rank's expected compute (or host time) in an iteration is
what the faster half of its class took there (the median of that half: up
to half the class may be slow without moving it; extra calls are excess,
as its peers do not make them). Without peers, a
rank's compute is expected from the scenario's cost model at the job's
speed (where a run has one), else from its own other iterations. A link's expected transfer time comes from the other links of
its class (the same direction, within or across nodes), per byte where the
trace records bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from megatronapp.trace.columns import EventColumns
from megatronapp.trace.metrics import distinct_ints, sums_at

from .graph import COMPUTE, Graph

Work = Mapping[int, Mapping[str, float]]  # rank -> compute op name -> modelled seconds per call


@dataclass(frozen=True)
class Table:
    """A quantity per suspect (rows) and iteration (columns): actual and
    expected seconds (NaN where unknown), and how the expectation was found."""

    keys: list  # the suspects: ranks, or (low, high) rank pairs
    actual: np.ndarray
    expected: np.ndarray
    basis: list[str]  # per suspect: peers | model | own iterations | none
    # per suspect, the one other suspect its expectation came from, when only
    # one did (a pair of peers): the two share their noise, so neither's
    # spread may judge the other
    partner: list[object | None] | None = None
    # links: per iteration, the smallest slowdown over the directions the link
    # carried traffic in with an expectation (a degraded link is slow each
    # way; one whose receiver waits on a slow stage, only the way it waits)
    each_way: np.ndarray | None = None

    @property
    def excess(self) -> np.ndarray:
        return self.actual - self.expected


# ------------------------------------------------------------ per rank
def per_rank_iteration(g: Graph, ranks: np.ndarray, values: np.ndarray,
                       mask: np.ndarray | None = None) -> np.ndarray:
    """Sum of ``values`` per (rank, iteration) over the ops in ``mask``."""
    keep = np.ones(len(g), bool) if mask is None else mask
    r = np.searchsorted(ranks, g.rank[keep])
    return sums_at((len(ranks), len(g.iterations)), r, g.iteration[keep],
                   np.asarray(values[keep], float))


def communication(g: Graph, cols: EventColumns, ranks: np.ndarray) -> np.ndarray:
    """Per rank, how many times it took part in each kind of communication: a
    collective by name and group size, a transfer by name and whether its
    partner is a higher or a lower rank (where every transfer's partner is
    known). Ranks doing the same work in a job communicate alike, whatever
    slows them."""
    comm = np.flatnonzero(g.how != COMPUTE)
    rows = g.row[comm]
    size = np.array([len(g) for g in cols.groups] + [0], np.int64)[cols.group[rows]]  # -1: none
    ends = np.array([(s, r) for s, r, _ in g.flows] + [(-1, -1)], np.int64)  # flow -1: none
    sender, receiver = ends[g.flow[comm]].T
    partner = np.where(g.rank[comm] == sender, receiver, sender)
    transfer = np.isin(rows, g.row[g.flow >= 0]) | (cols.peer[rows] >= 0) | (size == 0)
    # a side is known only where every transfer was matched: counts that mix
    # known and unknown sides would tell alike ranks apart
    known = bool(np.all(partner[transfer & (size == 0)] >= 0))
    side = np.where(partner < 0, 0, np.where(partner > g.rank[comm], 1, 2)) if known else \
        np.zeros(len(comm), np.int64)
    # one integer per (name, group size, side): only which ops are alike matters
    key = (cols.name[rows].astype(np.int64) * (size.max(initial=0) + 1) + size) * 3 + side
    keys, col = distinct_ints(key)
    return sums_at((len(ranks), len(keys)), np.searchsorted(ranks, g.rank[comm]), col)


def op_counts(g: Graph, cols: EventColumns, ranks: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Per rank, how many times it ran each compute op name in the batch."""
    compute = g.how == COMPUTE
    codes = cols.name[g.row[compute]].astype(np.int64)
    names, col = distinct_ints(codes)
    counts = sums_at((len(ranks), len(names)), np.searchsorted(ranks, g.rank[compute]), col)
    return counts, [cols.names[int(c)] for c in names]


def modelled(g: Graph, cols: EventColumns, ranks: np.ndarray, work: Work) -> np.ndarray | None:
    """Per (rank, iteration), the modelled seconds of its compute; None when
    the cost model does not price every rank."""
    if not work or any(int(r) not in work for r in ranks):
        return None
    compute = np.flatnonzero(g.how == COMPUTE)
    compute = compute[np.argsort(g.rank[compute], kind="stable")]  # each rank's ops a slice
    by_rank = g.rank[compute]
    cost = np.zeros(len(g))
    for rank, by_name in work.items():
        lo, hi = np.searchsorted(by_rank, [rank, rank + 1])
        mine = compute[lo:hi]
        names = cols.name[g.row[mine]]
        for name, seconds in by_name.items():
            cost[mine[names == cols.name_code(name)]] = seconds
    if not np.all(cost[compute] > 0):
        return None
    return per_rank_iteration(g, ranks, cost, g.how == COMPUTE)


def peer_sets(signature: np.ndarray, profile: np.ndarray | None = None) -> list[np.ndarray]:
    """Per rank (row of ``signature``), the rows of its peers (itself left
    out): the ranks with the same signature (and ``profile`` row, where given)."""
    n = len(signature)
    key = signature if profile is None else np.hstack([signature, np.round(profile, 12)])
    _, cls = np.unique(key, axis=0, return_inverse=True)
    cls = cls.reshape(-1)
    return [np.flatnonzero((cls == cls[i]) & (np.arange(n) != i)) for i in range(n)]


def faster_half(values: np.ndarray) -> np.ndarray:
    """Per column, the median of the faster (smaller) half of the rows: what a
    class says its members should take. Faults are rare, speed-ups are not
    faults: up to half the class may be slow without moving it."""
    if not len(values):
        return np.full(values.shape[1:], np.nan)
    ordered = np.sort(values, axis=0)
    half = (len(values) + 1) // 2
    return np.median(ordered[:half], axis=0)


def _peer_median(values: np.ndarray, i: int, peers: np.ndarray) -> np.ndarray:
    """What ``i``'s peers say it should take: the faster half of the class
    with it, or its one peer's value."""
    return faster_half(values[peers if len(peers) == 1 else np.r_[peers, i]])


# A suspect compared with itself needs this many iterations: the median of
# fewer says nothing about which of them was slow.
MIN_OWN_ITERATIONS = 3


def _expected_row(values: np.ndarray, i: int, peers: np.ndarray,
                  modelled_row: np.ndarray | None = None) -> tuple[np.ndarray, str]:
    """Row ``i``'s expected values and what they come from: its peers, else the
    cost model (``modelled_row``), else its own iterations, else nothing."""
    if len(peers):
        return _peer_median(values, i, peers), "peers"
    if modelled_row is not None:
        return modelled_row, "model"
    if values.shape[1] >= MIN_OWN_ITERATIONS:
        return np.full(values.shape[1], np.median(values[i])), "own iterations"
    return np.full(values.shape[1], np.nan), "none"


def rank_tables(g: Graph, cols: EventColumns, work: Work) -> tuple[Table, Table]:
    """Compute and host time per rank and iteration, each with its expectation."""
    ranks, _ = distinct_ints(g.rank)
    compute = per_rank_iteration(g, ranks, g.dur, g.how == COMPUTE)
    host = per_rank_iteration(g, ranks, np.maximum(g.gap, 0.0))
    counts, _ = op_counts(g, cols, ranks)
    model = modelled(g, cols, ranks, work)
    profile = None if model is None else model / np.maximum(counts.sum(axis=1), 1)[:, None]
    exact = peer_sets(communication(g, cols, ranks), profile)
    keys = ranks.tolist()
    # the model's expectation at the ranks' median speed (seconds per modelled second)
    at_speed = (None if model is None or len(ranks) < 2
                else model * np.median(compute / model, axis=0))
    tables = []
    for values, by_model in ((compute, at_speed), (host, None)):
        rows = [_expected_row(values, i, chosen, None if by_model is None else by_model[i])
                for i, chosen in enumerate(exact)]
        expected = (np.stack([r[0] for r in rows]) if rows
                    else np.full(values.shape, np.nan))
        partner: list[object | None] = [keys[int(c[0])] if len(c) == 1 else None
                                        for c in exact]
        tables.append(Table(keys, values, expected, [r[1] for r in rows], partner))
    return tables[0], tables[1]


# ------------------------------------------------------------ per link
def link_class(g: Graph, flow: int, gpus_per_node: int) -> tuple[str, bool]:
    sender, receiver, direction = g.flows[flow]
    return direction, sender // gpus_per_node == receiver // gpus_per_node


def link_table(g: Graph, cols: EventColumns, gpus_per_node: int) -> Table:
    """Transfer time (the receives' residuals) per link and iteration, each
    expected from the other links of its flows' classes."""
    recv = np.flatnonzero((g.flow >= 0) & np.isin(g.row, _receive_rows(cols, g)))
    n_flows, n_iter = len(g.flows), len(g.iterations)
    at = ((n_flows, n_iter), g.flow[recv], g.iteration[recv])
    seconds = sums_at(*at, g.residual[recv])
    count = sums_at(*at).astype(float)
    nbytes = sums_at(*at, np.maximum(cols.nbytes[g.row[recv]], 0).astype(float))
    per_byte = bool(np.all(nbytes[count > 0] > 0))
    unit = np.where(count > 0, seconds / np.maximum(nbytes if per_byte else count, 1e-300), np.nan)
    size = nbytes if per_byte else count
    classes: dict[tuple[str, bool], list[int]] = {}
    for f in range(n_flows):
        classes.setdefault(link_class(g, f, gpus_per_node), []).append(f)
    expected = np.full((n_flows, n_iter), np.nan)
    for members in classes.values():
        if len(members) < 2:
            continue
        centre = _faster_half_ignoring_nan(unit[members])
        for f in members:
            expected[f] = centre * size[f]
    pair_of_flow = np.array([_pair_id(g, f) for f in range(n_flows)], np.int64)
    n_pairs = len(g.links)
    actual = np.zeros((n_pairs, n_iter))
    exp = np.zeros((n_pairs, n_iter))
    known = np.zeros((n_pairs, n_iter), bool)
    np.add.at(actual, pair_of_flow, seconds)
    np.add.at(exp, pair_of_flow, np.nan_to_num(expected))
    np.logical_or.at(known, pair_of_flow, np.isfinite(expected) & (count > 0))
    exp[~known] = np.nan
    keys = [tuple(p) for p in g.links.tolist()]
    basis = ["links of its class" if known[i].any() else "none" for i in range(n_pairs)]
    return Table(keys, actual, exp, basis, _pair_partners(classes, pair_of_flow, keys),
                 _each_way(seconds, expected, count, pair_of_flow, n_pairs))


def _each_way(seconds: np.ndarray, expected: np.ndarray, count: np.ndarray,
              pair_of_flow: np.ndarray, n_pairs: int) -> np.ndarray:
    """Per link and iteration, the least slowdown of its flows (its directions)
    that carried traffic and have an expectation; NaN where none did."""
    with np.errstate(all="ignore"):
        slowdown = np.where((count > 0) & (expected > 0), seconds / expected - 1.0, np.inf)
    least = np.full((n_pairs, slowdown.shape[1]), np.inf)
    np.minimum.at(least, pair_of_flow, slowdown)
    least[np.isinf(least)] = np.nan
    return least


def _pair_partners(classes: Mapping[tuple[str, bool], list[int]], pair_of_flow: np.ndarray,
                   keys: list) -> list[object | None]:
    """Per link, the one other link its expectation came from: where every
    class of its flows has two flows, the other's link (the faster of two
    is its own expectation, the slower's is the faster's: they mirror)."""
    others: dict[int, set[int]] = {}
    in_larger: set[int] = set()  # links with a flow in a class of other than two
    for members in classes.values():
        pairs = [int(pair_of_flow[f]) for f in members]
        for mine in pairs:
            if len(pairs) == 2:
                others.setdefault(mine, set()).update(p for p in pairs if p != mine)
            else:
                in_larger.add(mine)
    return [keys[next(iter(o))] if len(o := others.get(i, set())) == 1 and i not in in_larger
            else None for i in range(len(keys))]


def _faster_half_ignoring_nan(values: np.ndarray) -> np.ndarray:
    """``faster_half`` per column over the rows that have a value there."""
    return np.array([faster_half(col[np.isfinite(col)][:, None])[0] if np.isfinite(col).any()
                     else np.nan for col in values.T])


def _pair_id(g: Graph, flow: int) -> int:
    sender, receiver, _ = g.flows[flow]
    lo, hi = min(sender, receiver), max(sender, receiver)
    return int(np.flatnonzero((g.links[:, 0] == lo) & (g.links[:, 1] == hi))[0])


def _receive_rows(cols: EventColumns, g: Graph) -> np.ndarray:
    """Rows of receives among the transfer ops (role recorded, else named)."""
    rows = g.row[g.flow >= 0]
    role = cols.role[rows]
    named = np.array(["recv" in name.lower() for name in cols.names] + [False])[cols.name[rows]]
    return rows[np.where(role >= 0, role == 1, named)]
