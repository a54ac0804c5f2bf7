"""The one writer: every command's output, and every delete, goes through here.

A command checks its destination before any work, writes into a hidden
staging folder beside it (``.NAME.partial-PID.XXXX``, marked by a
``.megatronapp-staging`` file holding JSON with kind, pid, host and target)
and renames the finished output into place. Nothing is replaced that this
project did not write unless ``force`` says so, and a command never writes
over its own inputs.

Result directories carry ``manifest.json``: ``files`` a run wrote, ``added``
files later commands (plots, exports) put beside them. With ``force`` a
previous result is renamed into a marked trash folder, the new one renamed
into place, and only then is the trash deleted; a failed publish renames the
old result back. ``discard`` is the only delete in the code base and removes
only what lies in a folder carrying the marker; leftovers of killed commands
(their process gone, this host) are discarded by the next command.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import stat
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from ..errors import UserError
from .gate import NAME_MAX, read_json, shown

MANIFEST = "manifest.json"
MANIFEST_KIND = "megatronapp result"
STAGING_MARKER = ".megatronapp-staging"
MARKER_KIND = "megatronapp staging"
PID_MAX = 1 << 22  # the largest pid Linux hands out


# ------------------------------------------------------------- path errors

@contextmanager
def path_errors(option: str, path: Path) -> Iterator[None]:
    """Whatever the file system says about ``path`` (a name too long, a
    symbolic-link loop, no permission) is one line naming ``option``."""
    try:
        yield
    except OSError as err:
        raise UserError(f"{option}: {shown(err.filename or path)}: "
                        f"{err.strerror or err}") from None
    except RuntimeError as err:  # Path.resolve on a symbolic-link loop (Python < 3.13)
        raise UserError(f"{option}: {shown(path)}: {err}") from None


# ---------------------------------------------------------------- manifest
@dataclass(frozen=True)
class Manifest:
    """The files (relative POSIX paths) a result owns, its manifest aside:
    those its run wrote, and those later commands added."""

    files: tuple[str, ...]
    added: tuple[str, ...] = ()

    @property
    def owned(self) -> set[str]:
        return {*self.files, *self.added, MANIFEST}


def _safe_relative(rel: Any) -> bool:
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\0" in rel:
        return False
    return all(part not in ("", ".", "..") for part in rel.split("/"))


def _read_small_json(path: Path, limit: int) -> Any:
    """The JSON of a small regular file, or None (a link, too big, unreadable, not JSON)."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > limit:
            return None
        return read_json(path, "", limit)
    except (OSError, ValueError):  # a TextError is a ValueError
        return None


def read_manifest(run_dir: Path) -> Manifest | None:
    """The manifest of a previous result, or None if ``run_dir`` is not one."""
    data = _read_small_json(Path(run_dir) / MANIFEST, 64 << 20)
    if not isinstance(data, dict) or data.get("kind") != MANIFEST_KIND:
        return None
    files, added = _paths(data.get("files")), _paths(data.get("added", []))
    return None if files is None or added is None else Manifest(files, added)


def _paths(value: Any) -> tuple[str, ...] | None:
    """A list of safe relative paths, or None."""
    if not isinstance(value, list) or not all(_safe_relative(v) for v in value):
        return None
    return tuple(value)


def _write_manifest(run_dir: Path, manifest: Manifest, scratch: Path) -> None:
    """Written in the marked folder ``scratch`` and renamed over: a reader sees
    the old manifest or the new, and a failure leaves nothing in ``run_dir``."""
    tmp = scratch / f".{MANIFEST}.partial"
    tmp.write_text(json.dumps({"kind": MANIFEST_KIND, "files": sorted(set(manifest.files)),
                               "added": sorted(set(manifest.added))}, indent=1))
    os.replace(tmp, run_dir / MANIFEST)


def _walk(root: Path) -> Iterator[tuple[str, list[str], list[str]]]:
    """os.walk that raises on a folder it cannot list instead of skipping it;
    symbolic links to folders count as files (never followed)."""
    def fail(err: OSError) -> None:
        raise err

    for parent, dirs, files in os.walk(root, onerror=fail):
        links = [d for d in dirs if (Path(parent) / d).is_symlink()]
        dirs[:] = [d for d in dirs if d not in links]
        yield Path(parent).relative_to(root).as_posix(), dirs, files + links


