"""Result directories that cannot destroy anything.

A result is written into a hidden staging directory beside its target and
renamed into place only when complete, so a half-written directory never
looks like a result. A result carries ``manifest.json`` listing the files it
wrote; only a directory holding such a manifest (and nothing else) may be
replaced, with ``force``, and replacing it removes exactly those files.
Nothing a run did not create is ever removed; staging directories of killed
runs are cleaned by the next run.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from .errors import UserError

MANIFEST = "manifest.json"
MANIFEST_KIND = "megatronapp result"
STAGING_MARKER = ".megatronapp-staging"  # holds the host name of the writing process
_PARTIAL = re.compile(r"^\.(?P<name>.+)\.partial-(?P<pid>\d+)(\.[A-Za-z0-9_]+)?$")


# ---------------------------------------------------------------- manifest
@dataclass(frozen=True)
class Manifest:
    """The files (relative POSIX paths) a result owns, its manifest aside."""

    files: tuple[str, ...]


def _safe_relative(rel: Any) -> bool:
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\0" in rel:
        return False
    return all(part not in ("", ".", "..") for part in rel.split("/"))


def read_manifest(run_dir: Path) -> Manifest | None:
    """The manifest of a previous result, or None if ``run_dir`` is not one."""
    path = Path(run_dir) / MANIFEST
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > 64 << 20:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("kind") != MANIFEST_KIND:
        return None
    files = data.get("files")
    if not isinstance(files, list) or not all(_safe_relative(f) for f in files):
        return None
    return Manifest(tuple(files))


def _write_manifest(run_dir: Path, files: Iterable[str]) -> None:
    tmp = run_dir / f".{MANIFEST}.partial-{os.getpid()}"
    tmp.write_text(json.dumps({"kind": MANIFEST_KIND, "files": sorted(set(files))}, indent=1))
    tmp.replace(run_dir / MANIFEST)


def _files_under(root: Path) -> Iterator[str]:
    """Relative paths of everything but directories under ``root`` (no symlink followed)."""
    for parent, dirs, files in os.walk(root):
        rel = Path(parent).relative_to(root)
        for name in files + [d for d in dirs if (Path(parent) / d).is_symlink()]:
            yield (rel / name).as_posix()


def record_outputs(run_dir: Path, paths: Sequence[Path]) -> None:
    """Add files a later command wrote into a result (plots, aligned traces) to
    its manifest, so that replacing the result takes them along."""
    manifest = read_manifest(run_dir)
    if manifest is None:
        return
    rels = [Path(p).relative_to(run_dir).as_posix() for p in paths
            if Path(p).parent.resolve() == Path(run_dir).resolve()]
    try:
        _write_manifest(Path(run_dir), [*manifest.files, *rels])
    except OSError as err:
        raise UserError(f"{run_dir}: cannot update {MANIFEST}: {err.strerror or err}") from None


# ------------------------------------------------------------ where to write
def _foreign_file(out: Path, manifest: Manifest) -> str | None:
    owned = set(manifest.files) | {MANIFEST}
    return next((rel for rel in _files_under(out) if rel not in owned), None)


def check_output(out: Path, force: bool = False, protect: Sequence[Path] = (),
                 option: str = "--out") -> Manifest | None:
    """Refuse, before any work, an output that could destroy something: the
    current directory or one of its parents, a directory holding ``protect``
    (the scenario file), a non-empty directory that is not a previous result,
    or a previous result without ``force``. Returns the previous result's
    manifest when ``force`` will replace it."""
    out = Path(out)
    target = out.resolve()
    cwd = Path.cwd().resolve()
    if target == cwd or target in cwd.parents:
        raise UserError(f"{option}: {out} is the current directory or one of its parents; "
                        "give a new directory for the result")
    for path in protect:
        if target in Path(path).resolve().parents:
            raise UserError(f"{option}: {out} holds {path}; give a new directory for the result")
    if out.is_symlink():
        raise UserError(f"{option}: {out} is a symbolic link; give a real directory")
    previous = None
    if out.exists():
        previous = _check_existing(out, force, option)
    _check_parent(out, option)
    return previous


def _check_existing(out: Path, force: bool, option: str) -> Manifest | None:
    if not out.is_dir():
        raise UserError(f"{option}: {out} exists and is not a directory")
    try:
        empty = next(out.iterdir(), None) is None
    except OSError as err:
        raise UserError(f"{option}: cannot list {out}: {err.strerror or err}") from None
    if empty:
        return None
    previous = read_manifest(out)
    if previous is None:
        raise UserError(f"{option}: {out} is not empty and is not a megatronapp result "
                        f"(no {MANIFEST}); give a new directory")
    if not force:
        raise UserError(f"{option}: {out} holds a previous result; pass --force to replace "
                        "it, or give a new directory")
    foreign = _foreign_file(out, previous)
    if foreign is not None:
        raise UserError(f"{option}: {out} holds files the previous result did not write "
                        f"(e.g. {foreign}); move them away before replacing it")
    return previous


def _check_parent(out: Path, option: str) -> None:
    """The nearest existing ancestor is a writable directory (nothing is created yet)."""
    existing = next(p for p in (out.parent.absolute(), *out.parent.absolute().parents)
                    if p.exists() or p.is_symlink())
    if not existing.is_dir():
        raise UserError(f"{option}: {existing} exists and is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{option}: {existing} is not writable")


def _make_parents(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; return those created, deepest first."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    return missing


def _remove_if_empty(folders: Iterable[Path]) -> None:
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


# ------------------------------------------------------- staging, publishing
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def staged_siblings(out: Path) -> list[Path]:
    """The hidden directories runs are being written into before they become
    ``out`` (more than one only when an earlier run was killed)."""
    out = Path(out)
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return []
    return sorted(e for e in entries if e.is_dir() and not e.is_symlink()
                  and (m := _PARTIAL.match(e.name)) is not None and m["name"] == out.name)


def clean_leftovers(parent: Path) -> list[Path]:
    """Remove staging directories of runs that were killed (their process is
    gone): only ours, recognised by name, marker and this host's name."""
    removed: list[Path] = []
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _PARTIAL.match(entry.name)
        if not match or entry.is_symlink() or not entry.is_dir():
            continue
        pid = int(match["pid"])
        if pid == os.getpid() or _pid_alive(pid) or not _staged_here(entry):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def _staged_here(entry: Path) -> bool:
    try:
        host = (entry / STAGING_MARKER).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return read_manifest(entry) is not None and not (entry / STAGING_MARKER).exists()
    return host == socket.gethostname()


