"""paper_figs/online_table.py: the false-alarm rate's upper bound."""
from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st


@given(exposure=st.floats(1.0, 1e6))
def test_no_event_bounds_the_rate_by_ln_20_over_the_exposure(exposure: float) -> None:
    from paper_figs.online_table import poisson_upper

    assert poisson_upper(0, exposure) == pytest.approx(math.log(20) / exposure, rel=1e-9)


@given(count=st.integers(0, 30), exposure=st.floats(10.0, 1e5))
def test_at_the_bound_seeing_as_few_events_has_probability_one_in_twenty(
        count: int, exposure: float) -> None:
    from paper_figs.online_table import poisson_upper

    mean = poisson_upper(count, exposure) * exposure
    at_most = sum(mean ** k / math.factorial(k) for k in range(count + 1)) * math.exp(-mean)
    assert at_most == pytest.approx(0.05, abs=1e-9)
    assert poisson_upper(count + 1, exposure) > poisson_upper(count, exposure) > count / exposure
