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

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..scope_spec import HIST_BUCKETS, HIST_MAX_EXP, HIST_MIN_EXP, STATS, StatSpec


@dataclass(frozen=True)
class Slice:
    """Where one rank's channels sit in the whole, and each row's query token."""

    offset: int = 0  # first channel of this slice in the whole tensor
    full: int = 0  # channels of the whole tensor
    query_pos: torch.Tensor | None = None  # (rows,) attention: the row's query position


Partial = Callable[[torch.Tensor, Slice, float | None], torch.Tensor]
Combine = Callable[[np.ndarray], np.ndarray]  # (shards, rows, P) -> (rows, P)
Finish = Callable[[np.ndarray, float | None], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class Statistic:
    width: Callable[[int, float | None], int]  # (full channels, arg) -> partial columns
    partial: Partial
    combine: Combine
    finish: Finish


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
def _moments(x: torch.Tensor, _s: Slice, _a: float | None) -> torch.Tensor:
    """(n, mean, M2, M3, M4) of each row, two-pass."""
    n = torch.full((x.shape[0],), float(x.shape[1]), dtype=x.dtype, device=x.device)
    mean = x.mean(dim=1)
    d = x - mean[:, None]
    d2 = d * d
    return torch.stack([n, mean, d2.sum(1), (d2 * d).sum(1), (d2 * d2).sum(1)], dim=1)


def merge_moments(parts: np.ndarray) -> np.ndarray:
    """Chan et al. / Pebay's pairwise update of (n, mean, M2, M3, M4)."""
    acc = parts[0].copy()
    for b in parts[1:]:
        na, ma, m2a, m3a, m4a = (acc[:, i] for i in range(5))
        nb, mb, m2b, m3b, m4b = (b[:, i] for i in range(5))
        n = na + nb
        d = mb - ma
        mean = ma + d * nb / n
        m2 = m2a + m2b + d * d * na * nb / n
        m3 = (m3a + m3b + d ** 3 * na * nb * (na - nb) / n ** 2
              + 3 * d * (na * m2b - nb * m2a) / n)
        m4 = (m4a + m4b + d ** 4 * na * nb * (na * na - na * nb + nb * nb) / n ** 3
              + 6 * d * d * (na * na * m2b + nb * nb * m2a) / n ** 2
              + 4 * d * (na * m3b - nb * m3a) / n)
        acc = np.stack([n, mean, m2, m3, m4], axis=1)
    return acc


def _std(p: np.ndarray, _a: float | None) -> tuple[np.ndarray, np.ndarray]:
    return _scalar(np.sqrt(p[:, 2] / p[:, 0]))


def _kurtosis(p: np.ndarray, _a: float | None) -> tuple[np.ndarray, np.ndarray]:
    """Excess kurtosis, population form: n·M4/M2² − 3 (NaN for a constant row)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return _scalar(p[:, 0] * p[:, 4] / (p[:, 2] * p[:, 2]) - 3.0)


MOMENTS = dict(width=lambda _c, _a: 5, partial=_moments, combine=merge_moments)


# ------------------------------------------------------------- simple sums
def _n_sum(x: torch.Tensor, _s: Slice, _a: float | None) -> torch.Tensor:
    return torch.stack([torch.full((x.shape[0],), float(x.shape[1]), dtype=x.dtype,
                                   device=x.device), x.sum(1)], dim=1)


def _n_sumsq(x: torch.Tensor, _s: Slice, _a: float | None) -> torch.Tensor:
    return torch.stack([torch.full((x.shape[0],), float(x.shape[1]), dtype=x.dtype,
                                   device=x.device), (x * x).sum(1)], dim=1)


def _sparsity(x: torch.Tensor, _s: Slice, eps: float | None) -> torch.Tensor:
    small = (x.abs() <= (eps or 0.0)).sum(1, dtype=x.dtype)
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
def _topk_key(x: torch.Tensor) -> torch.Tensor:
    """|x|, with NaN ranked as high as an infinity (an outlier par excellence)."""
    return torch.nan_to_num(x.abs(), nan=float("inf"))


def _topk(x: torch.Tensor, s: Slice, k: float | None) -> torch.Tensor:
    """k keys, signed values and global channel numbers (padded with -inf / -1)."""
    k = int(k or 1)
    take = min(k, x.shape[1])
    key = _topk_key(x)
    top_key, idx = torch.topk(key, take, dim=1)
    vals = torch.gather(x, 1, idx)
    chan = (idx + s.offset).to(x.dtype)
    pad = k - take
    if pad:
        rows = x.shape[0]
        top_key = torch.cat([top_key, x.new_full((rows, pad), float("-inf"))], 1)
        vals = torch.cat([vals, x.new_zeros((rows, pad))], 1)
        chan = torch.cat([chan, x.new_full((rows, pad), -1.0)], 1)
    return torch.cat([top_key, vals, chan], dim=1)


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
def hist_bucket(absx: np.ndarray) -> np.ndarray:
    """Bucket of |x| (NaN excluded by the caller): 0 below 2^min (zero
    included), 1 + (e - min) for [2^e, 2^(e+1)), the last at or above 2^max."""
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(absx))
    return np.clip(e - HIST_MIN_EXP + 1, 0, HIST_BUCKETS - 1).astype(np.int64)


def _hist(x: torch.Tensor, _s: Slice, _a: float | None) -> torch.Tensor:
    finite_or_inf = ~torch.isnan(x)
    e = torch.floor(torch.log2(x.abs()))  # -inf for zero, +inf for inf
    bucket = torch.clamp(e - HIST_MIN_EXP + 1, 0, HIST_BUCKETS - 1)
    bucket = torch.where(finite_or_inf, bucket, torch.full_like(bucket, HIST_BUCKETS)).long()
    counts = torch.zeros((x.shape[0], HIST_BUCKETS + 1), dtype=x.dtype, device=x.device)
    counts.scatter_add_(1, bucket, torch.ones_like(x))
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
    padded = torch.nn.functional.pad(x.abs(), (0, local * b - c))  # |x| >= 0: padding is neutral
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


REGISTRY: dict[str, Statistic] = {
    "min": Statistic(lambda _c, _a: 1, lambda x, s, a: _col(x.amin(1)), _min, _first),
    "max": Statistic(lambda _c, _a: 1, lambda x, s, a: _col(x.amax(1)), _max, _first),
    "absmax": Statistic(lambda _c, _a: 1, lambda x, s, a: _col(x.abs().amax(1)), _max, _first),
    "mean": Statistic(lambda _c, _a: 2, _n_sum, _sum, _mean),
    "std": Statistic(finish=_std, **MOMENTS),  # type: ignore[arg-type]
    "rms": Statistic(lambda _c, _a: 2, _n_sumsq, _sum, _rms),
    "l2": Statistic(lambda _c, _a: 2, _n_sumsq, _sum, _l2),
    "sparsity": Statistic(lambda _c, _a: 2, _sparsity, _sum, _ratio),
    "nan_count": Statistic(lambda _c, _a: 1, lambda x, s, a: _col(torch.isnan(x).sum(1, dtype=x.dtype)),
                           _sum, _first),
    "inf_count": Statistic(lambda _c, _a: 1, lambda x, s, a: _col(torch.isinf(x).sum(1, dtype=x.dtype)),
                           _sum, _first),
    "kurtosis": Statistic(finish=_kurtosis, **MOMENTS),  # type: ignore[arg-type]
    "topk": Statistic(lambda _c, k: 3 * int(k or 1), _topk, _topk_combine, _topk_finish),
    "hist": Statistic(lambda _c, _a: HIST_BUCKETS, _hist, _sum, _indexed),
    "pixels_mean": Statistic(lambda c, b: 2 * -(-c // int(b or 1)), _pixels_mean, _sum,
                             _pixels_mean_finish),
    "pixels_absmax": Statistic(lambda c, b: -(-c // int(b or 1)), _pixels_absmax, _max, _indexed),
    "entropy": Statistic(lambda _c, _a: 1, _entropy, _sum, _first),
    "prev_token_mass": Statistic(lambda _c, _a: 1, lambda p, s, a: _at_offset(p, s, 1), _sum,
                                 _first),
    "sink_mass": Statistic(lambda _c, _a: 1, lambda p, s, a: _at_offset(p, s, None), _sum,
                           _first),
}
if set(REGISTRY) != set(STATS):  # the schema's names and the implementations are one list
    raise RuntimeError(f"statistics registry mismatch: {sorted(set(REGISTRY) ^ set(STATS))}")


def partials(x: torch.Tensor, specs: tuple[StatSpec, ...], s: Slice) -> torch.Tensor:
    """All statistics' partial columns of ``x`` (rows, channels), side by side."""
    x = x.detach().to(torch.float64)
    return torch.cat([REGISTRY[sp.name].partial(x, s, sp.arg) for sp in specs], dim=1)


def widths(specs: tuple[StatSpec, ...], full_channels: int) -> list[int]:
    return [REGISTRY[sp.name].width(full_channels, sp.arg) for sp in specs]


def combine(spec: StatSpec, parts: np.ndarray) -> np.ndarray:
    """(shards, rows, P) partials of the slices, in channel order -> (rows, P)."""
    return parts[0] if len(parts) == 1 else REGISTRY[spec.name].combine(parts)


def finish(spec: StatSpec, part: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, P) partials -> (indices, values), each (rows, W)."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        return REGISTRY[spec.name].finish(part, spec.arg)
