"""How much evidence on-line MegaScan needs (``megatronapp.scan.online.online``);
apart so that the command line can show its defaults without loading numpy."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OnlineConfig:
    """How much evidence a verdict needs. ``window``: iterations MegaScan looks
    at; ``confirm``: windows in a row that must name a suspect before it is
    named; ``clear``: windows in a row without it before a verdict is
    withdrawn; ``min_confidence``: findings below it do not count.
    ``link_window``: if longer than ``window``, links are also judged over that
    many iterations (an erratic link shows only over many transfers), and what
    that finds counts like a window's finding; 0: links on ``window`` alone."""

    window: int = 2
    confirm: int = 2
    clear: int = 3
    min_confidence: float = 0.0
    aligned: bool = True  # the events' times are on one clock (the simulator's)
    link_window: int = 0

    def __post_init__(self) -> None:
        for name in ("window", "confirm", "clear"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.link_window < 0:
            raise ValueError("link_window must be >= 0")

    @property
    def held(self) -> int:
        """Iterations the detector holds: the longer of its two windows."""
        return max(self.window, self.link_window)


# On a simulated job every rank is on one clock and nothing but the modelled
# jitter moves its times, so one iteration holds enough evidence; a window of
# two that straddles a fault's onset holds the healthy part of the onset
# iteration and fails MegaScan's "slow at its best" test, which costs an
# iteration. With a window of 1 a fault is found in the first whole iteration
# after its onset and named in the next (within confirm + 1 iterations).
SIMULATED = OnlineConfig(window=1)
