"""Whether a fault's window of time touched what a rank did."""
from __future__ import annotations

from ..io.schema import ScenarioError
from .effects import Window

__all__ = ["missed", "window_misses"]


def window_misses(window: Window, span: tuple[float, float]) -> bool:
    """Whether no slow stretch of ``window`` meets ``span`` (start, end)."""
    start, end = span
    return not any(b > start for a, b in window.pieces(end))


def missed(where: str, what: str, span: tuple[float, float]) -> ScenarioError:
    """The error of a fault whose time ``what`` missed ``span`` (start, end)."""
    return ScenarioError(f"{where}.start_s", f"{what} ({span[0]:.6g}-{span[1]:.6g} s): it "
                         "changes nothing (allow_idle_faults: true accepts it)")
