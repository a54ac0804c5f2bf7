"""Errors a user sees: printed by the CLI as one line, exit status 2.

Defined in the core so that backends and modules can raise them without
knowing the command line exists.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any


class Recreatable:
    """Mixin for an exception whose ``__init__`` composes its message: its
    ``args`` stay the arguments it was built with, so ``type(e)(*e.args)``
    builds it again (SimPy re-raises a process's failure that way) and so does
    pickling (a failure sent back from a worker process); ``str(e)`` is the
    composed message. Subclasses get this by defining ``__init__`` as usual."""

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        init = cls.__dict__.get("__init__")
        if init is not None:
            setattr(cls, "__init__", _keeping_args(init))

    def __str__(self) -> str:
        message = self.__dict__.get("message")
        return message if isinstance(message, str) else super().__str__()


def _keeping_args(init: Any) -> Any:
    """``init``, after which ``args`` are its own arguments (positional) and
    ``message`` is what the innermost base was given to print."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def keep_args(self: BaseException, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.__dict__.setdefault("message", BaseException.__str__(self))
        self.args = signature.bind(self, *args, **kwargs).args[1:]

    return keep_args


class UserError(Recreatable, Exception):
    """Bad input or a failed run the user can act on; the message is one line."""
