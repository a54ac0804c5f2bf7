"""What ``megatronapp run`` prints about losses: every value of a short run,
a one-line summary with a sparkline of a long one."""
from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from megatronapp.run.report import SPARK, SPARK_WIDTH, loss_line, sparkline


def test_a_short_run_prints_every_loss() -> None:
    losses = [4.829, 4.510, 4.229, 4.123, 4.152]
    assert loss_line(losses).endswith("4.829 4.510 4.229 4.123 4.152")


def test_a_long_run_prints_first_last_lowest_and_a_sparkline_not_every_value() -> None:
    losses = [4.8 * math.exp(-i / 300) + 1.4 for i in range(1500)]
    losses[700] = 1.0  # a dip: the lowest, not the last
    line = loss_line(losses)
    assert "\n" not in line and len(line) < 200
    assert "first 6.200" in line and f"last {losses[-1]:.3f}" in line
    assert "lowest 1.000 at iteration 700" in line
    assert line.count(" ") < 30  # not 1,500 values


@given(st.lists(st.floats(0.1, 20.0), min_size=2, max_size=3000, unique=True))
def test_a_falling_curve_draws_a_falling_sparkline(values: list[float]) -> None:
    falling = sorted(values, reverse=True)
    drawn = sparkline(falling)
    assert 0 < len(drawn) <= SPARK_WIDTH
    levels = [SPARK.index(c) for c in drawn]
    assert levels == sorted(levels, reverse=True)
    assert levels[0] == len(SPARK) - 1 and levels[-1] == 0
