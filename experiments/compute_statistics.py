"""Which per-rank compute statistic tells a slowed rank from the machine's
own stragglers on recorded runs. Prints a table; writes nothing.

Per run, per rank that has peers (``scan.evidence.expected``: ranks that
communicate alike), per iteration, four readings of how far the rank's
compute ran over what its peers say it should take:

- ``totals``: its compute seconds over the faster half of its class's
  (MegaScan's reading);
- ``per-op``: each op name's seconds over its class's, averaged with weights
  1 / that op's squared spread over the other ranks (the least-squares
  estimate of one slowdown shared by all ops);
- ``fastest call``: its calls of each op at its own fastest call, over its
  class's calls at theirs (the time each call takes with the device to itself);
- ``per call``: its seconds over its own calls at its class's time per call
  (a rate: extra calls of the same size are no excess).

Each rank's score is its weakest iteration's reading over the spread of the
other ranks' readings (as MegaScan's noise: how a rank moves between
iterations, and how far ranks sit apart). The bar is the 97th percentile of
the eligible healthy runs' highest score; a faulted run counts when a
slowed rank scores highest and past the bar.

    python -m experiments.compute_statistics SET [SET ...]
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:
    from megatronapp.scan.align.inputs import ScanInput

TIMER_S = 1e-6  # traces are written in microseconds
HEALTHY_QUANTILE = 0.97  # false alarms on at most 3% of healthy runs (issue 41's bar)


class OpTimes:
    """Compute seconds, calls and fastest call per (rank, op name, iteration),
    and each rank's peers (rows)."""

    def __init__(self, ranks: np.ndarray, seconds: np.ndarray, calls: np.ndarray,
                 fastest: np.ndarray, peers: list[np.ndarray]):
        self.ranks, self.seconds, self.calls, self.fastest = ranks, seconds, calls, fastest
        self.peers = peers

    @classmethod
    def of(cls, scan: "ScanInput") -> "OpTimes":
        from megatronapp.scan.evidence.expected import communication, peer_sets
        from megatronapp.scan.evidence.graph import COMPUTE, graph_of
        from megatronapp.trace.metrics import distinct_ints

        g = graph_of(scan.cols, scan.sync)
        ranks, _ = distinct_ints(g.rank)
        ops = np.flatnonzero(g.how == COMPUTE)
        names, name = distinct_ints(scan.cols.name[g.row[ops]].astype(np.int64))
        shape = (len(ranks), len(names), len(g.iterations))
        cell = np.ravel_multi_index((np.searchsorted(ranks, g.rank[ops]), name,
                                     g.iteration[ops]), shape)
        size = int(np.prod(shape))
        fastest = np.full(size, np.inf)
        np.minimum.at(fastest, cell, g.dur[ops])
        return cls(ranks, np.bincount(cell, g.dur[ops], size).reshape(shape),
                   np.bincount(cell, None, size).reshape(shape), fastest.reshape(shape),
                   peer_sets(communication(g, scan.cols, ranks)))

    def judged(self) -> list[int]:
        return [i for i, p in enumerate(self.peers) if len(p)]

    def members(self, i: int) -> np.ndarray:
        """The rows a rank's expectation is read from (its one peer, or its class with it)."""
        p = self.peers[i]
        return p if len(p) == 1 else np.r_[p, i]


def faster_half(values: np.ndarray) -> np.ndarray:
    from megatronapp.scan.evidence.expected import faster_half as half

    return half(values)


def _sigma(values: np.ndarray) -> float:
    """MegaScan's robust spread (``blame.sigma_of``) of the finite values."""
    from megatronapp.scan.evidence.blame import sigma_of

    return sigma_of(values[np.isfinite(values)])


def totals(t: OpTimes, i: int) -> np.ndarray:
    total = t.seconds.sum(axis=1)
    return total[i] / faster_half(total[t.members(i)]) - 1.0


def _relative_by_op(t: OpTimes, i: int) -> np.ndarray:
    with np.errstate(all="ignore"):
        return t.seconds[i] / faster_half(t.seconds[t.members(i)]) - 1.0


def per_op(t: OpTimes, i: int) -> np.ndarray:
    others = [j for j in t.judged() if j != i]
    if not others:
        return np.full(t.seconds.shape[2], np.nan)
    spread = np.stack([_relative_by_op(t, j) for j in others])  # rank, op, iteration
    # no op is steadier than the timer's resolution makes it
    floor = TIMER_S / np.maximum(np.median(t.seconds, axis=(0, 2)), TIMER_S)
    weight = np.array([1.0 / float(np.fmax(_sigma(spread[:, n].ravel()), floor[n])) ** 2
                       for n in range(t.seconds.shape[1])])
    mine = _relative_by_op(t, i)
    weight = np.where(np.isfinite(mine).all(axis=1), weight, 0.0)
    if not weight.any():
        return np.full(t.seconds.shape[2], np.nan)
    return (np.nan_to_num(mine) * weight[:, None]).sum(axis=0) / weight.sum()


