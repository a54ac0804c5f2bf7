"""MegaScan's ``chance_count`` as fitted on the tuning set alone, the other
thresholds held (``python -m experiments.scan_accuracy --fit-chance ...``
writes ``results/scan_chance.json``); ``megatronapp.scan.evidence.params``
holds it as its default."""
from __future__ import annotations

from typing import Any

from experiments.render import markdown_table


def tables(doc: dict[str, Any]) -> dict[str, str]:
    rows = [[f"{r['chance_count']:g}", f"{100 * r['named_rate']:.1f}%",
             f"{100 * r['false_alarm_rate']:.1f}%"] for r in doc["data"]["grid"]]
    return {"grid": markdown_table(["chance_count", "faults named first", "false alarms"],
                                   rows, "lrr")}
