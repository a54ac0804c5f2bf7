"""Subcommands of this module (none yet)."""
from __future__ import annotations

from typing import Any


def register(subparsers: Any, plot_hooks: list) -> None:
    """Add this module's subcommands; ``plot_hooks`` gets extra plotters."""
