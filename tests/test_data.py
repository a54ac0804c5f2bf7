"""Training data: a real text, character level, the same samples on any layout."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatronapp.scenario.config import Data, ScenarioError
from megatronapp.scenario.data import UNKNOWN_ID, CharVocab, TextData, random_tokens, read_text


@pytest.fixture(scope="module")
def text() -> TextData:
    return TextData.load(Data(), 64)


def test_default_text_is_pydocs_topics_and_the_vocabulary_is_its_commonest_characters(text):
    raw = read_text(None)
    assert len(raw) > 400_000 and "Python" in raw
    assert text.vocab.size == 64 and len(text.ids) == len(raw)
    counts = {c: raw.count(c) for c in set(raw)}
    kept = min(counts[c] for c in text.vocab.chars)
    dropped = max((n for c, n in counts.items() if c not in text.vocab.index), default=0)
    assert kept >= dropped  # no character left out is commoner than one kept
    assert text.vocab.chars[0] == " "


@given(st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=200),
       st.integers(2, 40))
@settings(max_examples=60, deadline=None)
def test_encoding_keeps_known_characters_and_marks_the_rest(sample: str, size: int) -> None:
    vocab = CharVocab.of_text(sample, size)
    ids = vocab.encode(sample)
    assert ids.min() >= 0 and ids.max() < size
    decoded = vocab.decode(ids)
    for original, back, i in zip(sample, decoded, ids):
        assert (back == original) == (i != UNKNOWN_ID)


def test_a_sample_is_fixed_by_seed_iteration_and_index(text):
    a = text.window(3, 1, 7, batch=2, length=9)
    assert a.shape == (2, 9)
    np.testing.assert_array_equal(a, text.window(3, 1, 7, batch=2, length=9))
    assert not np.array_equal(a, text.window(3, 1, 8, batch=2, length=9))
    assert not np.array_equal(a, text.window(3, 2, 7, batch=2, length=9))
    # a window is a contiguous piece of the text
    start = next(i for i in range(len(text.ids) - 9) if np.array_equal(text.ids[i:i + 9], a[0]))
    assert text.vocab.decode(a[0]) == text.vocab.decode(text.ids[start:start + 9])


def test_random_tokens_stay_in_the_vocabulary():
    ids = random_tokens(0, 0, 0, 4, 16, vocab=5)
    assert ids.shape == (4, 16) and ids.min() >= 0 and ids.max() < 5


def test_bad_text_inputs_name_the_field(tmp_path):
    with pytest.raises(ScenarioError, match="data.path"):
        TextData.load(Data(path=str(tmp_path / "missing.txt")), 64)
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ScenarioError, match="not UTF-8"):
        TextData.load(Data(path=str(binary)), 64)
    with pytest.raises(ScenarioError, match="model.vocab"):
        CharVocab.of_text("abc", 1)
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(ScenarioError, match="model.seq_len"):
        TextData.load(Data(path=str(short)), 8).window(0, 0, 0, 1, 16)
