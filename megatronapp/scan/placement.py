"""Where the trace commands (``align``, ``plot``, ``report``) put what they
make when no ``--out`` says: a run directory of this project takes its own
outputs (its manifest records them); a folder of anyone else's traces, or a
trace file, is never written into. Their outputs go to a new folder beside
that folder, ``NAME-megascan``, or in the current directory where its parent
is not writable."""
from __future__ import annotations

import os
from pathlib import Path

from megatronapp.io.outdirs import check_file, read_manifest

OUT_SUFFIX = "-megascan"
RUN_FILES = ("trace.parquet", "trace.json")  # what makes a directory one of our runs


def is_run_dir(folder: Path) -> bool:
    """A directory ``megatronapp run`` wrote (a result's manifest, or its trace)."""
    return folder.is_dir() and (read_manifest(folder) is not None
                                or any((folder / name).is_file() for name in RUN_FILES))


def home_of(target: Path) -> Path:
    """The folder a target lies in: itself, or a file's folder."""
    return target if target.is_dir() else target.parent


def default_outputs(target: Path) -> Path:
    """The folder a command's outputs about ``target`` go to by default."""
    home = home_of(Path(target))
    if is_run_dir(home):
        return home
    folder = home.resolve()
    beside = folder.parent
    where = beside if os.access(beside, os.W_OK | os.X_OK) else Path.cwd()
    return where / f"{folder.name or 'trace'}{OUT_SUFFIX}"


def check_folder(folder: Path, option: str = "--out") -> None:
    """Before any work: ``folder`` is there, or can be made (``outdirs.outputs_folder``
    makes it once there is something to put in it)."""
    if not folder.exists():
        check_file(folder, option)
