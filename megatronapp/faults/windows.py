"""Whether a fault's window of time touched what a rank did."""
from __future__ import annotations

from .effects import Window

__all__ = ["window_misses"]


def window_misses(window: Window, span: tuple[float, float]) -> bool:
    """Whether no slow stretch of ``window`` meets ``span`` (start, end)."""
    start, end = span
    return not any(b > start for a, b in window.pieces(end))
