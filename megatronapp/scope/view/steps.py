"""What one decoding step sends to the page: a JSON header and named arrays.

Per model (``clean``, and ``perturbed`` beside it): attention maps per layer
``(heads, query, key)``, PCA coordinates per layer ``(tokens, 2)``, scalar
statistics as ``(layers, tokens)`` maps (mean over heads for per-head sites)
and pooled pixels as ``(layers, tokens, channels)`` maps (per-head sites lay
their heads side by side).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

import numpy as np

from ..generate import GenerationStep, StepView


def _scalar_maps(rows: Iterable[dict[str, Any]], layers: int, tokens: int
                 ) -> dict[str, np.ndarray]:
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    for r in rows:
        if r["value"] is None or r["token"] < 0:
            continue
        name = f"stats/{r['site']}/{r['stat']}"
        if name not in sums:
            sums[name] = np.zeros((layers, tokens))
            counts[name] = np.zeros((layers, tokens))
        sums[name][r["layer"] - 1, r["token"]] += r["value"]
        counts[name][r["layer"] - 1, r["token"]] += 1
    return {n: np.where(counts[n] > 0, s / np.maximum(counts[n], 1), np.nan)
            for n, s in sums.items()}


def _pixel_maps(rows: Iterable[dict[str, Any]], layers: int, tokens: int
                ) -> dict[str, np.ndarray]:
    cells: dict[str, dict[tuple[int, int, int], float]] = defaultdict(dict)
    width: dict[str, int] = defaultdict(int)
    for r in rows:
        if not str(r["stat"]).startswith("pixels_") or r["token"] < 0 or not r["values"]:
            continue
        name = f"pixels/{r['site']}"
        blocks = len(r["values"])
        base = max(r["head"], 0) * blocks
        for i, v in zip(r["index"], r["values"]):
            cells[name][(r["layer"] - 1, r["token"], base + int(i))] = v
        width[name] = max(width[name], base + blocks)
    out = {}
    for name, found in cells.items():
        m = np.full((layers, tokens, width[name]), np.nan)
        for (layer, token, channel), v in found.items():
            m[layer, token, channel] = v
        out[name] = m
    return out


def view_arrays(prefix: str, v: StepView, layers: int, tokens: int) -> dict[str, np.ndarray]:
    out = {f"{prefix}/attention/layer{n}": a for n, a in v.attention.items()}
    out.update({f"{prefix}/pca/layer{n}": a for n, a in v.pca.items()})
    out.update({f"{prefix}/{k}": a for k, a in _scalar_maps(v.stats, layers, tokens).items()})
    out.update({f"{prefix}/{k}": a for k, a in _pixel_maps(v.stats, layers, tokens).items()})
    return out


def step_message(rec: GenerationStep, layers: int, decode: Any, decoded_at: float
                 ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The header (token, probability, top-k, KL, Δh, the window's characters)
    and the arrays of one step."""
    tokens = len(rec.window)
    header: dict[str, Any] = {"kind": "step", "step": rec.step, "position": rec.position,
                              "window": [decode([i]) for i in rec.window],
                              "clean": rec.clean.header(), "decoded_at": decoded_at}
    arrays = view_arrays("clean", rec.clean, layers, tokens)
    if rec.perturbed is not None:
        header.update(perturbed=rec.perturbed.header(), kl=rec.kl,
                      delta_h={str(k): v for k, v in rec.delta_h.items()})
        arrays.update(view_arrays("perturbed", rec.perturbed, layers, tokens))
    return header, arrays
