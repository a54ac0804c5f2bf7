"""The error every trace reader raises (one definition, so readers need not
import one another)."""
from __future__ import annotations

from megatronapp.errors import Recreatable


class TraceError(Recreatable, ValueError):
    """Unreadable trace input; the message names the file and the event."""

    def __init__(self, source: str, reason: str, index: int | None = None):
        where = f"{source}" + (f": event {index}" if index is not None else "")
        super().__init__(f"{where}: {reason}")
        self.source = source
        self.index = index
