"""The logit lens, activation patching and direct logit attribution on a
loaded model object (``scope_hooked.HookedModel``): each one a function of the
model, so nothing loads again, and the model's split (one process, or pipeline
stages and TP ranks) does not change the result. The math and the result
types are ``megatronapp.scope.lens``'s.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from megatronapp.errors import UserError
from megatronapp.scope.lens import (PATCH_SITES, DlaResult, LensResult, PatchResult, patch_sites,
                                    restored, through_final_norm)
from megatronapp.scope.names import TP_SPLIT, hook_name
from megatronapp.scope.tokens import one_token

from .scope_hooked import HookedModel, HookPoint, Input

Tensor = torch.Tensor
Metric = Callable[[Tensor], "float | Tensor"]


def _one_row(m: HookedModel, input: Input, field: str) -> Tensor:
    tokens = m.input_tokens(input)
    if tokens.shape[0] != 1:
        raise UserError(f"{field}: one prompt, got a batch of {tokens.shape[0]}")
    return tokens


def _text(m: HookedModel, input: Input, tokens: Tensor) -> str:
    if isinstance(input, str):
        return input
    return "".join(m.to_single_str_token(int(i)) for i in tokens[0])


def _decode(m: HookedModel) -> Callable[[list[int]], str]:
    return lambda ids: "".join(m.to_single_str_token(int(i)) for i in ids)


def logit_lens(m: HookedModel, prompt: Input, k: int = 5) -> LensResult:
    """Each block's residual stream (and the last one's output) through the
    final norm and the unembedding."""
    tokens = _one_row(m, prompt, "prompt")
    last = m.cfg.n_layers - 1
    rows = {f"resid_pre {n}": hook_name(("resid_pre", n), m.cfg.n_layers)
            for n in range(m.cfg.n_layers)}
    rows[f"resid_post {last}"] = hook_name(("resid_post", last), m.cfg.n_layers)
    _, cache = m.run_with_cache(tokens, names_filter=list(rows.values()))
    logits = {row: m.unembed(m.ln_final(cache[name][0])).double().numpy()
              for row, name in rows.items()}
    ids = [int(i) for i in tokens[0]]
    return LensResult.of(_text(m, prompt, tokens), [m.to_single_str_token(i) for i in ids], ids, logits, k,
                         _decode(m))


def _answers(m: HookedModel, given: str | int | None, logits: Tensor, field: str,
             other_than: int | None = None) -> int:
    """``given`` (one token, or a token id), else the model's first choice at
    the last position (other than ``other_than``)."""
    if isinstance(given, int):
        return given
    if given is not None:
        return one_token(m.tokenizer, given, field)
    order = torch.argsort(-logits[0, -1].double(), stable=True)
    return int(next(int(i) for i in order if int(i) != other_than))


def _point_index(site: str, per: str, i: int, ndim: int) -> tuple[slice | int, ...]:
    """Where position ``i`` (or head ``i``) is in a hook point's tensor."""
    if per == "head":
        axis = TP_SPLIT[site][1]
    else:
        axis = 2 if site == "attn.probs" else 1
    index: list[slice | int] = [slice(None)] * ndim
    index[axis] = i
    return tuple(index)


def _patcher(clean: Tensor, index: tuple[slice | int, ...]) -> Callable[..., Tensor]:
    def patch(t: Tensor, hook: HookPoint) -> Tensor:
        t[index] = clean[index]
        return t
    return patch


def _same_length(m: HookedModel, input: Input, field: str) -> Tensor:
    tokens = m.input_tokens(input)
    if not isinstance(input, torch.Tensor) and not isinstance(input, str) and len(
            {len(m.to_tokens(t)[0]) for t in input}) > 1:
        raise UserError(f"{field}: the prompts of a batch must have as many tokens each")
    return tokens


