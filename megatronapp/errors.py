"""Errors a user sees: printed by the CLI as one line, exit status 2.

Defined in the core so that backends and modules can raise them without
knowing the command line exists.
"""
from __future__ import annotations


class UserError(Exception):
    """Bad input or a failed run the user can act on; the message is one line."""
