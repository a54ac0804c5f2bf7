"""MegaScope against the libraries interpretability researchers trust, on the
same weights: a random Hugging Face GPT-2 (built here, never downloaded) goes
through ``scope import``; its logits are the Hugging Face model's, and the
residual stream, the attention patterns, the logit lens's ranks, activation
patching per (site, layer, position) and per head, and per-head direct logit
attribution are TransformerLens's HookedTransformer's, within 1e-4 — in one
process, and split over two pipeline stages of two tensor-parallel ranks."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

import megatronapp.scope as ms
from tests.scope_oracle_support import Gpt2, gpt2, prompts

pytest.importorskip("transformer_lens")  # the test extra

ATOL = 1e-4
ANSWER, BASELINE = 5, 9


@pytest.fixture(scope="module")
def model_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Gpt2, Path]:
    root = tmp_path_factory.mktemp("gpt2")
    ref = gpt2(root / "hf")
    return ref, ms.import_checkpoint(ref.folder, root / "run")


@pytest.fixture(scope="module", params=[(1, 1), pytest.param((2, 2), marks=pytest.mark.slow)],
                ids=["pp1-tp1", "pp2-tp2"])
def split(request: pytest.FixtureRequest, model_pair: tuple[Gpt2, Path]) -> Iterator[Any]:
    """The imported model, loaded once per split for the tests below."""
    pp, tp = request.param
    with ms.load(model_pair[1], pp=pp, tp=tp) as model:
        yield model


def test_an_imported_gpt2_gives_the_hugging_face_logits(model_pair: tuple[Gpt2, Path],
                                                        tmp_path: Path) -> None:
    ref, run = model_pair
    clean, _ = prompts(0, batch=3, length=12)
    with torch.no_grad():
        want = ref.hf(clean).logits
    with ms.load(run) as model:
        got = model(clean)
    assert got.shape == want.shape  # the padded vocabulary rows are not logits
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    # the same weights saved as pytorch_model.bin import the same
    other = gpt2(tmp_path / "bin", safetensors=False)
    assert (other.folder / "pytorch_model.bin").is_file()
    with torch.no_grad():
        want_bin = other.hf(clean).logits
    with ms.load(ms.import_checkpoint(other.folder, tmp_path / "run")) as model:
        torch.testing.assert_close(model(clean), want_bin, atol=ATOL, rtol=0)


def _lens_ranks(lens: object, row: torch.Tensor, names: list[str], cache: object) -> np.ndarray:
    """TransformerLens's logit lens: ln_final and unembed on each stream; the
    rank of the next token (tokens scoring strictly higher)."""
    ranks = []
    for name in names:
        site, layer = name.split()
        logits = lens.unembed(lens.ln_final(cache[site, int(layer)][:1]))[0]  # type: ignore
        target = row[1:]
        right = logits[torch.arange(len(target)), target]
        ranks.append((logits[:-1] > right[:, None]).sum(-1).numpy())
    return np.stack(ranks)


@torch.no_grad()  # TransformerLens's weights are parameters
def test_the_analyses_equal_transformer_lens(model_pair: tuple[Gpt2, Path], split: Any) -> None:
    from transformer_lens import patching

    ref = model_pair[0]
    clean, corrupt = prompts(1)
    want_logits, want = ref.lens.run_with_cache(clean)

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return (logits[:, -1, ANSWER] - logits[:, -1, BASELINE]).mean()

    model = split
    logits, cache = model.run_with_cache(clean)
    by_position = ms.activation_patching(model, clean, corrupt, metric=metric)
    by_head = ms.activation_patching(model, clean, corrupt, per="head", metric=metric)
    lens = ms.logit_lens(model, clean[:1], k=3)
    dla = ms.direct_logit_attribution(model, clean[:1], answer=ANSWER, baseline=BASELINE)
    torch.testing.assert_close(logits, want_logits, atol=ATOL, rtol=0)
    assert len(cache) == 2 + 12 * 2 and set(cache.keys()) <= set(want.keys())
    for name in cache:  # residual stream, q/k/v, patterns, z, MLP: every hook point
        torch.testing.assert_close(cache[name], want[name], atol=ATOL, rtol=0, msg=name)
    assert cache["pattern", 1] is cache["blocks.1.attn.hook_pattern"] is cache["attn.probs", 1]

    np.testing.assert_array_equal(lens.ranks, _lens_ranks(ref.lens, clean[0], lens.rows, want))
    every_block = patching.get_act_patch_block_every(ref.lens, corrupt, want, metric)
    np.testing.assert_allclose(by_position.restored, every_block.numpy(), atol=ATOL)
    assert by_position.sites == ["resid_pre", "attn.out", "mlp.out"]
    heads = patching.get_act_patch_attn_head_out_all_pos(ref.lens, corrupt, want, metric)
    np.testing.assert_allclose(by_head.restored[0], heads.numpy(), atol=ATOL)
    assert np.abs(every_block.numpy()).max() > 0.01  # patching changes the metric at all

    _, folded = ref.folded.run_with_cache(clean[:1])
    stack = folded.stack_head_results(layer=-1, pos_slice=-1)
    attrs = folded.logit_attrs(stack, tokens=torch.tensor([ANSWER]),
                               incorrect_tokens=torch.tensor([BASELINE]), pos_slice=-1)
    np.testing.assert_allclose(dla.heads.reshape(-1), attrs[:, 0].numpy(), atol=ATOL)
    assert dla.logit_diff == pytest.approx(float(want_logits[0, -1, ANSWER]
                                                 - want_logits[0, -1, BASELINE]), abs=ATOL)


@torch.no_grad()
def test_hook_functions_change_the_run_as_transformer_lens_hooks_do(
        model_pair: tuple[Gpt2, Path], split: Any) -> None:
    """A hook that returns a tensor and one that edits its argument in place,
    on a point split over TP ranks (q) and one that crosses a stage (resid_pre 1)."""
    ref = model_pair[0]
    clean, _ = prompts(2)

    def scale_q(q: torch.Tensor, hook: object) -> torch.Tensor:
        return q * 1.5

    def zero_position(resid: torch.Tensor, hook: object) -> None:
        resid[:, 2] = 0.0

    hooks = [("blocks.0.attn.hook_q", scale_q), ("blocks.1.hook_resid_pre", zero_position)]
    want = ref.lens.run_with_hooks(clean, fwd_hooks=hooks)
    got = split.run_with_hooks(clean, fwd_hooks=hooks)
    unhooked = split(clean)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert (got - unhooked).abs().max() > 0.01


def test_a_failing_hook_is_raised_here_and_the_model_goes_on(model_pair: tuple[Gpt2, Path],
                                                             split: Any) -> None:
    """At a split, the hook runs in this process while the ranks wait: its
    exception comes back here, and the ranks are ready for the next pass."""
    clean, _ = prompts(3)
    before = split(clean)

    def broken(t: torch.Tensor, hook: Any) -> None:
        raise ZeroDivisionError(hook.name)

    with pytest.raises(ZeroDivisionError, match="blocks.1.attn.hook_pattern"):
        split.run_with_hooks(clean, fwd_hooks=[(("pattern", 1), broken)])
    torch.testing.assert_close(split(clean), before, atol=0, rtol=0)
