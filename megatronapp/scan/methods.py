"""The detection methods by name, MegaScan's and the baselines', each loaded
when used, so the command line lists them without importing numpy."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .diagnosis import Detector

# name -> "module:function" in this package
DETECTORS = {
    "megascan": "detect:megascan", "slowest-mean": "baselines:slowest_mean",
    "nvidia-0.75": "baselines:nvidia_relative", "hta-latest": "baselines:hta_latest_arrival",
    "megatronapp-orig": "baselines:megatronapp_original"}


def detector(name: str) -> Detector:
    module, function = DETECTORS[name].split(":")
    found: Detector = getattr(importlib.import_module(f"{__package__}.{module}"), function)
    return found
