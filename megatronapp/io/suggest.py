"""Suggestions for mistyped names: "did you mean", and the valid choices.

Everything a user types that must match a known name (a scenario key, a fault
or perturbation kind, a schedule) goes through here, so the hint reads the
same everywhere.
"""
from __future__ import annotations

import difflib
import re
from typing import Iterable

_QUOTED = re.compile(r"'([^']*)'")


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice ``word`` abbreviates (the only one it begins, ignoring case:
    ``h100`` is ``h100-sxm``, not the more similar ``h200``), else the choice
    most like it (difflib's ratio of at least 0.6), if any."""
    names = list(choices)
    extended = [c for c in names if c.lower().startswith(word.lower()) and word]
    if len(extended) == 1:
        return extended[0]
    matches = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    return matches[0] if matches else None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` or the empty string."""
    best = closest(word, choices)
    return f" (did you mean {best!r}?)" if best is not None else ""


def quoted_names(text: str) -> list[str]:
    """The names in pydantic's ``"'a', 'b' or 'c'"`` lists of expected values."""
    return _QUOTED.findall(text)


def hint(word: str, choices: Iterable[str], what: str = "choices") -> str:
    """``did you mean`` when one is close, else the list of valid choices."""
    names = list(choices)
    best = closest(word, names)
    if best is not None:
        return f"did you mean {best!r}?"
    return f"{what}: {', '.join(names)}"
