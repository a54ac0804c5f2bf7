"""The model object as a TransformerLens user drives it, on an imported random
GPT-2 with a character tokenizer: text prompts and batches, hook point names
and their aliases, hooks that stay and hooks that go, one-line refusals, and
``scope import`` / ``scope lens`` on the command line (megatron-core's
warnings only with ``--verbose``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

import megatronapp.scope as ms
from megatronapp.errors import UserError
from tests.scope_oracle_support import LAYERS, VOCAB, gpt2, save_char_tokenizer
from tests.support import ROOT, run_cli

pytest.importorskip("transformers")  # the test extra


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hooked")
    ref = gpt2(root / "hf", seed=3)
    save_char_tokenizer(ref.folder)
    r = run_cli("scope", "import", str(ref.folder), "--out", str(root / "run"))
    assert r.returncode == 0, r.stderr
    assert "huggingface-gpt2: 2 blocks, d_model 32, 4 heads, vocabulary 250" in r.stdout
    return root / "run"


@pytest.fixture(scope="module")
def model(run: Path) -> Iterator[object]:
    with ms.load(run) as loaded:
        yield loaded


def test_text_prompts_are_tokenized_with_bos_and_padded_on_the_right(model: object) -> None:
    m = model
    tokens = m.to_tokens(["ab", "abcd"])  # type: ignore[attr-defined]
    assert tokens.tolist() == [[0, 1, 2, 0, 0], [0, 1, 2, 3, 4]]  # BOS 0, padded with it
    assert m.to_tokens("ab", prepend_bos=False).tolist() == [[1, 2]]  # type: ignore
    assert m.to_string(tokens[1, 1:]) == "abcd"  # type: ignore[attr-defined]
    assert m.to_str_tokens("ab") == ["<|endoftext|>", "a", "b"]  # type: ignore
    together = m(["ab", "abcd"])  # type: ignore[operator]
    alone = m("ab")  # type: ignore[operator]
    assert together.shape == (2, 5, VOCAB)
    # right padding: the short prompt's real positions see nothing of its pads
    torch.testing.assert_close(together[0, :3], alone[0], atol=1e-5, rtol=0)


def test_every_hook_point_has_transformer_lens_s_name_and_its_aliases(model: object) -> None:
    _, cache = model.run_with_cache("hello")  # type: ignore[attr-defined]
    names = cache.keys()
    assert names[:3] == ["hook_embed", "hook_pos_embed", "blocks.0.hook_resid_pre"]
    assert names[-1] == f"blocks.{LAYERS - 1}.hook_resid_post" and len(names) == 2 + 12 * LAYERS
    for alias in [("pattern", 1), ("attn.probs", 1), ("attn.probs", -1)]:
        assert cache[alias] is cache["blocks.1.attn.hook_pattern"]
    assert cache["mlp_out", 0] is cache["mlp.out", 0] is cache["blocks.0.hook_mlp_out"]
    torch.testing.assert_close(  # the stream adds up: resid_post = resid_mid + mlp_out
        cache["resid_post", 0], cache["resid_mid", 0] + cache["mlp_out", 0], atol=1e-5, rtol=0)
    only = model.run_with_cache("hello", names_filter=lambda n: n.endswith("pattern"))[1]
    assert only.keys() == ["blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern"]
    with pytest.raises(UserError, match="did you mean 'blocks.0.attn.hook_pattern'"):
        model.run_with_cache("hello", names_filter="blocks.0.attn.hook_patern")
    with pytest.raises(UserError, match="layer 2 out of range"):
        cache["resid_pre", 2]


def test_hooks_stay_until_reset_and_hooks_blocks_remove_theirs(model: object) -> None:
    m = model
    plain = m("hello")  # type: ignore[operator]
    calls: list[str] = []

    def count(t: torch.Tensor, hook: object) -> None:
        calls.append(hook.name)  # type: ignore[attr-defined]

    with m.hooks(fwd_hooks=[(("resid_pre", 1), count)]):  # type: ignore[attr-defined]
        m("hello")  # type: ignore[operator]
    m("hello")  # type: ignore[operator]
    assert calls == ["blocks.1.hook_resid_pre"]
    m.add_hook("blocks.0.hook_attn_out", lambda t, hook: t * 0)  # type: ignore[attr-defined]
    try:
        assert (m("hello") - plain).abs().max() > 0.01  # type: ignore[operator]
    finally:
        m.reset_hooks()  # type: ignore[attr-defined]
    torch.testing.assert_close(m("hello"), plain, atol=0, rtol=0)  # type: ignore[operator]


def test_a_failing_hook_raises_and_leaves_the_model_usable(model: object) -> None:
    m = model

    def broken(t: torch.Tensor, hook: object) -> None:
        raise ZeroDivisionError("in the hook")

    with pytest.raises(ZeroDivisionError):
        m.run_with_hooks("hello", fwd_hooks=[("hook_embed", broken)])  # type: ignore
    with pytest.raises(ValueError, match="returned shape"):
        m.run_with_hooks("hello", fwd_hooks=[("hook_embed", lambda t, hook: t[:, :1])])  # type: ignore
    assert m("hello").shape == (1, 6, VOCAB)  # type: ignore[operator]


@pytest.mark.parametrize("tokens,field", [
    (torch.tensor([[1, VOCAB]]), "ids must be in 0..249"),
    (torch.ones(1, 17, dtype=torch.long), "1..16 positions"),
    (torch.ones(1, 3), "integer tensor")])
def test_bad_token_ids_are_one_line(model: object, tokens: torch.Tensor, field: str) -> None:
    with pytest.raises(UserError, match=field):
        model(tokens)  # type: ignore[operator]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter: megatron-core warns while it is first imported."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "megatronapp.cli", "scope", *args], env=env,
                          capture_output=True, text=True, cwd=ROOT)


def test_scope_lens_reads_text_through_the_import_s_tokenizer_quietly(run: Path) -> None:
    quiet = _cli("lens", str(run), "--prompt", "hello world", "--json")
    assert quiet.returncode == 0, quiet.stderr
    lens = json.loads(quiet.stdout)
    assert lens["tokens"][:3] == ["<|endoftext|>", "h", "e"]
    assert "Warning" not in quiet.stderr and "warning:" not in quiet.stderr
    loud = _cli("lens", str(run), "--prompt", "hello world", "--verbose", "--force")
    assert loud.returncode == 0 and "warning: UserWarning" in loud.stderr, loud.stderr


@pytest.mark.parametrize("args,field", [
    (["lens", "{run}", "--prompt", "x" * 16], "--prompt: must be 1..16 tokens"),
    (["patch", "{run}", "--clean", "ab", "--corrupt", "abc"], "--corrupt: must have as many"),
    (["patch", "{run}", "--clean", "ab", "--corrupt", "ac", "--clean-answer", "xy"],
     "--clean-answer: must be one token"),
    (["patch", "{run}", "--clean", "ab", "--corrupt", "ac", "--per", "head", "--sites",
      "resid_pre"], "--sites: 'resid_pre' cannot be patched per head"),
    (["import", "{run}/nothing", "--out", "{run}/../other"], "SRC:")])
def test_bad_input_is_one_line_before_any_model_loads(run: Path, args: list[str],
                                                      field: str) -> None:
    r = run_cli("scope", *[a.format(run=run) for a in args])
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"megatronapp: {field}"), r.stderr


def test_a_model_that_is_not_gpt2_is_refused_naming_the_setting(tmp_path: Path) -> None:
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    r = run_cli("scope", "import", str(folder), "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and "model_type 'llama'" in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()
