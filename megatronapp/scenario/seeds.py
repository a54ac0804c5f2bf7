"""Seeds: any integer a scenario or an option names, mapped once for numpy and torch.

numpy's ``SeedSequence`` takes only non-negative integers, torch's
``manual_seed`` only 64-bit ones. A non-negative seed keeps the entropy it
always had (so existing streams do not change); a negative one gets a tag word
after it, so ``-5`` and ``5`` differ. Everything is deterministic.
"""
from __future__ import annotations

import numpy as np

NEGATIVE_TAG = 0x6E6567  # "neg": marks the entropy of a negative seed


def entropy(seed: int, *stream: int) -> list[int]:
    """SeedSequence entropy for ``seed`` and a stream of non-negative ints."""
    head = [seed] if seed >= 0 else [-seed, NEGATIVE_TAG]
    return [*head, *stream]


def rng(seed: int, *stream: int) -> np.random.Generator:
    """The random generator of one stream of a run seeded with ``seed``."""
    return np.random.default_rng(entropy(seed, *stream))


def seed_int(seed: int, *stream: int, bits: int = 63) -> int:
    """A non-negative integer below 2**bits for libraries that take one (torch)."""
    words = np.random.SeedSequence(entropy(seed, *stream)).generate_state(2, np.uint64)
    return int(words[0]) >> (64 - bits)


def torch_seed(seed: int) -> int:
    """``seed`` itself when torch takes it with room to add offsets, else a mapped one."""
    return seed if 0 <= seed < 2**62 else seed_int(seed, bits=62)
