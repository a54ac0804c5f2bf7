"""Warnings of the model library, kept instead of printed.

Megatron-core warns while it is imported and while a model is built
(Transformer Engine or Apex missing, deprecated options), once per process
and every time in a notebook. MegaScope keeps them around those steps only
(never a filter for the whole process): a model object lists them in
``warnings``, the commands print them with ``--verbose``.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterator


@contextlib.contextmanager
def kept_warnings(into: list[str]) -> Iterator[list[str]]:
    """Warnings raised inside go into ``into`` (one line each), not to stderr."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield into
    into += [f"{w.category.__name__}: {w.message}" for w in caught]
