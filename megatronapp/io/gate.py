"""Every path a command reads passes through here first: the input gate.

Before anything opens a path, ``checked`` looks at it: every component's name
within what the file system allows, symbolic links resolved (a loop is one
line) and the target checked again by ``stat``: a regular file (or, where a
folder is asked for, a folder), never a FIFO, a device or a socket, which
would hang a reader or feed it without end, and a file no larger than the
cap. ``open_checked`` then opens the resolved path without following a link
swapped in meanwhile and without blocking, and checks the opened file once
more (``fstat``); ``read_input`` reads at most the cap, and a gzip file is
inflated a chunk at a time, given up past a size cap and past a ratio (a
small file that inflates to gigabytes is a bomb, not a trace).

Every refusal is an ``InputError``: one line naming what was read and why.
It is a ``TextError`` (callers that turn text errors into their own keep
doing so) and a ``UserError`` (the command line prints it, exit status 2).
"""
from __future__ import annotations

import math
import os
import stat
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Literal

from ..errors import UserError
from .text import TextError, decode_utf8, load_json_bytes

NAME_MAX = 255  # bytes in one path component (Linux, macOS)
PATH_MAX = 4095  # bytes in a whole path (Linux's PATH_MAX less its terminating zero)
READ_CHUNK = 1 << 20
CAP_NOTE = ", the most this command reads"
MAX_TEXT_BYTES = 64 << 20  # a scenario, a spec, a side file's YAML or JSON: far beyond ours
# Inflating: a trace's JSON compresses 5-30x; past MAX_RATIO (after the first
# RATIO_FLOOR bytes, where tiny files of zeros are fine) it is a bomb.
MAX_RATIO = 200
RATIO_FLOOR = 64 << 20
_SHOWN = 160  # characters of a path a message shows

Kind = Literal["file", "dir", "any"]
EMPTY = Path(os.devnull)


class InputError(TextError, UserError):
    """A path a command may not read as given (one line, exit status 2)."""

    def reason(self, path: Path | str) -> str:
        """The message without the path it starts with (for callers that name it their way)."""
        return str(self).removeprefix(shown(path)).lstrip(": ")


