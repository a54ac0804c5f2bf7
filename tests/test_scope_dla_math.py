"""Direct logit attribution's arithmetic: the shares of the parts of a
residual stream, through the final LayerNorm and the unembedding, add up to
the logit difference torch's own LayerNorm gives."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatronapp.scope.lens import through_final_norm


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), parts=st.integers(1, 12), hidden=st.integers(2, 64),
       scale=st.floats(0.01, 100.0))
def test_the_shares_of_a_split_stream_add_up_to_the_logit_difference(
        seed: int, parts: int, hidden: int, scale: float) -> None:
    rng = np.random.default_rng(seed)
    pieces = rng.normal(size=(parts, hidden)) * scale
    final = pieces.sum(axis=0)
    weight, bias = rng.normal(size=hidden), rng.normal(size=hidden)
    unembed = rng.normal(size=(4, hidden))
    eps = 1e-5
    normed = torch.nn.functional.layer_norm(torch.from_numpy(final), (hidden,),
                                            torch.from_numpy(weight), torch.from_numpy(bias),
                                            eps).numpy()
    logits = unembed @ normed
    shares = through_final_norm(pieces, final, weight, eps, unembed[0] - unembed[2])
    assert shares.shape == (parts,)
    assert shares.sum() + bias @ (unembed[0] - unembed[2]) == pytest.approx(
        logits[0] - logits[2], rel=1e-9, abs=1e-9)


def test_a_part_along_the_mean_direction_has_no_share() -> None:
    """LayerNorm removes the mean: a constant vector adds nothing."""
    rng = np.random.default_rng(1)
    final = rng.normal(size=8)
    share = through_final_norm(np.full((1, 8), 3.0), final, rng.normal(size=8), 1e-5,
                               rng.normal(size=8))
    assert share[0] == pytest.approx(0.0, abs=1e-12)
