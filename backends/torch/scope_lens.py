"""``scope lens``, ``scope patch`` and ``scope dla`` on a checkpoint's model:
in one process, or split over pipeline stages and tensor-parallel ranks
(``scope_pipeline``); the math and the results are ``megatronapp.scope.lens``'s.

Each analysis is a function of a loaded model (``LoadedModel`` or
``StagedModel``: the same calls), so one stage and many give one result.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Sequence

import numpy as np

from megatronapp.scenario.data import UNKNOWN_ID
from megatronapp.errors import UserError
from megatronapp.scope.lens import (PATCH_SITES, DlaResult, LensResult, PatchResult, restored,
                                    through_final_norm)

from .scope import ACCESS
from .scope_cache import LoadedModel, Patch, position_index
from .scope_pipeline import run_analysis


def logit_lens(checkpoint: str | Path, prompt: str, k: int = 5, *, pp: int = 1,
               tp: int = 1) -> LensResult:
    """Each layer's residual stream read through the final norm and unembedding."""
    return run_analysis(checkpoint, functools.partial(lens_of, prompt=prompt, k=k), pp, tp)


def lens_of(m: LoadedModel, prompt: str, k: int) -> LensResult:
    ids = m.encode(prompt)
    _, seen = m.forward(ids, ["resid_pre", "resid_post"])
    streams = {f"resid_pre {n}": seen[("resid_pre", n)] for n in range(1, m.layers + 1)}
    streams[f"resid_post {m.layers}"] = seen[("resid_post", m.layers)]
    logits = {row: m.final_logits(x[:, 0]) for row, x in streams.items()}
    assert m.ckpt.vocab is not None
    return LensResult.of(prompt, m.decode(ids), ids, logits, k, m.ckpt.vocab.decode)


def _answer(m: LoadedModel, given: str | None, logits: np.ndarray, option: str,
            other_than: int | None = None) -> int:
    """``given`` (one character), else the model's first choice at the last
    position (other than ``other_than``)."""
    if given is None:
        return int(next(i for i in np.argsort(-logits[-1], kind="stable") if i != other_than))
    ids = m.encode(given, option)
    if len(ids) != 1:
        raise UserError(f"{option}: one character, got {given!r}")
    if ids[0] == UNKNOWN_ID:  # it would stand for every character the model does not know
        raise UserError(f"{option}: {given!r} is not in the model's vocabulary")
    return ids[0]


def activation_patching(checkpoint: str | Path, clean: str, corrupt: str,
                        sites: Sequence[str] = PATCH_SITES, clean_answer: str | None = None,
                        corrupt_answer: str | None = None, *, pp: int = 1,
                        tp: int = 1) -> PatchResult:
    """Patch each site of the clean run into the corrupted one, per layer and
    position; answers default to each prompt's most likely next character."""
    return run_analysis(checkpoint, functools.partial(
        patching_of, clean=clean, corrupt=corrupt, sites=tuple(sites), clean_answer=clean_answer,
        corrupt_answer=corrupt_answer), pp, tp)


def patching_of(m: LoadedModel, clean: str, corrupt: str, sites: Sequence[str],
                clean_answer: str | None, corrupt_answer: str | None) -> PatchResult:
    clean_ids, corrupt_ids = m.encode(clean, "--clean"), m.encode(corrupt, "--corrupt")
    if len(clean_ids) != len(corrupt_ids):
        raise UserError(f"--corrupt: must have as many characters as --clean "
                        f"({len(corrupt_ids)} vs {len(clean_ids)})")
    sites = m.sites(sites, "--sites")
    clean_logits, cached = m.forward(clean_ids, sites)
    corrupt_logits, _ = m.forward(corrupt_ids)
    good = _answer(m, clean_answer, clean_logits, "--clean-answer")
    bad = _answer(m, corrupt_answer, corrupt_logits, "--corrupt-answer")
    if good == bad:
        raise UserError(f"--corrupt: both prompts lead to {m.decode([good])[0]!r}; pick "
                        "prompts that differ there, or pass --clean-answer and "
                        "--corrupt-answer")

    def diff(logits: np.ndarray) -> float:
        return float(logits[-1, good] - logits[-1, bad])

    layers = list(range(1, m.layers + 1))
    grid = np.zeros((len(sites), len(layers), len(corrupt_ids)))
    for s, site in enumerate(sites):
        layout = ACCESS[site].layout
        for n, layer in enumerate(layers):
            value = cached[(site, layer)]
            for p in range(len(corrupt_ids)):
                patch = Patch(site, layer, p, value[position_index(value, layout, p)])
                grid[s, n, p] = diff(m.forward(corrupt_ids, patch=patch)[0])
    return PatchResult(clean, corrupt, m.decode(corrupt_ids), (m.decode([good])[0],
                                                               m.decode([bad])[0]),
                       list(sites), layers, restored(grid, diff(clean_logits),
                                                     diff(corrupt_logits)))


def direct_logit_attribution(checkpoint: str | Path, prompt: str, answer: str | None = None,
                             baseline: str | None = None, *, pp: int = 1,
                             tp: int = 1) -> DlaResult:
    """Each head's direct share of ``logit[answer] - logit[baseline]`` at the
    prompt's last position (defaults: the model's first choice, and its first
    other than the answer)."""
    return run_analysis(checkpoint, functools.partial(
        dla_of, prompt=prompt, answer=answer, baseline=baseline), pp, tp)


def dla_of(m: LoadedModel, prompt: str, answer: str | None, baseline: str | None) -> DlaResult:
    ids = m.encode(prompt)
    logits, seen = m.forward(ids, ["resid_pre", "attn.out", "mlp.out", "resid_post"])
    good = _answer(m, answer, logits, "--answer")
    bad = _answer(m, baseline, logits, "--baseline", other_than=good)
    if good == bad:
        raise UserError(f"--baseline: the same character as the answer ({m.decode([good])[0]!r})")
    heads = m.head_outputs(ids)
    weight, bias, eps, unembed = m.readout()
    direction = unembed[good] - unembed[bad]
    layers = list(range(1, m.layers + 1))

    def last(site: str, layer: int) -> np.ndarray:  # the last position's (hidden,)
        return seen[(site, layer)][-1, 0].double().numpy()

    final = last("resid_post", m.layers)

    def share(components: np.ndarray) -> np.ndarray:
        return through_final_norm(components, final, weight, eps, direction)

    parts = {"embed": float(share(last("resid_pre", 1))),
             "attn_bias": share(np.stack([_proj_bias(m, n) for n in layers])),
             "mlp": share(np.stack([last("mlp.out", n) for n in layers])),
             "norm_bias": float(bias @ direction)}
    return DlaResult(prompt, m.decode(ids), (m.decode([good])[0], m.decode([bad])[0]), layers,
                     share(np.stack([heads[n][-1].double().numpy() for n in layers])), parts,
                     float(logits[-1, good] - logits[-1, bad]))


def _proj_bias(m: LoadedModel, layer: int) -> np.ndarray:
    """The attention output projection's bias (added once, after the heads)."""
    name = f"decoder.layers.{layer - 1}.self_attention.linear_proj.bias"
    bias = m.ckpt.state.get(name)
    return np.zeros(m.ckpt.model.hidden) if bias is None else np.asarray(bias, np.float64)
