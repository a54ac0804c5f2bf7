"""``scope lens`` and ``scope patch`` on a checkpoint's model (one process, CPU);
the math and the results are ``megatronapp.scope.lens``'s."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from megatronapp.errors import UserError
from megatronapp.scope.lens import PATCH_SITES, LensResult, PatchResult, restored

from .scope import ACCESS
from .scope_cache import LoadedModel, Patch, position_index
from .scope_generate import one_rank



def logit_lens(checkpoint: str | Path, prompt: str, k: int = 5) -> LensResult:
    """Each layer's residual stream read through the final norm and unembedding."""
    with one_rank():
        m = LoadedModel.load(checkpoint)
        ids = m.encode(prompt)
        _, seen = m.forward(ids, ["resid_pre", "resid_post"])
        streams = {f"resid_pre {n}": seen[("resid_pre", n)] for n in range(1, m.layers + 1)}
        streams[f"resid_post {m.layers}"] = seen[("resid_post", m.layers)]
        logits = {row: m.final_logits(x[:, 0]) for row, x in streams.items()}
    assert m.ckpt.vocab is not None
    return LensResult.of(prompt, m.decode(ids), ids, logits, k, m.ckpt.vocab.decode)


def _answer(m: LoadedModel, given: str | None, logits: np.ndarray, option: str) -> int:
    if given is None:
        return int(np.argmax(logits[-1]))
    ids = m.encode(given, option)
    if len(ids) != 1:
        raise UserError(f"{option}: one character, got {given!r}")
    return ids[0]


def activation_patching(checkpoint: str | Path, clean: str, corrupt: str,
                        sites: Sequence[str] = PATCH_SITES, clean_answer: str | None = None,
                        corrupt_answer: str | None = None) -> PatchResult:
    """Patch each site of the clean run into the corrupted one, per layer and
    position; answers default to each prompt's most likely next character."""
    with one_rank():
        m = LoadedModel.load(checkpoint)
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