def fastest_call(t: OpTimes, i: int) -> np.ndarray:
    cls = t.members(i)
    with np.errstate(all="ignore"):
        theirs = np.where(t.calls[cls] > 0, t.calls[cls] * t.fastest[cls], 0.0).sum(axis=1)
        own = np.where(t.calls[i] > 0, t.calls[i] * t.fastest[i], 0.0).sum(axis=0)
    return own / faster_half(theirs) - 1.0


def per_call(t: OpTimes, i: int) -> np.ndarray:
    cls = t.members(i)
    with np.errstate(all="ignore"):
        rate = np.where(t.calls[cls] > 0, t.seconds[cls] / t.calls[cls], np.nan)
    # the class's time per call of each op, over the members that called it
    typical = np.array([[faster_half(col[np.isfinite(col)][:, None])[0]
                         if np.isfinite(col).any() else np.nan for col in rate[:, n].T]
                        for n in range(rate.shape[1])])
    expected = np.nansum(t.calls[i] * typical, axis=0)
    return t.seconds[i].sum(axis=0) / expected - 1.0


STATISTICS: dict[str, Callable[[OpTimes, int], np.ndarray]] = {
    "totals": totals, "per-op": per_op, "fastest call": fastest_call, "per call": per_call}


def scores(readings: dict[int, np.ndarray]) -> dict[int, float]:
    """Each rank's weakest iteration over the spread of the others' readings."""
    from megatronapp.scan.evidence.detect import QUARTILE_Z

    out = {}
    for i, mine in readings.items():
        others = [r for j, r in readings.items() if j != i and np.isfinite(r).any()]
        if not others or not np.isfinite(mine).any():
            continue
        o = np.stack(others)
        moves = _sigma((o - np.nanmedian(o, axis=1, keepdims=True)).ravel())
        medians = np.nanmedian(o, axis=1)
        apart = (np.median(medians) - np.percentile(medians, 25)) / QUARTILE_Z  # as NoiseModel
        noise = float(np.hypot(moves, apart))
        if noise > 0:
            out[i] = float(np.nanmin(mine)) / noise
    return out


def run_scores(t: OpTimes) -> dict[str, dict[int, float]]:
    """Per statistic, each judged rank's score (keys: rows of ``t``)."""
    return {name: scores({i: f(t, i) for i in t.judged()}) for name, f in STATISTICS.items()}


def table(rows: list[tuple[str, bool, set[int], dict[str, dict[int, float]]]]) -> list[str]:
    """Per statistic: the healthy bar and, per fault label, how many runs'
    slowed rank scores highest and past it."""
    out = []
    labels = sorted({label for label, healthy, _, _ in rows if not healthy})
    out.append("| statistic | bar | " + " | ".join(labels) + " |")
    out.append("|---|---:|" + "---:|" * len(labels))
    for name in STATISTICS:
        top = [max(s[name].values(), default=float("-inf")) for _, h, _, s in rows if h]
        bar = float(np.quantile(top, HEALTHY_QUANTILE)) if top else float("nan")
        hit: Counter[str] = Counter()
        seen: Counter[str] = Counter()
        for label, healthy, slowed, s in rows:
            if healthy:
                continue
            seen[label] += 1
            by_rank = s[name]
            if by_rank and max(by_rank, key=by_rank.__getitem__) in slowed and \
                    max(by_rank.values()) > bar:
                hit[label] += 1
        out.append(f"| {name} | {bar:.2f} | "
                   + " | ".join(f"{hit[k]}/{seen[k]}" for k in labels) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.compute_statistics",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("sets", type=Path, nargs="+", help="recorded sets (tests/data/heldoutN)")
    args = parser.parse_args(argv)
    from megatronapp.errors import UserError
    from megatronapp.scan.eval import sets

    try:
        runs = [run for folder in args.sets for run in sets.recorded(folder, "tuning-zoo")]
    except (UserError, ValueError) as err:
        print(f"compute_statistics: {err}", file=sys.stderr)
        return 2
    rows = []
    for k, run in enumerate(runs):
        if not run.eligible or run.category == "link":
            continue
        times = OpTimes.of(run.load())
        slowed = {int(np.searchsorted(times.ranks, r)) for kind, r, _ in run.truth
                  if kind == "rank"}
        rows.append((run.label, run.healthy, slowed, run_scores(times)))
        print(f"[{k + 1}/{len(runs)}] {run.name}", file=sys.stderr, flush=True)
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
