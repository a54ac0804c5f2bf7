"""Output files written whole or not at all.

A command writes into a hidden temporary beside its target and renames it into
place at the end; any failure (a full disk, a bad input found half-way, an
interrupt) removes the temporary, so nothing half-written is ever left where a
result would be. Where to write is checked before any work.
"""
from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .errors import UserError


def check_file_target(path: Path, option: str, make_parent: bool = False) -> None:
    """``path`` can become a file: not a directory, in a writable directory."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{option}: {path} is a directory; give a file name")
    parent = path.parent
    if make_parent and not parent.exists():
        try:
            parent.mkdir(parents=True)
        except OSError as err:
            raise UserError(f"{option}: cannot create {parent}: {err.strerror or err}") from None
    if not parent.is_dir():
        raise UserError(f"{option}: {parent} is not an existing directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{option}: {parent} is not writable")


def _partial(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial-{os.getpid()}")


@contextmanager
def atomic_file(path: Path, option: str, make_parent: bool = False) -> Iterator[Path]:
    """Yield a temporary path to write; it replaces ``path`` only on success.
    An OSError while writing or renaming is one line naming ``option``."""
    path = Path(path)
    check_file_target(path, option, make_parent)
    tmp = _partial(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise UserError(f"{option}: cannot write {path}: {err.strerror or err}") from None
        raise


@contextmanager
def staged_outputs(directory: Path, option: str) -> Iterator[Path]:
    """A hidden folder inside ``directory`` holding a folder of the same name
    (so code that titles plots by folder name still can); the files written
    there move into ``directory`` together at the end, or none do."""
    directory = Path(directory)
    check_file_target(directory / ".probe", option)
    stage = _partial(directory / ".outputs")
    inner = stage / (directory.resolve().name or "outputs")
    try:
        inner.mkdir(parents=True)
        yield inner
        for item in sorted(inner.iterdir()):
            os.replace(item, directory / item.name)
    except BaseException as err:
        if isinstance(err, OSError):
            raise UserError(f"{option}: cannot write into {directory}: "
                            f"{err.strerror or err}") from None
        raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
