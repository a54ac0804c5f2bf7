"""``scope import`` of Megatron checkpoints: a megatron-core GPTModel built
here is saved as Megatron-LM saves it (``torch_dist`` through megatron-core's
own ``dist_checkpointing.save``, and the legacy ``model_optim_rng.pt``), with
the run's ``args`` (an ``argparse.Namespace`` holding one of megatron's enums);
the imported run gives the saved model's logits. A checkpoint without linear
biases (``--disable-bias-linear``) and with a tied output layer reads the same."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import torch

import megatronapp.scope as ms
from megatronapp.scenario.config import parse_scenario
from tests.support import run_cli

MODEL = {"layers": 2, "hidden": 32, "heads": 4, "seq_len": 16, "vocab": 64}
TOKENS = torch.tensor([[3, 17, 5, 60, 2, 9, 33, 1], [8, 8, 1, 0, 63, 12, 4, 7]])


def _args(**changes: Any) -> argparse.Namespace:
    from megatron.core.transformer.enums import AttnBackend

    m = MODEL
    return argparse.Namespace(**{
        "num_layers": m["layers"], "hidden_size": m["hidden"], "num_attention_heads": m["heads"],
        "ffn_hidden_size": 4 * m["hidden"], "seq_length": m["seq_len"],
        "max_position_embeddings": m["seq_len"], "padded_vocab_size": m["vocab"],
        "normalization": "LayerNorm", "position_embedding_type": "learned_absolute",
        "swiglu": False, "add_bias_linear": True, "untie_embeddings_and_output_weights": True,
        "attention_backend": AttnBackend.auto, **changes})


def _megatron_model(seed: int) -> Any:
    from backends.torch.scope_generate import build_model, initial_state

    s = parse_scenario({"seed": seed, "model": MODEL, "data": {"kind": "random"}})
    return build_model(s, initial_state(s))


def _logits(model: Any) -> torch.Tensor:
    from backends.torch.megatron_compat import causal_mask

    b, s = TOKENS.shape
    with torch.no_grad():
        return model(TOKENS, torch.arange(s).expand(b, s), causal_mask(s))


def _imported_logits(source: Path, out: Path) -> torch.Tensor:
    r = run_cli("scope", "import", str(source), "--out", str(out))
    assert r.returncode == 0, r.stderr
    with ms.load(out) as model:
        return model(TOKENS)


def test_a_torch_dist_checkpoint_imports_as_the_model_that_saved_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from backends.torch.scope_generate import one_rank
    from megatron.core import dist_checkpointing

    # megatron-core's writer synchronises CUDA before and after writing: no-ops on a CPU
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    folder = tmp_path / "megatron"
    with one_rank():
        model = _megatron_model(5)
        want = _logits(model)
        (folder / "iter_0000010").mkdir(parents=True)
        dist_checkpointing.save({"model": model.sharded_state_dict(), "args": _args(),
                                 "iteration": 10, "checkpoint_version": 3.0},
                                str(folder / "iter_0000010"))
    (folder / "latest_checkpointed_iteration.txt").write_text("10")
    got = _imported_logits(folder, tmp_path / "run")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_a_legacy_checkpoint_without_biases_and_tied_imports_as_the_model(
        tmp_path: Path) -> None:
    from backends.torch.scope_generate import one_rank

    shard = tmp_path / "megatron" / "iter_0000007" / "mp_rank_00"
    shard.mkdir(parents=True)
    with one_rank():
        model = _megatron_model(6)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias") and "layernorm" not in name:
                    p.zero_()  # what --disable-bias-linear leaves out
            model.output_layer.weight.copy_(model.embedding.word_embeddings.weight)
        want = _logits(model)
        state = {k: v for k, v in model.state_dict().items()
                 if not (k.endswith("bias") and "layernorm" not in k)
                 and k != "output_layer.weight"}
    torch.save({"args": _args(add_bias_linear=False, untie_embeddings_and_output_weights=False),
                "model": state, "iteration": 7, "checkpoint_version": 3.0},
               shard / "model_optim_rng.pt")
    (tmp_path / "megatron" / "latest_checkpointed_iteration.txt").write_text("7")
    got = _imported_logits(tmp_path / "megatron", tmp_path / "run")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("change,named", [({"swiglu": True}, "args.swiglu"),
                                          ({"normalization": "RMSNorm"}, "args.normalization")])
def test_a_megatron_model_outside_gpt2_s_architecture_is_one_line(
        tmp_path: Path, change: dict[str, Any], named: str) -> None:
    shard = tmp_path / "megatron" / "release" / "mp_rank_00"
    shard.mkdir(parents=True)
    torch.save({"args": _args(**change), "model": {}}, shard / "model_optim_rng.pt")
    (tmp_path / "megatron" / "latest_checkpointed_iteration.txt").write_text("release")
    r = run_cli("scope", "import", str(tmp_path / "megatron"), "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and named in r.stderr and r.stderr.count("megatronapp:") == 1
