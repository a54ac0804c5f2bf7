"""MegaScan's defaults are the values its fit wrote, each with a provenance."""
from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest

from megatronapp.scan.evidence.params import (CALIBRATED, FITTED, FITTED_CHANCE, PROVENANCE,
                                              Params)

RESULTS = Path(__file__).resolve().parents[1] / "results"
FIT_FILES = {FITTED: RESULTS / "scan_fit.json", CALIBRATED: RESULTS / "scan_calibration.json",
             FITTED_CHANCE: RESULTS / "scan_chance.json"}


def test_every_parameter_has_a_meaning_and_a_provenance() -> None:
    assert set(PROVENANCE) == {f.name for f in fields(Params)}
    assert all(meaning and source for meaning, source in PROVENANCE.values())


@pytest.mark.parametrize("name", [n for n, (_m, source) in PROVENANCE.items()
                                  if source in FIT_FILES])
def test_a_fitted_default_is_what_the_fit_wrote(name: str) -> None:
    fitted = json.loads(FIT_FILES[PROVENANCE[name][1]].read_text())["data"]["params"][name]
    assert getattr(Params(), name) == pytest.approx(fitted, rel=2e-3, abs=1e-3)
