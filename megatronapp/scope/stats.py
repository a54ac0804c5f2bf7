"""The closed registry of statistics: reductions on the device, exact merges.

Every statistic reduces the last dimension (channels) of a 2-D tensor
``(rows, channels)`` in three steps, so that a tensor split over
tensor-parallel ranks reduces to the same numbers as the whole tensor:

- ``partial`` (torch, on the tensor's device, float64): a fixed number of
  columns per row, computed from one rank's channel slice;
- ``combine`` (numpy, on the host): partials of the slices -> partials of
  the whole (sums add, extremes compare, moments merge with Chan/Pebay);
- ``finish`` (numpy): partials -> (indices, values) per row; a scalar
  statistic has one column with index 0, an indexed one (top-k, histogram,
  pixels) one column per channel / bucket / block.

NaN and Inf propagate as in numpy (the mean of a row holding NaN is NaN);
``nan_count`` and ``inf_count`` count them, ``hist`` and ``sparsity`` skip
NaN, ``topk`` ranks NaN above every number. Nothing here evaluates text: a
statistic is looked up by name in ``REGISTRY``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..scenario.scope_spec import HIST_BUCKETS, HIST_MAX_EXP, HIST_MIN_EXP, STATS, StatSpec


@dataclass(frozen=True)
class Slice:
    """Where one rank's channels sit in the whole, and each row's query token."""

    offset: int = 0  # first channel of this slice in the whole tensor
    full: int = 0  # channels of the whole tensor
    query_pos: torch.Tensor | None = None  # (rows,) attention: the row's query position
    cache: dict = field(default_factory=dict, compare=False, repr=False)  # |x|, shared by stats

    def abs(self, x: torch.Tensor) -> torch.Tensor:
        key = ("abs", x.dtype)
        if key not in self.cache:
            self.cache[key] = x.abs()
        return self.cache[key]


Partial = Callable[[torch.Tensor, Slice, float | None], torch.Tensor]
Combine = Callable[[np.ndarray], np.ndarray]  # (shards, rows, P) -> (rows, P)
Finish = Callable[[np.ndarray, float | None], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class Statistic:
    width: Callable[[int, float | None], int]  # (full channels, arg) -> partial columns
    partial: Partial
    combine: Combine
    finish: Finish
    native: bool = False  # exact in the tensor's own dtype (order statistics, counts)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums and moments: float64 for float64 tensors, float32 for the others
    (pairwise summation keeps them to float32 precision, at a third of the cost)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _col(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, 1)


def _scalar(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((len(values), 1), dtype=np.int64), values.reshape(-1, 1)


def _sum(parts: np.ndarray) -> np.ndarray:
    return parts.sum(axis=0)


def _min(parts: np.ndarray) -> np.ndarray:
    return np.minimum.reduce(parts, axis=0)  # propagates NaN like np.min


def _max(parts: np.ndarray) -> np.ndarray:
    return np.maximum.reduce(parts, axis=0)


# ------------------------------------------------------------------ moments
def _moments(order: int) -> Partial:
    """(n, mean, M2[, M3, M4]) of each row: two-pass, shifted by the row's first
    value so that a large offset does not cost float32 its precision."""
    def partial(x: torch.Tensor, _s: Slice, _a: float | None) -> torch.Tensor:
        n = torch.full((x.shape[0],), float(x.shape[1]), dtype=torch.float64, device=x.device)
        pivot = x[:, :1]
        y = x - pivot
        shift = y.mean(dim=1)
        d = y - shift[:, None]
        d2 = d * d
        cols = [pivot[:, 0].double() + shift.double(), d2.sum(1)]
        if order == 4:
            cols += [(d2 * d).sum(1), (d2 * d2).sum(1)]
        return torch.stack([n] + [c.double() for c in cols], dim=1)
    return partial


def merge_moments(parts: np.ndarray) -> np.ndarray:
    """Chan et al. / Pebay's pairwise update of (n, mean, M2[, M3, M4])."""
    acc = parts[0].copy()
    fourth = parts.shape[2] == 5
    for b in parts[1:]:
        na, ma, m2a = acc[:, 0], acc[:, 1], acc[:, 2]
        nb, mb, m2b = b[:, 0], b[:, 1], b[:, 2]
        n = na + nb
        d = mb - ma
        cols = [n, ma + d * nb / n, m2a + m2b + d * d * na * nb / n]
        if fourth:
            m3a, m4a, m3b, m4b = acc[:, 3], acc[:, 4], b[:, 3], b[:, 4]
            cols.append(m3a + m3b + d ** 3 * na * nb * (na - nb) / n ** 2
                        + 3 * d * (na * m2b - nb * m2a) / n)
            cols.append(m4a + m4b + d ** 4 * na * nb * (na * na - na * nb + nb * nb) / n ** 3
                        + 6 * d * d * (na * na * m2b + nb * nb * m2a) / n ** 2
                        + 4 * d * (na * m3b - nb * m3a) / n)
        acc = np.stack(cols, axis=1)
    return acc