def _files_under(root: Path) -> Iterator[str]:
    for rel, _dirs, files in _walk(root):
        yield from (name if rel == "." else f"{rel}/{name}" for name in files)


def _foreign_entry(out: Path, manifest: Manifest) -> str | None:
    """The first file or folder under ``out`` that the result does not own
    (leftovers of our own killed commands aside: they go with the result)."""
    owned = manifest.owned
    folders = {str(p.as_posix()) for rel in owned for p in Path(rel).parents} - {"."}
    for rel, dirs, files in _walk(out):
        prefix = "" if rel == "." else rel + "/"
        for name in list(dirs):
            if _is_leftover(out / prefix / name):
                dirs.remove(name)
            elif prefix + name not in folders:
                return prefix + name + "/"
        for name in files:
            if prefix + name not in owned:
                return prefix + name
    return None


# ------------------------------------------------------------------ marker
def _marker_data(kind: str, target: str) -> dict[str, Any]:
    return {"kind": MARKER_KIND, "use": kind, "pid": os.getpid(),
            "host": socket.gethostname(), "target": target}


def _mark(folder: Path, kind: str, target: str) -> None:
    (folder / STAGING_MARKER).write_text(json.dumps(_marker_data(kind, target)))


def own_folder(folder: Path) -> Path:
    """Create ``folder`` (and its parents) as a working folder of this project
    that ``discard`` may remove: marked once, by whichever process of a run
    gets there first (an existing marker is kept whole)."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(folder / STAGING_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return folder
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(_marker_data("work", folder.name)))
    return folder


@contextmanager
def scratch_folder(prefix: str) -> Iterator[Path]:
    """A private folder (mode 0700, in the system's temporary directory) of this
    process alone, marked as ours and discarded however the block ends."""
    folder = own_folder(Path(tempfile.mkdtemp(prefix=prefix)))
    try:
        yield folder
    finally:
        discard(folder)


def _marker(folder: Path) -> dict[str, Any] | None:
    data = _read_small_json(folder / STAGING_MARKER, 1 << 16)
    if not isinstance(data, dict) or data.get("kind") != MARKER_KIND:
        return None
    if type(data.get("pid")) is not int or not isinstance(data.get("host"), str):
        return None
    return data


def _pid_alive(pid: int) -> bool:
    if not 0 < pid <= PID_MAX:
        return False  # no such process can exist
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def _is_leftover(entry: Path) -> bool:
    """A marked folder of a command on this host whose process is gone."""
    if entry.is_symlink() or not entry.is_dir():
        return False
    marker = _marker(entry)
    return (marker is not None and marker["host"] == socket.gethostname()
            and marker["pid"] != os.getpid() and not _pid_alive(marker["pid"]))


def _stage_prefix(target: str, use: str) -> str:
    """``.TARGET.USE-PID.``: hidden, and short enough that mkdtemp's random
    tail still fits one path component whatever the target's length."""
    tail = f".{use}-{os.getpid()}."
    room = NAME_MAX - 1 - len(tail.encode()) - 8  # the leading dot; mkdtemp's 8 characters
    name = target.encode("utf-8", "surrogateescape")[:room].decode("utf-8", "ignore")
    return f".{name}{tail}"


def _marked_dir(parent: Path, target: str, use: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix=_stage_prefix(target, use), dir=parent))
    try:
        _mark(folder, use, target)
    except BaseException:
        folder.rmdir()  # just made by mkdtemp, and empty
        raise
    return folder


# ------------------------------------------------------------------ delete
def _marked_owner(path: Path) -> Path | None:
    for folder in (path, *path.parents):
        if folder.is_dir() and not folder.is_symlink() and _marker(folder) is not None:
            return folder
    return None


