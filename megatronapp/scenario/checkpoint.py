"""Model checkpoints: the full model in safetensors, by global parameter name.

``CHECKPOINT_DIR/model.safetensors`` holds every parameter unsplit (TP slices
joined, pipeline stages together), so any parallel layout can load it;
``checkpoint.json`` says what model it is and how to rebuild its character
vocabulary (the text's path and SHA-256, the vocabulary's characters).
Reading validates everything and fails with one line (``UserError``).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .config import Data, Model
from .data import CharVocab, default_text_path, read_text
from ..errors import UserError
from ..io import gate
from .scope_spec import ModelShape, parameter_shapes

FORMAT = "megatronapp-checkpoint"
VERSION = 1
WEIGHTS = "model.safetensors"
META = "checkpoint.json"


def text_identity(data: Data) -> dict[str, Any]:
    """Where the training text is and which text it is."""
    path = Path(data.path) if data.path else default_text_path()
    text = read_text(path)
    return {"kind": data.kind, "path": str(path.resolve()), "characters": len(text),
            "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}


def model_shape_of(model: Model, tp: int = 1) -> ModelShape:
    return ModelShape(layers=model.layers, heads=model.heads, hidden=model.hidden, ffn=model.ffn,
                      vocab=model.vocab, seq_len=model.seq_len, tp=tp, pp_vpp=1)


def write_checkpoint(out: Path, state: Mapping[str, np.ndarray], model: Model, data: Data,
                     info: Mapping[str, Any]) -> Path:
    """Write ``out/model.safetensors`` and ``out/checkpoint.json``."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, str(out / WEIGHTS))
    meta: dict[str, Any] = {"format": FORMAT, "version": VERSION,
                            "model": model.model_dump(mode="json"), **dict(info)}
    if data.kind == "text":
        text = read_text(Path(data.path) if data.path else None)
        vocab = CharVocab.of_text(text, model.vocab)
        meta["data"] = text_identity(data)
        meta["vocab"] = {"size": model.vocab, "chars": "".join(vocab.chars)}
    (out / META).write_text(json.dumps(meta, indent=2))
    return out


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    model: Model
    state: dict[str, np.ndarray]
    vocab: CharVocab | None
    meta: dict[str, Any]


def _fail(path: Path, reason: str) -> UserError:
    return UserError(f"CHECKPOINT: {path}: {reason}")


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Load and check a checkpoint directory; one-line errors."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path = Path(path)
    if not gate.exists(path / META, "CHECKPOINT") or not gate.exists(path / WEIGHTS, "CHECKPOINT"):
        raise _fail(path, f"not a checkpoint directory (needs {META} and {WEIGHTS})")
    try:
        meta = gate.read_json(path / META, "")
        model = Model.model_validate(meta["model"])
    except (ValueError, KeyError, TypeError) as err:  # a TextError is a ValueError
        raise _fail(path, f"{META} is corrupt ({type(err).__name__})") from None
    if meta.get("format") != FORMAT:
        raise _fail(path, f"{META} is not a {FORMAT} file")
    try:
        state = load_file(str(gate.checked(path / WEIGHTS, "CHECKPOINT")))
    except (SafetensorError, OSError, ValueError) as err:
        raise _fail(path, f"{WEIGHTS} is corrupt ({err})") from None
    _check_state(path, state, model)
    vocab = None
    if "vocab" in meta:
        chars = meta["vocab"].get("chars", "")
        if len(chars) + 1 != model.vocab:
            raise _fail(path, f"the vocabulary has {len(chars) + 1} ids, the model {model.vocab}")
        vocab = CharVocab(tuple(chars))
    return Checkpoint(path, model, state, vocab, meta)


def _check_state(path: Path, state: Mapping[str, np.ndarray], model: Model) -> None:
    want = parameter_shapes(model_shape_of(model))
    missing = sorted(set(want) - set(state))
    extra = sorted(set(state) - set(want))
    if missing or extra:
        raise _fail(path, f"parameters do not match the model: missing {missing[:3]}, "
                    f"unexpected {extra[:3]}")
    for name, shape in want.items():
        if tuple(state[name].shape) != shape:
            raise _fail(path, f"{name} has shape {tuple(state[name].shape)}, the model needs {shape}")
        if not np.isfinite(state[name]).all():
            raise _fail(path, f"{name} holds NaN or Inf")
