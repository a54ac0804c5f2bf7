"""Arrays kept in a mapped file (``sim.spill``): their pages leave the
process when released, and their values stay."""
from __future__ import annotations

import numpy as np

from sim.spill import spilled_zeros


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_released_pages_leave_the_process_and_their_values_stay() -> None:
    count = 8 << 20  # 64 MB
    spill = spilled_zeros(count)
    assert not spill.values.any()
    values = np.random.default_rng(0).standard_normal(count)
    spill.values[:] = values
    before = _resident_bytes()
    spill.release()
    assert before - _resident_bytes() > 48 << 20
    np.testing.assert_array_equal(spill.values, values)


def test_writing_a_released_page_maps_that_page_only() -> None:
    """A write fault maps the page written, not its neighbours (a read fault
    would map up to 16 around it: why the loop writes before it reads)."""
    count = 8 << 20
    spill = spilled_zeros(count)
    spill.values[:] = 1.0
    spill.release()
    before = _resident_bytes()
    spill.values[::8192] = 2.0  # one value in each 64 kB
    assert _resident_bytes() - before < 16 << 20
    assert spill.values.sum() == count + count // 8192


def test_the_limits_check_holds_in_memory_what_the_loop_holds() -> None:
    from megatronapp.host.limits import COSTS
    from sim.kernel_run import SPILL_BYTES

    assert COSTS.compiled_times_held_bytes == SPILL_BYTES