def activation_patching(m: HookedModel, clean: Input, corrupt: Input,
                        sites: Sequence[str] | None = None, *, per: str = "position",
                        metric: Metric | None = None, clean_answer: str | int | None = None,
                        corrupt_answer: str | int | None = None) -> PatchResult:
    """Each site of the clean run patched into the corrupted run, per layer
    and position (or head, at every position); ``metric(logits)`` of each
    patched run (default: the restored logit difference between each prompt's
    answer, its most likely next token unless given)."""
    chosen = patch_sites(",".join(sites) if sites is not None else None, per)
    clean_t, corrupt_t = _same_length(m, clean, "clean"), _same_length(m, corrupt, "corrupt")
    if clean_t.shape != corrupt_t.shape:
        raise UserError(f"corrupt: must have as many tokens as clean ({tuple(corrupt_t.shape)} "
                        f"vs {tuple(clean_t.shape)})")
    layers = list(range(m.cfg.n_layers))
    names = [[hook_name((s, n), m.cfg.n_layers) for n in layers] for s in chosen]
    clean_logits, cache = m.run_with_cache(clean_t, names_filter=[n for row in names
                                                                  for n in row])
    answers = ("", "")
    name = "metric"
    if metric is None:
        metric, answers = _logit_diff_metric(m, clean_logits, m(corrupt_t), clean_answer,
                                             corrupt_answer)
        name = "restored logit difference (1: clean, 0: corrupted)"
    width = corrupt_t.shape[1] if per == "position" else m.cfg.n_heads
    grid = np.zeros((len(chosen), len(layers), width))
    for s, site in enumerate(chosen):
        for n in layers:
            value = cache[names[s][n]]
            for i in range(width):
                hook = _patcher(value, _point_index(site, per, i, value.dim()))
                grid[s, n, i] = float(metric(m.run_with_hooks(corrupt_t, [(names[s][n], hook)])))
    return PatchResult(_text(m, clean, clean_t[:1]), _text(m, corrupt, corrupt_t[:1]),
                       [m.to_single_str_token(int(i)) for i in corrupt_t[0]], answers, chosen, layers, grid,
                       per, name)


def _logit_diff_metric(m: HookedModel, clean_logits: Tensor, corrupt_logits: Tensor,
                       clean_answer: str | int | None, corrupt_answer: str | int | None
                       ) -> tuple[Metric, tuple[str, str]]:
    """The normalised logit difference, answers from the first prompt of the batch."""
    good = _answers(m, clean_answer, clean_logits, "clean_answer")
    bad = _answers(m, corrupt_answer, corrupt_logits, "corrupt_answer")
    if good == bad:
        raise UserError(f"corrupt: both prompts lead to {m.to_single_str_token(good)!r}; pick prompts that "
                        "differ there, or give clean_answer and corrupt_answer")

    def diff(logits: Tensor) -> float:
        return float((logits[:, -1, good] - logits[:, -1, bad]).double().mean())

    clean_diff, corrupt_diff = diff(clean_logits), diff(corrupt_logits)
    restored(np.zeros(1), clean_diff, corrupt_diff)  # refuses equal differences now

    def metric(logits: Tensor) -> float:
        return float(restored(np.asarray(diff(logits)), clean_diff, corrupt_diff))

    return metric, (m.to_single_str_token(good), m.to_single_str_token(bad))


def direct_logit_attribution(m: HookedModel, prompt: Input, answer: str | int | None = None,
                             baseline: str | int | None = None) -> DlaResult:
    """Each head's direct share of ``logit[answer] - logit[baseline]`` at the
    prompt's last position (defaults: the model's first choice, and its first
    other than the answer)."""
    tokens = _one_row(m, prompt, "prompt")
    c = m.cfg
    layers = list(range(c.n_layers))
    names = ([hook_name(("resid_pre", 0), c.n_layers),
              hook_name(("resid_post", c.n_layers - 1), c.n_layers)]
             + [hook_name((s, n), c.n_layers) for s in ("z", "mlp_out") for n in layers])
    logits, cache = m.run_with_cache(tokens, names_filter=names)
    good = _answers(m, answer, logits, "answer")
    bad = _answers(m, baseline, logits, "baseline", other_than=good)
    if good == bad:
        raise UserError(f"baseline: the same token as the answer ({m.to_single_str_token(good)!r})")
    w_u = m.W_U.double().numpy()
    direction = w_u[:, good] - w_u[:, bad]
    weight = m.weight("decoder.final_layernorm.weight").double().numpy()
    bias = m.weight("decoder.final_layernorm.bias").double().numpy()
    final = cache["resid_post", c.n_layers - 1][0, -1].double().numpy()

    def share(components: np.ndarray) -> np.ndarray:
        return through_final_norm(components, final, weight, 1e-5, direction)

    w_o = m.W_O.double()
    heads = np.stack([torch.einsum("nd,ndh->nh", cache["z", n][0, -1].double(),
                                   w_o[n]).numpy() for n in layers])
    parts = {"embed": float(share(cache["resid_pre", 0][0, -1].double().numpy())),
             "attn_bias": share(m.b_O.double().numpy()),
             "mlp": share(np.stack([cache["mlp_out", n][0, -1].double().numpy()
                                    for n in layers])),
             "norm_bias": float(bias @ direction)}
    ids = [int(i) for i in tokens[0]]
    return DlaResult(_text(m, prompt, tokens), [m.to_single_str_token(i) for i in ids],
                     (m.to_single_str_token(good), m.to_single_str_token(bad)), layers, share(heads), parts,
                     float(logits[0, -1, good] - logits[0, -1, bad]))


__all__ = ["logit_lens", "activation_patching", "direct_logit_attribution", "PATCH_SITES"]
