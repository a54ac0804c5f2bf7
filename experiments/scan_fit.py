"""MegaScan's thresholds and confidence as fitted on the tuning set alone
(``python -m experiments.scan_accuracy --fit --tuning-only ...`` writes
``results/scan_fit.json``); ``megatronapp.scan.evidence.params`` holds them
as its defaults, which ``experiments.scan_accuracy`` then scores on the
tuning and held-out sets."""
from __future__ import annotations

from experiments.scan_accuracy import tables

__all__ = ["tables"]