def shown(path: Path | str) -> str:
    text = str(path)
    return text if len(text) <= _SHOWN else text[:_SHOWN // 2] + "..." + text[-_SHOWN // 2:]


def readable_bytes(n: float) -> str:
    """Bytes in the largest unit that keeps the number readable."""
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _head(what: str, path: Path | str) -> str:
    """How a message names the input: the option or field, then the path."""
    return f"{what}: {shown(path)}" if what else shown(path)


def check_names(path: Path | str, what: str) -> None:
    """Each component of ``path`` within ``NAME_MAX`` bytes, the whole within ``PATH_MAX``."""
    raw = os.fsencode(str(path))
    if b"\0" in raw:
        raise InputError(f"{_head(what, path)}: a path cannot hold a NUL byte")
    if len(raw) > PATH_MAX:
        raise InputError(f"{what or 'a path'}: {len(raw):,} bytes long; the file system takes "
                         f"at most {PATH_MAX:,}")
    longest = max(raw.split(b"/"), key=len)
    if len(longest) > NAME_MAX:
        raise InputError(f"{_head(what, path)}: a name of {len(longest):,} bytes; the file "
                         f"system takes at most {NAME_MAX} in one name")


def _kind_of(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a regular file"


def _check_stat(st: os.stat_result, path: Path | str, what: str, kind: Kind,
                max_bytes: float, target: Path | None = None, why: str = "") -> None:
    """``st`` (of ``path``, or of the ``target`` its links lead to) is ``kind``
    and within ``max_bytes``."""
    head = _head(what, path)
    if target is not None and str(target) != str(Path(path).absolute()):
        head += f" (a link to {shown(target)})"
    is_file, is_dir = stat.S_ISREG(st.st_mode), stat.S_ISDIR(st.st_mode)
    wanted = {"file": ("a regular file", is_file), "dir": ("a folder", is_dir),
              "any": ("a file or a folder", is_file or is_dir)}[kind]
    if not wanted[1]:
        raise InputError(f"{head} is {_kind_of(st.st_mode)}, not {wanted[0]}")
    if is_file and st.st_size > max_bytes:
        raise InputError(f"{head} is {readable_bytes(st.st_size)}, more than "
                         f"{readable_bytes(max_bytes)}{why or CAP_NOTE}")


def _resolve(path: Path, what: str) -> Path:
    try:
        return path.resolve(strict=True)
    except FileNotFoundError:
        raise InputError(f"{_head(what, path)}: no such file or folder") from None
    except RuntimeError:  # Python < 3.13: a symbolic-link loop
        raise InputError(f"{_head(what, path)}: a loop of symbolic links") from None
    except OSError as err:
        raise InputError(f"{_head(what, path)}: {err.strerror or err}") from None


def checked(path: Path | str, what: str, kind: Kind = "file",
            max_bytes: float = math.inf, why: str = "") -> Path:
    """``path`` resolved, after checking its names, what it is and its size
    (``/dev/null`` is an empty file, as every tool takes it)."""
    check_names(path, what)
    resolved = _resolve(Path(path), what)
    check_names(resolved, what)
    if resolved == EMPTY and kind != "dir":
        return resolved
    try:
        st = os.stat(resolved)
    except OSError as err:
        raise InputError(f"{_head(what, path)}: {err.strerror or err}") from None
    _check_stat(st, path, what, kind, max_bytes, resolved, why)
    return resolved


def names_fit(path: Path | str) -> bool:
    """Whether ``path`` could name a file at all (text given where a path or an
    inline value may go: a long value is never taken for a path)."""
    raw = os.fsencode(str(path))
    return (0 < len(raw) <= PATH_MAX and b"\0" not in raw
            and max(len(part) for part in raw.split(b"/")) <= NAME_MAX)


def exists(path: Path | str, what: str, kind: Kind = "file") -> bool:
    """Whether ``path`` is there as ``kind`` (False when absent); present but
    something else (a FIFO where a file is read, a name too long) is refused."""
    check_names(path, what)
    if not (os.path.lexists(path)):
        return False
    checked(path, what, kind)
    return True


@contextmanager
def open_checked(path: Path | str, what: str, max_bytes: float = math.inf,
                 why: str = "") -> Iterator[BinaryIO]:
    """A checked regular file, opened for reading in binary."""
    resolved = checked(path, what, "file", max_bytes, why)
    if resolved == EMPTY:
        with open(EMPTY, "rb") as empty:
            yield empty
        return
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(resolved, flags)
    except OSError as err:
        raise InputError(f"{_head(what, path)}: {err.strerror or err}") from None
    try:
        _check_stat(os.fstat(fd), path, what, "file", max_bytes, resolved, why)  # what was opened, not named
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as fh:
        yield fh


def _read_at_most(fh: BinaryIO, path: Path | str, what: str, max_bytes: float,
                  why: str = CAP_NOTE) -> bytes:
    chunks, size = [], 0
    while chunk := fh.read(READ_CHUNK):
        size += len(chunk)
        if size > max_bytes:
            raise InputError(f"{_head(what, path)} holds more than "
                             f"{readable_bytes(max_bytes)}{why}")
        chunks.append(chunk)
    return b"".join(chunks)


def inflate(fh: BinaryIO, path: Path | str, what: str, max_bytes: float,
            max_ratio: float = MAX_RATIO, why: str = CAP_NOTE) -> bytes:
    """A gzip (or zlib) stream inflated a chunk at a time: refused past
    ``max_bytes`` inflated, or past ``max_ratio`` times the bytes read (when
    ``max_bytes`` is finite: no cap at all is an explicit choice)."""
    inflater = zlib.decompressobj(wbits=47)  # 32 + 15: gzip or zlib header, told apart
    chunks, size, read = [], 0, 0
    try:
        while True:
            if inflater.unconsumed_tail:
                data = inflater.unconsumed_tail
            else:
                data = fh.read(READ_CHUNK)
                read += len(data)
                if not data:
                    break
            chunk = inflater.decompress(data, READ_CHUNK)
            size += len(chunk)
            _check_inflated(size, read, path, what, max_bytes, max_ratio, why)
            chunks.append(chunk)
            if inflater.eof:
                if not inflater.unused_data:
                    break
                rest = inflater.unused_data  # another gzip member follows
                inflater = zlib.decompressobj(wbits=47)
                chunk = inflater.decompress(rest, READ_CHUNK)
                size += len(chunk)
                _check_inflated(size, read, path, what, max_bytes, max_ratio, why)
                chunks.append(chunk)
    except zlib.error as err:
        raise InputError(f"{_head(what, path)} is not a valid gzip file ({err})") from None
    if not inflater.eof and size:
        raise InputError(f"{_head(what, path)} ends in the middle of its gzip stream")
    return b"".join(chunks)


def _check_inflated(size: int, read: int, path: Path | str, what: str, max_bytes: float,
                    max_ratio: float, why: str) -> None:
    if size > max_bytes:
        raise InputError(f"{_head(what, path)} inflates to more than "
                         f"{readable_bytes(max_bytes)}{why}")
    if math.isfinite(max_bytes) and size > RATIO_FLOOR and size > max_ratio * max(read, 1):
        raise InputError(f"{_head(what, path)} inflates more than {max_ratio:g} times its "
                         "size (a compression bomb?)")


def read_input(path: Path | str, what: str, max_bytes: float = math.inf,
               why: str = CAP_NOTE) -> bytes:
    """The bytes of a checked regular file, at most ``max_bytes`` (``why``: what
    the cap is, as a refusal says it); a ``.gz`` file inflated (at most
    ``max_bytes`` inflated, and ``MAX_RATIO``)."""
    with open_checked(path, what, max_bytes, why) as fh:
        if str(path).endswith(".gz"):
            return inflate(fh, path, what, max_bytes, why=why)
        return _read_at_most(fh, path, what, max_bytes, why)


def read_text(path: Path | str, what: str, max_bytes: float = math.inf) -> str:
    """``read_input`` as UTF-8 text (a byte-order mark is fine)."""
    return decode_utf8(read_input(path, what, max_bytes), _head(what, path))


def read_json(path: Path | str, what: str, max_bytes: float = MAX_TEXT_BYTES) -> Any:
    """``read_input`` as JSON: bad bytes, syntax and runaway nesting are one
    line (a ``TextError``) naming the file."""
    return load_json_bytes(read_input(path, what, max_bytes), _head(what, path))
