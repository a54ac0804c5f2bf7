"""Everything about scoring clock alignment against what was injected lives
here: reading a run's ground_truth.json clocks and the aligned clocks'
errors against them. Scoring only: no detector reads this."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from megatronapp.scan.align.align import ClockFit
from megatronapp.scan.ingest.load import TraceError, dig, finite_field, read_object


def read_truth_clocks(path: Path) -> dict[str, dict[str, float]]:
    """The injected clocks of ground_truth.json: rank -> {offset_us, drift_ppm}."""
    clocks = dig(read_object(path), "clocks", path)
    if not isinstance(clocks, dict):
        raise TraceError(str(path), "'clocks' must map ranks to {offset_us, drift_ppm}")
    out: dict[str, dict[str, float]] = {}
    for rank, clock in clocks.items():
        if not isinstance(clock, dict):
            raise TraceError(str(path), f"clocks.{rank} must be an object")
        out[rank] = {key: finite_field(clock, key, f"clocks.{rank}", path)
                     for key in ("offset_us", "drift_ppm")}
    return out


def score_against_truth(fits: Mapping[int, ClockFit], truth: Mapping[str, Any],
                        ref: int, span: tuple[float, float] = (0.0, 0.0)) -> dict[str, float]:
    """Clock errors against injected clocks over a window of reference time.

    ``truth`` maps rank -> {offset_us, drift_ppm} with local = true·(1+d) + o.
    A rank's error at true time t is how far its aligned clock lands from the
    reference's reading of t; it is linear in t, so over ``span`` (the
    trace's window) its middle is the rank's typical error and its ends the
    worst. Reported: the median over ranks of the typical error
    (``offset_err_median_us``), the worst error of any rank at any moment of
    the span (``offset_err_max_us``), and drift errors in ppm. The reference
    rank's own skew is composed in, so errors are like for like; the
    reference itself is left out of the statistics.
    """
    def clock(rank: int) -> tuple[float, float]:
        c = truth.get(str(rank), {})
        return 1.0 + c.get("drift_ppm", 0.0) * 1e-6, c.get("offset_us", 0.0) * 1e-6

    ref_scale, ref_offset = clock(ref)

    def error_us(fit: ClockFit, scale: float, offset: float, true_s: float) -> float:
        aligned = fit.to_ref(true_s * scale + offset)
        return abs(aligned - (true_s * ref_scale + ref_offset)) * 1e6

    middle = (span[0] + span[1]) / 2
    typical, worst, drift_err = [], [], []
    # The reference is exact by construction: counting it would pull the median down.
    for rank, fit in ((r, f) for r, f in fits.items() if r != ref or len(fits) == 1):
        scale, offset = clock(rank)
        typical.append(error_us(fit, scale, offset, middle))
        worst.append(max(error_us(fit, scale, offset, t) for t in span))
        drift_err.append(abs(fit.a - ref_scale / scale) * 1e6)
    dr = np.array(drift_err)
    return {"ranks": len(typical), "offset_err_median_us": float(np.median(typical)),
            "offset_err_max_us": float(max(worst)), "drift_err_median_ppm": float(np.median(dr)),
            "drift_err_max_ppm": float(dr.max())}