def _std(p: np.ndarray, _a: float | None) -> tuple[np.ndarray, np.ndarray]:
    return _scalar(np.sqrt(p[:, 2] / p[:, 0]))


def _kurtosis(p: np.ndarray, _a: float | None) -> tuple[np.ndarray, np.ndarray]:
    """Excess kurtosis, population form: n·M4/M2² − 3 (NaN for a constant row)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return _scalar(p[:, 0] * p[:, 4] / (p[:, 2] * p[:, 2]) - 3.0)




# ------------------------------------------------------------- simple sums
def _n_sum(x: torch.Tensor, _s: Slice, _a: float | None) -> torch.Tensor:
    return torch.stack([torch.full((x.shape[0],), float(x.shape[1]), dtype=x.dtype,
                                   device=x.device), x.sum(1)], dim=1)


def _n_sumsq(x: torch.Tensor, _s: Slice, _a: float | None) -> torch.Tensor:
    return torch.stack([torch.full((x.shape[0],), float(x.shape[1]), dtype=x.dtype,
                                   device=x.device), (x * x).sum(1)], dim=1)


def _sparsity(x: torch.Tensor, _s: Slice, eps: float | None) -> torch.Tensor:
    """|x| <= eps, eps rounded to the tensor's dtype."""
    small = (_s.abs(x) <= (eps or 0.0)).sum(1, dtype=torch.float64)
    return torch.stack([small, torch.full_like(small, float(x.shape[1]))], dim=1)


def _ratio(p: np.ndarray, _a: float | None) -> tuple[np.ndarray, np.ndarray]:
    return _scalar(p[:, 0] / p[:, 1])


def _first(p: np.ndarray, _a: float | None) -> tuple[np.ndarray, np.ndarray]:
    return _scalar(p[:, 0])


def _mean(p: np.ndarray, _a: float | None) -> tuple[np.ndarray, np.ndarray]:
    return _scalar(p[:, 1] / p[:, 0])


def _rms(p: np.ndarray, _a: float | None) -> tuple[np.ndarray, np.ndarray]:
    return _scalar(np.sqrt(p[:, 1] / p[:, 0]))


def _l2(p: np.ndarray, _a: float | None) -> tuple[np.ndarray, np.ndarray]:
    return _scalar(np.sqrt(p[:, 1]))


# -------------------------------------------------------------------- top-k
def _topk_key(absx: torch.Tensor) -> torch.Tensor:
    """|x|, with NaN ranked as high as an infinity (an outlier par excellence)."""
    return torch.nan_to_num(absx, nan=float("inf"))


def _topk(x: torch.Tensor, s: Slice, k: float | None) -> torch.Tensor:
    """k keys, signed values and global channel numbers, float64 (padded with
    -inf / 0 / -1 where a slice has fewer than k channels)."""
    k = int(k or 1)
    take = min(k, x.shape[1])
    top_key, idx = torch.topk(_topk_key(s.abs(x)), take, dim=1)
    parts = [top_key.double(), torch.gather(x, 1, idx).double(), (idx + s.offset).double()]
    pad = k - take
    if pad:
        fills = (float("-inf"), 0.0, -1.0)
        parts = [torch.cat([p, p.new_full((x.shape[0], pad), f)], 1) for p, f in zip(parts, fills)]
    return torch.cat(parts, dim=1)


