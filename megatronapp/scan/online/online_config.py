"""How much evidence on-line MegaScan needs (``megatronapp.scan.online.online``);
apart so that the command line can show its defaults without loading numpy."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OnlineConfig:
    """How much evidence a verdict needs. ``window``: iterations MegaScan judges
    at each iteration's end; ``confirm``: windows in a row that must name a
    suspect before it is named; ``clear``: windows in a row without it before a
    verdict is withdrawn; ``min_confidence``: findings below it do not count;
    ``aligned``: the caller's events are already on one clock (else each
    window's clocks are aligned from its own sync ops)."""

    window: int = 4
    confirm: int = 2
    clear: int = 3
    min_confidence: float = 0.5
    aligned: bool = False

    def __post_init__(self) -> None:
        for name in ("window", "confirm", "clear"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 0 <= self.min_confidence <= 1:
            raise ValueError("min_confidence must be in [0, 1]")


# A simulated job's events as the simulator keeps them: every rank on the true
# clock (the run's trace holds each rank's local view for readers). One
# iteration's window finds a fault in the first whole iteration after its onset.
SIMULATED = OnlineConfig(window=1, aligned=True)
