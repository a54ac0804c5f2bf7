"""Text <-> token ids for a checkpoint's model, checked before any model loads.

A checkpoint trained here has a character vocabulary (``checkpoint.json``
``vocab``); one imported from the ecosystem (``scope import``) may carry a
Hugging Face ``tokenizer.json``, read with the ``tokenizers`` package when it is
installed, and names its BOS token. Without either, a model takes token ids
only. No torch here.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

from ..errors import UserError
from ..scenario.checkpoint import Checkpoint

TOKENIZER_FILE = "tokenizer.json"


class Tokenizer(Protocol):
    @property
    def bos(self) -> int | None:
        """Prepended by default when set (TransformerLens's ``prepend_bos``)."""

    @property
    def pad(self) -> int:
        """What a batch is right-padded with."""

    def encode(self, text: str) -> list[int]: ...

    def token(self, token_id: int) -> str: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class CharTokens:
    """A character vocabulary (id 0: any other character); no BOS."""

    vocab: Any  # scenario.data.CharVocab
    bos: int | None = None
    pad: int = 0

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.vocab.encode(text)]

    def token(self, token_id: int) -> str:
        return str(self.vocab.decode([token_id]))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.vocab.decode(list(ids)))


@dataclass(frozen=True)
class HubTokens:
    """A Hugging Face ``tokenizer.json`` (the ``tokenizers`` package)."""

    tokenizer: Any
    bos: int | None
    pad: int

    @classmethod
    def read(cls, path: Path, bos: int | None, pad: int | None) -> "HubTokens":
        try:
            from tokenizers import Tokenizer as Reader
        except ImportError:
            raise UserError(f"CHECKPOINT: {path} needs the tokenizers package to read text "
                            "(pip install tokenizers), or pass token ids") from None
        try:
            tokenizer = Reader.from_file(str(path))
        except Exception as err:  # the reader raises its own exception type
            raise UserError(f"CHECKPOINT: {path} is not a tokenizer file ({err})") from None
        fallback = bos if bos is not None else 0
        return cls(tokenizer, bos, pad if pad is not None else fallback)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def token(self, token_id: int) -> str:
        return str(self.tokenizer.decode([int(token_id)], skip_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False))


def tokenizer_of(ckpt: Checkpoint) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None (token ids only)."""
    if ckpt.vocab is not None:
        return CharTokens(ckpt.vocab)
    named = ckpt.meta.get("tokenizer")
    if not isinstance(named, dict) or not (ckpt.path / TOKENIZER_FILE).is_file():
        return None
    return HubTokens.read(ckpt.path / TOKENIZER_FILE, named.get("bos"), named.get("pad"))


def tokenizer_meta(source: Path, config: dict[str, Any]) -> dict[str, Any] | None:
    """What ``checkpoint.json`` says of a Hugging Face folder's tokenizer
    (copied beside the weights), or None when the folder has none."""
    if not (source / TOKENIZER_FILE).is_file():
        return None
    pad = config.get("pad_token_id")
    return {"file": TOKENIZER_FILE, "bos": config.get("bos_token_id"),
            "pad": pad if pad is not None else config.get("eos_token_id")}


def encode_checked(tokenizer: Tokenizer | None, text: str, seq_len: int, field: str,
                   prepend_bos: bool | None = None) -> list[int]:
    """``text`` as ids (with BOS unless ``prepend_bos`` is False), 1..seq_len of
    them; one-line errors naming ``field``."""
    if tokenizer is None:
        raise UserError(f"{field}: this checkpoint has no tokenizer (scope import copies a "
                        "Hugging Face folder's tokenizer.json); in Python, pass token ids")
    ids = tokenizer.encode(text)
    bos = tokenizer.bos if prepend_bos is not False else None
    if bos is not None:
        ids = [bos, *ids]
    if not ids or len(ids) > seq_len:
        raise UserError(f"{field}: must be 1..{seq_len} tokens, got {len(ids)} ({text!r})")
    return ids


def one_token(tokenizer: Tokenizer | None, text: str, field: str) -> int:
    """An answer: text that is exactly one token of the model's vocabulary (an
    unknown character encodes to the catch-all id, which does not give it back)."""
    if tokenizer is None:
        raise UserError(f"{field}: this checkpoint has no tokenizer; pass a token id")
    ids = tokenizer.encode(text)
    if len(ids) != 1:
        raise UserError(f"{field}: must be one token, got {len(ids)} ({text!r})")
    if tokenizer.token(ids[0]) != text:
        raise UserError(f"{field}: {text!r} is not in the model's vocabulary")
    return ids[0]