def discard(path: Path) -> None:
    """The one way anything is deleted: ``path`` (a file, or a folder with
    everything in it) only if it lies in a folder this project marked as its
    own; anything else is refused. Missing is fine."""
    path = Path(path).absolute()
    if not (path.exists() or path.is_symlink()):
        return
    if _marked_owner(path) is None:
        raise UserError(f"refusing to delete {shown(path)}: not in a folder megatronapp "
                        "marked as its own")
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, onerror=_make_writable_and_retry)
    else:
        path.unlink()


def _make_writable_and_retry(func: Callable[..., Any], name: str, _exc: Any) -> None:
    """A read-only folder inside our own marked folder: make it writable, retry once."""
    parent = Path(name).parent
    try:
        parent.chmod(parent.stat().st_mode | stat.S_IWUSR | stat.S_IXUSR)
        func(name)
    except OSError:
        pass  # stays, marked: the next command tries again


def clean_leftovers(parent: Path) -> list[Path]:
    """Discard the staging and trash folders of commands that were killed
    (marker present, this host, process gone); nothing else is touched."""
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return []
    removed = [e for e in entries if e.name.startswith(".") and _is_leftover(e)]
    for entry in removed:
        _recover(entry)
        discard(entry)
    return removed


def _recover(leftover: Path) -> None:
    """A command killed while publishing left what it was replacing in its
    marked folder: put it back where it was, wherever that place is free."""
    marker = _marker(leftover) or {}
    moved = ([(leftover / "old", leftover.parent / str(marker.get("target")))]
             if marker.get("use") == "trash" else
             [(f, leftover.parent / f.name) for f in _entries(leftover / "replaced")])
    for src, dst in moved:
        if (src.exists() or src.is_symlink()) and not (dst.exists() or dst.is_symlink()):
            os.rename(src, dst)


def _entries(folder: Path) -> list[Path]:
    return list(folder.iterdir()) if folder.is_dir() else []


def staged_siblings(out: Path) -> list[Path]:
    """The hidden folders runs are being written into before they become
    ``out`` (more than one only when an earlier run was killed)."""
    out = Path(out)
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return []
    return sorted(e for e in entries if e.name.startswith(".") and e.is_dir()
                  and not e.is_symlink() and (m := _marker(e)) is not None
                  and m.get("use") == "partial" and m.get("target") == out.name)


# ------------------------------------------------------------ where to write
def check_output(out: Path, force: bool = False, protect: Sequence[Path] = (),
                 option: str = "--out") -> Manifest | None:
    """Refuse, before any work, an output folder that could destroy something:
    the current directory or one of its parents, a directory holding
    ``protect`` (the scenario file), a non-empty directory that is not a
    previous result, a result holding files it does not own, or a previous
    result without ``force``. Returns the manifest ``force`` will replace."""
    out = Path(out)
    with path_errors(option, out):
        target = out.resolve()
        cwd = Path.cwd().resolve()
        if target == cwd or target in cwd.parents:
            raise UserError(f"{option}: {shown(out)} is the current directory or one of its "
                            "parents; give a new directory for the result")
        for path in protect:
            if target in Path(path).resolve().parents:
                raise UserError(f"{option}: {shown(out)} holds {path}; give a new directory "
                                "for the result")
        if out.is_symlink():
            raise UserError(f"{option}: {shown(out)} is a symbolic link; give a real directory")
        previous = _check_existing(out, force, option) if out.exists() else None
        _check_parent(out, option)
    return previous


def _check_existing(out: Path, force: bool, option: str) -> Manifest | None:
    if not out.is_dir():
        raise UserError(f"{option}: {shown(out)} exists and is not a directory")
    with path_errors(option, out):
        if all(_is_leftover(e) for e in out.iterdir()):
            return None  # empty, or only our killed commands' leftovers
        previous = read_manifest(out)
        if previous is None:
            raise UserError(f"{option}: {shown(out)} is not empty and is not a megatronapp "
                            f"result (no {MANIFEST}); give a new directory")
        if not force:
            raise UserError(f"{option}: {shown(out)} holds a previous result; pass --force to "
                            "replace it, or give a new directory")
        foreign = _foreign_entry(out, previous)
    if foreign is not None:
        raise UserError(f"{option}: {shown(out)} holds files the previous result did not write "
                        f"(e.g. {foreign}); move them away before replacing it")
    return previous