def _topk_combine(parts: np.ndarray) -> np.ndarray:
    """The k largest keys over all slices (ties: lower channel first)."""
    shards, rows, width = parts.shape
    k = width // 3
    keys = np.concatenate([parts[s, :, :k] for s in range(shards)], axis=1)
    vals = np.concatenate([parts[s, :, k:2 * k] for s in range(shards)], axis=1)
    chans = np.concatenate([parts[s, :, 2 * k:] for s in range(shards)], axis=1)
    order = np.lexsort((chans, -keys), axis=1)[:, :k] if keys.size else np.zeros((rows, 0), int)
    pick = np.take_along_axis
    return np.concatenate([pick(keys, order, 1), pick(vals, order, 1), pick(chans, order, 1)], 1)


def _topk_finish(p: np.ndarray, k: float | None) -> tuple[np.ndarray, np.ndarray]:
    k = int(k or 1)
    p = _topk_combine(p[None])  # order within one slice too
    return p[:, 2 * k:].astype(np.int64), p[:, k:2 * k]


# ---------------------------------------------------------------- histogram
def _hist(x: torch.Tensor, _s: Slice, _a: float | None) -> torch.Tensor:
    """Exact buckets from the binary exponent (frexp), in the tensor's dtype."""
    a = _s.abs(x)
    e = torch.frexp(a).exponent.to(torch.int64) - 1  # |x| in [2^e, 2^(e+1))
    bucket = torch.clamp(e - HIST_MIN_EXP + 1, 0, HIST_BUCKETS - 1)
    bucket = torch.where(a == 0, torch.zeros_like(bucket), bucket)
    bucket = torch.where(torch.isinf(a), torch.full_like(bucket, HIST_BUCKETS - 1), bucket)
    bucket = torch.where(torch.isnan(a), torch.full_like(bucket, HIST_BUCKETS), bucket)
    counts = torch.zeros((x.shape[0], HIST_BUCKETS + 1), dtype=torch.float64, device=x.device)
    counts.scatter_add_(1, bucket, torch.ones(bucket.shape, dtype=torch.float64, device=x.device))
    return counts[:, :HIST_BUCKETS]


def _indexed(p: np.ndarray, _a: float | None) -> tuple[np.ndarray, np.ndarray]:
    return np.broadcast_to(np.arange(p.shape[1]), p.shape).copy(), p


# ------------------------------------------------------------------- pixels
def _blocks(s: Slice, block: float | None) -> tuple[int, int, int]:
    b = int(block or 1)
    return b, s.offset // b, -(-s.full // b)


