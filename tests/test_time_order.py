"""Each rank's events in time order (``program.compiled.time_order``): the
order ``np.lexsort`` gives, also where starts repeat, decrease or are NaN."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from megatronapp.program.compiled import time_order

_TIMES = st.sampled_from([0.0, -0.0, 0.5, 1.0, 2.0, 3.0, np.nan])


@st.composite
def rows(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    shape = (draw(st.integers(1, 4)), draw(st.integers(0, 24)))
    start = draw(arrays(np.float64, shape, elements=_TIMES))
    if draw(st.booleans()):  # as a rank's clock: never decreasing
        start = np.sort(np.nan_to_num(start), axis=1)
    length = draw(arrays(np.float64, shape, elements=_TIMES))
    return start, start + length


@settings(max_examples=400, deadline=None)
@given(times=rows())
def test_time_order_is_the_lexsort_order(times: tuple[np.ndarray, np.ndarray]) -> None:
    start, end = times
    expected = np.lexsort((-(end - start), start), axis=-1)
    np.testing.assert_array_equal(time_order(start, end), expected)
