"""Training data: character-level windows of a real text, or uniform random tokens.

The default text is CPython's ``pydoc_data/topics.py`` (about 750 k characters,
shipped with every Python), so a model trained here learns something without
downloading anything. The vocabulary is the text's ``vocab - 1`` most frequent
characters (ties broken by code point) plus one id for every other character;
it is fixed by the text and the model's vocabulary size alone, so every rank
and every later ``scope generate`` agree on it.

Sample ``i`` of iteration ``t`` is the window starting at an offset drawn from
``(seed, t, i)``: the same global sample gives the same tokens on any
parallel layout.
"""
from __future__ import annotations

import importlib.util
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import seeds
from .config import Data, ScenarioError
from ..io import gate
from ..io.text import TextError

UNKNOWN_ID = 0  # every character outside the vocabulary
MAX_TRAINING_TEXT = 1 << 30  # bytes of training text read (held whole, as characters)


def default_text_path() -> Path:
    spec = importlib.util.find_spec("pydoc_data.topics")
    if spec is None or spec.origin is None:  # pragma: no cover - every CPython ships it
        raise ScenarioError("data.path", "CPython's pydoc_data/topics.py is missing; give a path")
    return Path(spec.origin)


def read_text(path: Path | None) -> str:
    path = path or default_text_path()
    try:
        return gate.read_text(path, "", MAX_TRAINING_TEXT)
    except TextError as err:
        raise ScenarioError("data.path", str(err)) from None
    except OSError as err:
        raise ScenarioError("data.path", f"cannot read {path}: {err.strerror or err}") from None


@dataclass(frozen=True)
class CharVocab:
    """Characters <-> token ids for a model with ``size`` ids."""

    chars: tuple[str, ...]  # id i + 1 -> character; id 0 is "any other character"
    index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "index", {c: i + 1 for i, c in enumerate(self.chars)})

    @classmethod
    def of_text(cls, text: str, size: int) -> "CharVocab":
        if size < 2:
            raise ScenarioError("model.vocab", f"{size}: a character vocabulary needs >= 2 ids")
        ranked = sorted(Counter(text).items(), key=lambda kv: (-kv[1], kv[0]))
        return cls(tuple(c for c, _ in ranked[:size - 1]))

    @property
    def size(self) -> int:
        return len(self.chars) + 1

    def encode(self, text: str) -> np.ndarray:
        return np.fromiter((self.index.get(c, UNKNOWN_ID) for c in text), dtype=np.int64,
                           count=len(text))

    def decode(self, ids: "np.ndarray | list[int]") -> str:
        return "".join(self.chars[i - 1] if 0 < i <= len(self.chars) else "\ufffd"
                       for i in (int(x) for x in ids))


@dataclass(frozen=True)
class TextData:
    """A whole text, encoded once; windows of it are the training samples."""

    vocab: CharVocab
    ids: np.ndarray

    @classmethod
    def load(cls, data: Data, vocab_size: int) -> "TextData":
        text = read_text(Path(data.path) if data.path else None)
        vocab = CharVocab.of_text(text, vocab_size)
        return cls(vocab, vocab.encode(text))

    def window(self, seed: int, iteration: int, sample: int, batch: int, length: int) -> np.ndarray:
        """(batch, length) token ids: ``batch`` windows at offsets drawn from the key."""
        if len(self.ids) <= length:
            raise ScenarioError("model.seq_len", f"{length} does not fit in a text of "
                                f"{len(self.ids)} characters")
        rng = seeds.rng(seed, 11, iteration, sample)
        starts = rng.integers(0, len(self.ids) - length, size=batch)
        return np.stack([self.ids[s:s + length] for s in starts])


def random_tokens(seed: int, iteration: int, sample: int, batch: int, length: int,
                  vocab: int) -> np.ndarray:
    """Uniform random ids (``data.kind: random``): nothing to learn, a load test."""
    rng = seeds.rng(seed, 11, iteration, sample)
    return rng.integers(0, vocab, size=(batch, length))