def _pixels_mean(x: torch.Tensor, s: Slice, block: float | None) -> torch.Tensor:
    """Per block of ``block`` channels: (sums..., counts...) over all blocks
    of the whole tensor (zero outside this slice)."""
    b, first, nblocks = _blocks(s, block)
    rows, c = x.shape
    local = -(-c // b)
    padded = torch.nn.functional.pad(x, (0, local * b - c))
    sums = padded.reshape(rows, local, b).sum(2)
    counts = torch.full((local,), float(b), dtype=x.dtype, device=x.device)
    if local * b != c:
        counts[-1] = c - (local - 1) * b
    out = x.new_zeros((rows, 2 * nblocks))
    out[:, first:first + local] = sums
    out[:, nblocks + first:nblocks + first + local] = counts
    return out


def _pixels_mean_finish(p: np.ndarray, _a: float | None) -> tuple[np.ndarray, np.ndarray]:
    n = p.shape[1] // 2
    return _indexed(p[:, :n] / p[:, n:], None)


def _pixels_absmax(x: torch.Tensor, s: Slice, block: float | None) -> torch.Tensor:
    b, first, nblocks = _blocks(s, block)
    rows, c = x.shape
    local = -(-c // b)
    padded = torch.nn.functional.pad(s.abs(x), (0, local * b - c))  # |x| >= 0: padding is neutral
    out = x.new_zeros((rows, nblocks))
    out[:, first:first + local] = padded.reshape(rows, local, b).amax(2)
    return out


# --------------------------------------------------------------- attention
def _entropy(p: torch.Tensor, _s: Slice, _a: float | None) -> torch.Tensor:
    return _col(0.0 - torch.special.xlogy(p, p).sum(1))  # 0.0 - x: no -0.0


def _at_offset(p: torch.Tensor, s: Slice, back: int | None) -> torch.Tensor:
    """p[row, q - back] (``back`` None: key 0); NaN where that key does not exist."""
    assert s.query_pos is not None, "attention statistics need the query positions"
    q = s.query_pos.to(p.device)
    key = torch.zeros_like(q) if back is None else q - back
    ok = key >= 0
    got = torch.gather(p, 1, key.clamp(min=0)[:, None])[:, 0]
    return _col(torch.where(ok, got, torch.full_like(got, float("nan"))))


def _count(test: Callable[[torch.Tensor], torch.Tensor]) -> Partial:
    return lambda x, s, a: _col(test(x).sum(1, dtype=torch.float64))


def _one(_c: int, _a: float | None) -> int:
    return 1


REGISTRY: dict[str, Statistic] = {
    "min": Statistic(_one, lambda x, s, a: _col(x.amin(1)), _min, _first, native=True),
    "max": Statistic(_one, lambda x, s, a: _col(x.amax(1)), _max, _first, native=True),
    "absmax": Statistic(_one, lambda x, s, a: _col(s.abs(x).amax(1)), _max, _first, native=True),
    "mean": Statistic(lambda _c, _a: 2, _n_sum, _sum, _mean),
    "std": Statistic(lambda _c, _a: 3, _moments(2), merge_moments, _std),
    "rms": Statistic(lambda _c, _a: 2, _n_sumsq, _sum, _rms),
    "l2": Statistic(lambda _c, _a: 2, _n_sumsq, _sum, _l2),
    "sparsity": Statistic(lambda _c, _a: 2, _sparsity, _sum, _ratio, native=True),
    "nan_count": Statistic(_one, _count(torch.isnan), _sum, _first, native=True),
    "inf_count": Statistic(_one, _count(torch.isinf), _sum, _first, native=True),
    "kurtosis": Statistic(lambda _c, _a: 5, _moments(4), merge_moments, _kurtosis),
    "topk": Statistic(lambda _c, k: 3 * int(k or 1), _topk, _topk_combine, _topk_finish,
                      native=True),
    "hist": Statistic(lambda _c, _a: HIST_BUCKETS, _hist, _sum, _indexed, native=True),
    "pixels_mean": Statistic(lambda c, b: 2 * -(-c // int(b or 1)), _pixels_mean, _sum,
                             _pixels_mean_finish),
    "pixels_absmax": Statistic(lambda c, b: -(-c // int(b or 1)), _pixels_absmax, _max, _indexed,
                               native=True),
    "entropy": Statistic(_one, _entropy, _sum, _first),
    "prev_token_mass": Statistic(_one, lambda p, s, a: _at_offset(p, s, 1), _sum, _first,
                                 native=True),
    "sink_mass": Statistic(_one, lambda p, s, a: _at_offset(p, s, None), _sum, _first,
                           native=True),
}
if set(REGISTRY) != set(STATS):  # the schema's names and the implementations are one list
    raise RuntimeError(f"statistics registry mismatch: {sorted(set(REGISTRY) ^ set(STATS))}")


def partials(x: torch.Tensor, specs: tuple[StatSpec, ...], s: Slice) -> torch.Tensor:
    """All statistics' partial columns of ``x`` (rows, channels), side by side,
    float64. Order statistics and counts run in the tensor's own dtype (they
    are exact there); sums and moments on one copy in ``accumulation_dtype``."""
    x = x.detach()
    wide: torch.Tensor | None = None
    cols = []
    for sp in specs:
        stat = REGISTRY[sp.name]
        if stat.native:
            part = stat.partial(x, s, sp.arg)
        else:
            wide = x.to(accumulation_dtype(x.dtype)) if wide is None else wide
            part = stat.partial(wide, s, sp.arg)
        cols.append(part.to(torch.float64))
    return torch.cat(cols, dim=1)


def widths(specs: tuple[StatSpec, ...], full_channels: int) -> list[int]:
    return [REGISTRY[sp.name].width(full_channels, sp.arg) for sp in specs]


def combine(spec: StatSpec, parts: np.ndarray) -> np.ndarray:
    """(shards, rows, P) partials of the slices, in channel order -> (rows, P)."""
    if len(parts) == 1:
        return parts[0]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # NaN/Inf propagate
        return REGISTRY[spec.name].combine(parts)


def finish(spec: StatSpec, part: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, P) partials -> (indices, values), each (rows, W)."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        return REGISTRY[spec.name].finish(part, spec.arg)
