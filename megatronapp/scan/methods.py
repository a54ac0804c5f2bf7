"""The detection methods by name, MegaScan's and the baselines', each loaded
when used, so the command line lists them without importing numpy."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatronapp.scan.diagnosis import Detector

# name -> "module:function"
_BASELINES = "megatronapp.scan.eval.baselines"
DETECTORS = {
    "megascan": "megatronapp.scan.evidence.detect:megascan",
    "slowest-mean": f"{_BASELINES}:slowest_mean",
    "nvidia-0.75": f"{_BASELINES}:nvidia_relative",
    "hta-latest": f"{_BASELINES}:hta_latest_arrival",
    "megatronapp-orig": f"{_BASELINES}:megatronapp_original"}


def detector(name: str) -> Detector:
    module, function = DETECTORS[name].split(":")
    found: Detector = getattr(importlib.import_module(module), function)
    return found
