"""How much evidence on-line MegaScan needs (``megatronapp.scan.online``);
apart so that the command line can show its defaults without loading numpy."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OnlineConfig:
    """How much evidence a verdict needs. ``window``: iterations MegaScan looks
    at; ``confirm``: windows in a row that must name a suspect before it is
    named; ``clear``: windows in a row without it before a verdict is
    withdrawn; ``min_confidence``: findings below it do not count."""

    window: int = 2
    confirm: int = 2
    clear: int = 3
    min_confidence: float = 0.0
    aligned: bool = True  # the events' times are on one clock (the simulator's)

    def __post_init__(self) -> None:
        for name in ("window", "confirm", "clear"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