def _check_parent(out: Path, option: str) -> None:
    """The nearest existing ancestor is a writable directory (nothing is created yet)."""
    existing = next(p for p in (out.parent.absolute(), *out.parent.absolute().parents)
                    if p.exists() or p.is_symlink())
    if not existing.is_dir():
        raise UserError(f"{option}: {shown(existing)} exists and is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{option}: {shown(existing)} is not writable")


def _make_parents(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; return those created, deepest first."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    return missing


def _remove_if_empty(folders: Iterable[Path]) -> None:
    for folder in folders:
        try:
            folder.rmdir()  # only empty folders this command created
        except OSError:
            return


# ------------------------------------------------ publishing a result folder
APPEARED = "appeared while this run was writing (another run finishing into it?); nothing " \
           "was replaced"


def _move_aside(out: Path) -> Path:
    """Rename ``out`` into a new marked trash folder beside it; returns the trash."""
    trash = _marked_dir(out.parent, out.name, "trash")
    os.rename(out, trash / "old")
    return trash


def _restore(trash: Path, out: Path, option: str, reason: str) -> UserError:
    """Rename the old result back; if that fails too, unmark the trash so that
    nothing ever deletes it, and say where it is."""
    try:
        os.rename(trash / "old", out)
    except OSError:
        discard(trash / STAGING_MARKER)  # unmarked: never deleted
        return UserError(f"{option}: {shown(out)}: {reason}; the previous result is kept "
                         f"in {shown(trash / 'old')}")
    discard(trash)
    return UserError(f"{option}: {shown(out)}: {reason}; the previous result is unchanged")


def _reason(err: OSError) -> str:
    if err.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
        return APPEARED
    return f"cannot write: {err.strerror or err}"


def publish(tmp: Path, out: Path, force: bool = False, was_there: bool = True,
            option: str = "--out") -> None:
    """Rename the finished, marked ``tmp`` to ``out``; a previous result goes
    to a trash folder first and is deleted only once the new one is in place.
    ``was_there``: whether ``out`` held something when the command started."""
    with path_errors(option, out):
        _write_manifest(tmp, Manifest(tuple(r for r in _files_under(tmp) if r != STAGING_MARKER)),
                        tmp)
        if out.is_symlink() or (not was_there and out.exists() and not _only_leftovers(out)):
            raise UserError(f"{option}: {shown(out)} {APPEARED}")
        previous = _check_existing(out, force, option) if out.exists() else None
        trash = _move_aside(out) if previous is not None or _nonempty(out) else None
    try:
        discard(tmp / STAGING_MARKER)
        os.rename(tmp, out)
    except BaseException as err:  # an interrupt too: the old result goes back
        _mark(tmp, "partial", out.name)
        reason = _reason(err) if isinstance(err, OSError) else "interrupted"
        restored = None if trash is None else _restore(trash, out, option, reason)
        if not isinstance(err, OSError):
            raise
        raise restored or UserError(f"{option}: {shown(out)} {reason}") from None
    if trash is not None:
        discard(trash)


def _nonempty(out: Path) -> bool:
    return out.is_dir() and next(out.iterdir(), None) is not None


def _only_leftovers(out: Path) -> bool:
    return out.is_dir() and all(_is_leftover(e) for e in out.iterdir())


@contextmanager
def staged_dir(out: Path, force: bool = False, option: str = "--out") -> Iterator[Path]:
    """Write into a marked hidden sibling; it becomes ``out`` only if all went
    well. Any exception (an interrupt included) discards the staging folder;
    an OSError while publishing is one line naming ``out``."""
    out = Path(out)
    check_output(out, force, option=option)
    with path_errors(option, out):
        was_there = out.is_symlink() or out.exists() and not _only_leftovers(out)
    tmp: Path | None = None
    created: list[Path] = []
    try:
        created = _make_parents(out.parent)
        clean_leftovers(out.parent)
        tmp = _marked_dir(out.parent, out.name, "partial")
    except OSError as err:
        _remove_if_empty(created)
        raise UserError(f"{option}: cannot write {shown(out)}: {err.strerror or err}") from None
    try:
        yield tmp
        publish(tmp, out, force, was_there, option)
    except BaseException:
        discard(tmp)
        _remove_if_empty(created)
        raise


def remove_result(run_dir: Path, option: str) -> None:
    """Delete a previous result that holds nothing it does not own: moved
    into a marked trash folder, then discarded."""
    with path_errors(option, run_dir):
        _check_existing(run_dir, True, option)
        discard(_move_aside(run_dir))


# ------------------------------------------------------------ single files
@dataclass(frozen=True)
class _InResult:
    """A path inside a result folder: the folder, its manifest, the path's name there."""

    root: Path
    manifest: Manifest
    rel: str


def _result_of(path: Path) -> _InResult | None:
    """The nearest folder above ``path`` that is a result, if any."""
    path = path.absolute()
    for folder in path.parents:
        manifest = read_manifest(folder)
        if manifest is not None:
            return _InResult(folder, manifest, path.relative_to(folder).as_posix())
    return None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except (OSError, RuntimeError):
        return False


def _check_replaceable(path: Path, option: str, force: bool, inputs: Sequence[Path]) -> None:
    """``path`` may be written: never one of the command's inputs or a file
    of the run a result holds; an existing file only if a later command of
    ours added it to the result, or with ``force``."""
    if any(_same_file(path, Path(i)) for i in inputs):
        raise UserError(f"{option}: {shown(path)} is an input of this command; give another "
                        "file name")
    result = _result_of(path)
    if result is not None and result.rel in {*result.manifest.files, MANIFEST}:
        raise UserError(f"{option}: {shown(path)} is part of the result in "
                        f"{shown(result.root)}; give another file name")
    if path.is_dir() and not path.is_symlink():
        raise UserError(f"{option}: {shown(path)} is a directory; give a file name")
    ours = result is not None and result.rel in result.manifest.added
    if (path.exists() or path.is_symlink()) and not (ours or force):
        raise UserError(f"{option}: {shown(path)} exists and megatronapp did not write it; "
                        "pass --force to replace it, or give another file name")


def check_file(path: Path, option: str, force: bool = False, inputs: Sequence[Path] = (),
               make_parent: bool = False) -> None:
    """Before any work: ``path`` can become a file (see ``_check_replaceable``)
    in a writable directory (created with ``make_parent``)."""
    path = Path(path)
    with path_errors(option, path):
        _check_replaceable(path, option, force, inputs)
        if make_parent and not path.parent.exists():
            path.parent.mkdir(parents=True)
        _check_folder(path.parent, option)
        # a folder may pass os.access (as root it does) and still refuse a new entry
        # (/proc, a read-only mount): stage and discard one now, before the work
        discard(_marked_dir(path.parent, path.name, "probe"))


def _check_folder(folder: Path, option: str) -> None:
    if not folder.is_dir():
        raise UserError(f"{option}: {shown(folder)} is not an existing directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"{option}: {shown(folder)} is not writable")


@contextmanager
def staged_outputs(directory: Path, option: str, force: bool = False,
                   inputs: Sequence[Path] = ()) -> Iterator[Path]:
    """A marked hidden folder inside ``directory`` holding a folder of the
    same name (so code that titles plots by folder name still can); the files
    written there move into ``directory`` together at the end, or none do.
    Files put into a result are added to its manifest."""
    directory = Path(directory)
    with path_errors(option, directory):
        _check_folder(directory, option)
        clean_leftovers(directory)
        stage = _marked_dir(directory, "outputs", "partial")
    inner = stage / (directory.resolve().name or "outputs")
    try:
        inner.mkdir()
        yield inner
        _publish_files(inner, directory, option, force, inputs)
    except OSError as err:  # while writing (a full disk): nothing was published
        raise UserError(f"{option}: cannot write into {shown(directory)}: "
                        f"{err.strerror or err}") from None
    finally:
        if _marker(stage) is not None:  # unmarked: it holds what could not be put back
            discard(stage)


@contextmanager
def new_file(path: Path, option: str, force: bool = False, inputs: Sequence[Path] = (),
             make_parent: bool = False) -> Iterator[Path]:
    """Yield a temporary path to write; it becomes ``path`` only on success
    (see ``staged_outputs``)."""
    path = Path(path)
    check_file(path, option, force, inputs, make_parent)
    with staged_outputs(path.parent, option, force, inputs) as folder:
        yield folder / path.name


def _publish_files(folder: Path, directory: Path, option: str, force: bool,
                   inputs: Sequence[Path]) -> None:
    """Move every file of ``folder`` into ``directory``: all are checked
    first, replaced files go aside into the staging folder, and any failure
    puts everything back as it was."""
    names = sorted(p.name for p in folder.iterdir())
    with path_errors(option, directory):
        for name in names:
            _check_replaceable(directory / name, option, force, inputs)
    aside, placed, touched = folder.parent / "replaced", [], []
    try:
        aside.mkdir()
        for name in names:
            touched.append(name)
            if (directory / name).exists() or (directory / name).is_symlink():
                os.rename(directory / name, aside / name)
            os.rename(folder / name, directory / name)
            placed.append(name)
        _record(directory, names, folder.parent)
    except BaseException as err:  # an interrupt too: every file goes back
        undone = _put_back(folder, directory, aside, touched, placed)
        if not isinstance(err, OSError):
            raise
        reason = f"{option}: cannot write into {shown(directory)}: {err.strerror or err}"
        raise UserError(f"{reason}; {undone}") from None


def _put_back(folder: Path, directory: Path, aside: Path, touched: list[str],
              placed: list[str]) -> str:
    """Undo a part-way publish; if even that fails, unmark the staging folder
    so that the files set aside there are never deleted, and say where."""
    try:
        for name in reversed(touched):
            if name in placed:
                os.rename(directory / name, folder / name)
            if (aside / name).exists() or (aside / name).is_symlink():
                os.rename(aside / name, directory / name)
    except OSError:
        discard(folder.parent / STAGING_MARKER)
        return f"the replaced files are kept in {shown(aside)}"
    return "nothing was changed"


def _record(directory: Path, names: Sequence[str], scratch: Path) -> None:
    """Files a later command wrote into a result join its manifest's
    ``added``, so that replacing the result takes them along. Read, added to
    and written under the result folder's lock: commands adding files to one
    result at once each keep theirs."""
    found = _result_of(directory / "-")
    if found is None:
        return
    with _locked(found.root):
        result = _result_of(directory / "-")  # again, under the lock: another may have added
        if result is None:
            return
        rels = [Path(result.rel).with_name(n).as_posix() for n in names]
        _write_manifest(result.root, Manifest(result.manifest.files,
                                              (*result.manifest.added, *rels)), scratch)


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """An exclusive lock on ``folder`` itself (its inode stays while its
    manifest is replaced), released however the block ends."""
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def rename_fresh(src: Path, dst: Path) -> None:
    """Rename ``src`` to a name that does not exist yet (a file written beside
    its final name, so a reader never sees it half-written); never a replace."""
    if dst.exists() or dst.is_symlink():
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


def add_force_option(parser: Any, replaced: str = "an existing output file") -> None:
    """``--force``: the one flag by which a command may replace what is there."""
    parser.add_argument("--force", action="store_true",
                        help=f"replace {replaced} (it is deleted only once the new one is in "
                             "place; a command's own inputs are never replaced)")


def outputs_folder(folder: Path, option: str) -> Path:
    """A folder for a command's outputs, made with an empty manifest when it
    is not there yet, so that what commands put there is recorded as this
    project's (and the next run of the command may replace it)."""
    folder = Path(folder)
    with path_errors(option, folder):
        if folder.exists() or folder.is_symlink():
            return folder
        created = _make_parents(folder.parent)
        try:
            folder.mkdir()
            (folder / MANIFEST).write_text(json.dumps({"kind": MANIFEST_KIND, "files": [],
                                                       "added": []}, indent=1))
        except OSError:
            _remove_if_empty([folder, *created])
            raise
    return folder
