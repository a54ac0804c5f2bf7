"""MegaScan's confidence calibration (``scan.eval.tuning``): the fit recovers
the logistic law that made the findings, and a calibrated confidence has a
small expected calibration error where a miscalibrated one does not."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from megatronapp.scan.eval.tuning import fit_calibration, reliability
from megatronapp.scan.evidence.detect import calibrated
from megatronapp.scan.evidence.params import Params


def findings(slope: float, offset: float, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` findings' noise units, each right with the probability the
    logistic law (``slope``, ``offset``) in log(units / noise_multiple) gives."""
    rng = np.random.default_rng(seed)
    units = Params().noise_multiple * np.exp(rng.uniform(-1.0, 4.0, n))
    x = np.log(units / Params().noise_multiple)
    right = rng.random(n) < 1.0 / (1.0 + np.exp(-(slope * x + offset)))
    return units, right


@settings(max_examples=25)
@given(st.floats(0.3, 2.0), st.floats(-1.0, 1.0), st.integers(0, 2**16))
def test_the_fit_recovers_the_law_that_made_the_findings(slope: float, offset: float, seed: int):
    units, right = findings(slope, offset, 20_000, seed)
    fitted = fit_calibration(units, right, Params())
    # 20,000 findings: the prior's pull and the sampling error are a few hundredths
    assert abs(fitted.confidence_slope - slope) < 0.1
    assert abs(fitted.confidence_offset - offset) < 0.15


def test_a_refitted_confidence_means_what_it_says_and_a_stale_one_does_not():
    units, right = findings(0.5, 0.8, 5_000, 7)
    stale = Params(confidence_slope=2.0, confidence_offset=-1.5)
    fitted = fit_calibration(units, right, stale)

    def ece(p: Params) -> float:
        return reliability(np.array([calibrated(float(u), p) for u in units]), right)[0]
    assert ece(fitted) < 0.03 < ece(stale)
