"""MegaScope, and its notebook API.

``megatronapp.scope.open(path)`` reads a capture (``notebook.CaptureData``:
its tables as pyarrow / pandas, raw tensors by name). ``load(run_dir, pp=1,
tp=1)`` builds a checkpoint's model once, as a hooked model object used as
TransformerLens's ``HookedTransformer`` is (``run_with_cache``,
``run_with_hooks``, ``hooks``, ``to_tokens``; names in ``names``);
``logit_lens``, ``activation_patching`` and ``direct_logit_attribution`` take
that model. ``import_checkpoint(src, out)`` writes a run directory from a
Hugging Face GPT-2 folder or a Megatron checkpoint. These need torch: they
live in the torch backend and load by name on first use, so the core never
imports a backend (nor pyarrow, for ``--help``) until asked.
"""
from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {"open": ("megatronapp.scope.notebook", "open_capture"),
         "load": ("backends.torch.scope_hooked", "load"),
         "import_checkpoint": ("backends.torch.scope_import", "import_checkpoint"),
         "logit_lens": ("backends.torch.scope_lens", "logit_lens"),
         "activation_patching": ("backends.torch.scope_lens", "activation_patching"),
         "direct_logit_attribution": ("backends.torch.scope_lens", "direct_logit_attribution")}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _LAZY[name]
    return getattr(import_module(module), attr)


def __dir__() -> list[str]:
    return sorted(_LAZY)
