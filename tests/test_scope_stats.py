"""Every statistic of the registry equals numpy's on the whole tensor, also when
the tensor is split over channel slices (tensor parallelism) and merged."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatronapp.scope.stats import Slice, combine, finish, partials
from megatronapp.scenario.scope_spec import HIST_MAX_EXP, HIST_MIN_EXP, STATS, parse_stat


def reference(name: str, x: np.ndarray, arg: float | None) -> np.ndarray:
    """numpy's answer, written independently of the implementation."""
    with np.errstate(all="ignore"):
        if name in ("min", "max", "mean", "std"):
            return getattr(np, name)(x, axis=1)
        if name == "absmax":
            return np.max(np.abs(x), axis=1)
        if name == "rms":
            return np.sqrt(np.mean(x * x, axis=1))
        if name == "l2":
            return np.sqrt(np.sum(x * x, axis=1))
        if name == "sparsity":
            return np.mean(np.abs(x) <= arg, axis=1)  # arg is exact in float32 here
        if name == "nan_count":
            return np.isnan(x).sum(1).astype(float)
        if name == "inf_count":
            return np.isinf(x).sum(1).astype(float)
        if name == "kurtosis":
            d = x - x.mean(axis=1, keepdims=True)
            return x.shape[1] * np.sum(d ** 4, axis=1) / np.sum(d ** 2, axis=1) ** 2 - 3
        if name == "hist":
            edges = 2.0 ** np.arange(HIST_MIN_EXP, HIST_MAX_EXP + 1)
            out = np.zeros((x.shape[0], len(edges) + 1))
            for r, row in enumerate(x):
                row = np.abs(row[~np.isnan(row)])
                np.add.at(out[r], np.searchsorted(edges, row, side="right"), 1)
            return out
        if name == "pixels_mean":
            return x.reshape(x.shape[0], -1, int(arg)).mean(axis=2)
        if name == "pixels_absmax":
            return np.abs(x).reshape(x.shape[0], -1, int(arg)).max(axis=2)
    raise KeyError(name)


ACCUMULATED = {"mean", "std", "rms", "l2", "kurtosis", "pixels_mean"}  # float32 sums for float32
VALUE_STATS = ["min", "max", "absmax", "mean", "std", "rms", "l2", "sparsity(0.25)",
               "nan_count", "inf_count", "kurtosis", "hist", "pixels_mean(4)", "pixels_absmax(2)"]


@st.composite
def split_tensors(draw: st.DrawFn) -> tuple[np.ndarray, list[int]]:
    """A (rows, 4·blocks) tensor of dyadic values with some NaN/Inf, and
    channel split points on multiples of 4 (as TP slices would be)."""
    rows = draw(st.integers(1, 4))
    blocks = draw(st.integers(1, 6))
    values = draw(st.lists(st.integers(-4000, 4000), min_size=rows * blocks * 4,
                           max_size=rows * blocks * 4))
    offset = draw(st.sampled_from([0.0, 0.0, 250.0, -2000.0]))  # a large mean, a small spread
    x = np.array(values, dtype=np.float64).reshape(rows, blocks * 4) / 16.0
    x = x / (1.0 if offset == 0.0 else 256.0) + offset
    specials = draw(st.lists(st.tuples(st.integers(0, rows - 1), st.integers(0, blocks * 4 - 1),
                                       st.sampled_from([np.nan, np.inf, -np.inf, 0.0, 1e6])),
                             max_size=3))
    for r, c, v in specials:
        x[r, c] = v
    cuts = sorted(set(draw(st.lists(st.integers(1, blocks - 1), max_size=2)) if blocks > 1 else []))
    return x, [4 * c for c in cuts]


def merged(x: np.ndarray, label: str, cuts: list[int],
           dtype: torch.dtype = torch.float64) -> tuple[np.ndarray, np.ndarray]:
    """The statistic of ``x`` (held in ``dtype``) from its channel slices."""
    spec = parse_stat(label)
    bounds = [0, *cuts, x.shape[1]]
    parts = [partials(torch.from_numpy(x[:, lo:hi]).to(dtype), (spec,),
                      Slice(lo, x.shape[1])).numpy() for lo, hi in zip(bounds, bounds[1:])]
    return finish(spec, combine(spec, np.stack(parts)))


@settings(max_examples=120, deadline=None)
@given(split_tensors(), st.sampled_from(VALUE_STATS), st.sampled_from([torch.float64,
                                                                       torch.float32]))
def test_value_statistics_equal_numpy_whole_or_split(case: tuple[np.ndarray, list[int]],
                                                     label: str, dtype: torch.dtype) -> None:
    x, cuts = case  # dyadic values: the same numbers in float32 and float64
    spec = parse_stat(label)
    index, got = merged(x, label, cuts, dtype)
    want = reference(spec.name, x, spec.arg)
    want = want.reshape(len(x), -1)
    assert got.shape == want.shape
    loose = dtype == torch.float32 and spec.name in ACCUMULATED
    tol = 1e-5 if loose else 1e-9  # float32 accumulation: float32 precision; else exact
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    assert (index == np.arange(want.shape[1])).all() or want.shape[1] == 1


@settings(max_examples=60, deadline=None)
@given(split_tensors(), st.integers(1, 5))
def test_topk_picks_the_largest_magnitudes_over_all_slices(case: tuple[np.ndarray, list[int]],
                                                           k: int) -> None:
    x, cuts = case
    channels, values = merged(x, f"topk({k})", cuts)
    take = min(k, x.shape[1])
    key = np.nan_to_num(np.abs(x), nan=np.inf)
    want = -np.sort(-key, axis=1)[:, :take]
    got_key = np.nan_to_num(np.abs(values[:, :take]), nan=np.inf)
    np.testing.assert_array_equal(got_key, want)
    for r in range(len(x)):  # each reported channel holds the reported value
        picked = x[r, channels[r, :take]]
        np.testing.assert_array_equal(picked, values[r, :take])
        assert len(set(channels[r, :take])) == take
    assert (channels[:, take:] == -1).all()


def causal_probs(rows: int, keys: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    query = rng.integers(0, keys, size=rows)
    logits = rng.normal(size=(rows, keys)) * 3
    logits[np.arange(keys)[None, :] > query[:, None]] = -np.inf
    p = np.exp(logits - logits.max(1, keepdims=True))
    return p / p.sum(1, keepdims=True), query


@pytest.mark.parametrize("seed", range(5))
def test_attention_statistics_equal_numpy(seed: int) -> None:
    p, query = causal_probs(12, 9, seed)
    q = torch.from_numpy(query)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.where(p > 0, p * np.log(p), 0.0).sum(1)
    prev = np.array([p[r, query[r] - 1] if query[r] > 0 else np.nan for r in range(len(p))])
    expect = {"entropy": entropy, "prev_token_mass": prev, "sink_mass": p[:, 0]}
    for name, want in expect.items():
        spec = parse_stat(name)
        part = partials(torch.from_numpy(p), (spec,), Slice(0, p.shape[1], q)).numpy()
        _, got = finish(spec, part)
        np.testing.assert_allclose(got[:, 0], want, rtol=1e-12, atol=1e-15)


def test_every_registered_statistic_is_tested() -> None:
    covered = {parse_stat(s).name for s in VALUE_STATS} | {"topk", "entropy",
                                                           "prev_token_mass", "sink_mass"}
    assert covered == set(STATS)