def _remove_result(out: Path, manifest: Manifest) -> None:
    """Delete exactly the files a previous result listed, then its empty folders."""
    root = out.resolve()
    folders: set[Path] = set()
    for rel in (*manifest.files, MANIFEST):
        path = out / rel
        if root not in path.parent.resolve().parents and path.parent.resolve() != root:
            continue  # a listed path that leaves the result (a symlinked folder): not ours
        if path.is_symlink() or path.is_file():
            path.unlink()
        folders.update(p for p in Path(rel).parents if p != Path("."))
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        try:
            (out / folder).rmdir()
        except OSError:
            pass  # not empty: something else lives there


APPEARED = "appeared while this run was writing (another run finishing into it?); nothing " \
           "was replaced"


def _nonempty(path: Path) -> bool:
    return path.is_dir() and next(path.iterdir(), None) is not None


def publish(tmp: Path, out: Path, force: bool = False, was_there: bool = True) -> None:
    """Rename the finished ``tmp`` to ``out``; never over anything but an empty
    directory or (with ``force``) a previous result, whose own files go first.
    ``was_there``: whether ``out`` held something when the run started."""
    try:
        _write_manifest(tmp, [rel for rel in _files_under(tmp) if rel != STAGING_MARKER])
        (tmp / STAGING_MARKER).unlink()
        if out.is_symlink() or (not was_there and (_nonempty(out) or out.is_file())):
            raise UserError(f"--out: {out} {APPEARED}")
        previous = _check_existing(out, force, "--out") if out.exists() else None
        if previous is not None:
            _remove_result(out, previous)
        os.rename(tmp, out)
    except OSError as err:
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise UserError(f"--out: {out} {APPEARED}") from None
        raise UserError(f"--out: cannot write {out}: {err.strerror or err}") from None


@contextmanager
def staged_dir(out: Path, force: bool = False) -> Iterator[Path]:
    """Write into a hidden sibling; it becomes ``out`` only if all went well.
    Any exception (an interrupt included) removes the staging directory; an
    OSError while publishing is one line naming ``out``."""
    out = Path(out)
    was_there = out.is_symlink() or out.is_file() or _nonempty(out)
    if was_there:  # refuse now what publishing would refuse at the end
        check_output(out, force)
    tmp: Path | None = None
    created: list[Path] = []
    try:  # .NAME.partial-PID.XXXX: hidden, and its process is known
        created = _make_parents(out.parent)
        clean_leftovers(out.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}.",
                                    dir=out.parent))
        (tmp / STAGING_MARKER).write_text(socket.gethostname())
    except OSError as err:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        _remove_if_empty(created)
        raise UserError(f"--out: cannot write {out}: {err.strerror or err}") from None
    try:
        yield tmp
        publish(tmp, out, force, was_there)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_if_empty(created)
        raise
