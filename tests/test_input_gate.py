"""Every path a command reads goes through the input gate (``megatronapp/io/gate.py``).

The source of ``megatronapp/``, ``backends/`` and ``sim/`` is read with ``ast``: a
read of a file (``open`` for reading, ``Path.read_text``/``read_bytes``,
``gzip.open``) may appear only in the gate, or in the list below with its
reason; a library reader (Parquet, safetensors, ``torch.load``) only in a
function that passes its path through the gate first. Then the gate itself:
what it refuses (FIFOs, devices, sockets, links to them, link loops, long
names, files over the cap, compression bombs) and what it reads."""
from __future__ import annotations

import ast
import gzip
import os
import socket
import stat
from pathlib import Path

import pytest

from megatronapp.io import gate

from .support import source_trees

GATE = "megatronapp/io/gate.py"
# (file, function) pairs that may read a file directly, each with its reason
ALLOWED = {
    ("megatronapp/host/limits.py", "_meminfo_available"),  # /proc/meminfo: the machine's
    ("megatronapp/host/limits.py", "_cgroup_headroom"),  # /sys/fs/cgroup: the machine's
    ("megatronapp/host/limits.py", "_rlimit_headroom"),  # /proc/self/statm: this process's
    ("backends/torch/interpreter.py", "queued_s"),  # /proc/thread-self/schedstat
    ("backends/torch/lifetime.py", "process_state"),  # /proc/PID/stat of a rank we started
    ("backends/torch/profile.py", "_quiet_profiler"),  # the profiler's own output, captured
    # the parts a run's ranks wrote into its own staging folder, merged at its end
    ("megatronapp/scope/storage.py", "_read_parts"),
    ("megatronapp/scope/storage.py", "_merge_raw"),
    ("megatronapp/scope/storage.py", "_injections"),
    ("megatronapp/scope/storage.py", "_counters"),
    ("backends/torch/scope_run.py", "_merge_checkpoint"),
    ("megatronapp/io/gate.py", "open_checked"),  # the gate itself
}
PLAIN_READS = {"read_text", "read_bytes"}
MODULE_READS = {"gzip": {"open"}, "json": {"load"}}
LIBRARY_READERS = {"read_table", "read_metadata", "read_schema", "ParquetFile", "dataset",
                   "load_file", "safe_open", "load"}
LIBRARY_OWNERS = {"pq", "ds", "torch", "safetensors"}


def _is_read_open(call: ast.Call) -> bool:
    """``open(path)`` or ``open(path, mode)`` with a mode that only reads."""
    if not (isinstance(call.func, ast.Name) and call.func.id == "open"):
        return False
    mode = call.args[1] if len(call.args) > 1 else next(
        (k.value for k in call.keywords if k.arg == "mode"), None)
    if mode is None:
        return True
    return isinstance(mode, ast.Constant) and not set(str(mode.value)) & set("wax+")


def _library_read(call: ast.Call) -> bool:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id in {"load_file", "safe_open"}
    return (isinstance(func, ast.Attribute) and func.attr in LIBRARY_READERS
            and isinstance(func.value, ast.Name) and func.value.id in LIBRARY_OWNERS)


def _plain_read(call: ast.Call) -> bool:
    func = call.func
    if _is_read_open(call):
        return True
    if not isinstance(func, ast.Attribute):
        return False
    if isinstance(func.value, ast.Name) and func.attr in MODULE_READS.get(func.value.id, ()):
        return True
    return func.attr in PLAIN_READS and not _is_gate(func.value)


def _is_gate(node: ast.AST) -> bool:
    """The gate module, or a function of the caller's that wraps it (``_gated``)."""
    return isinstance(node, ast.Name) and node.id in ("gate", "_gated")


def _uses_gate(node: ast.AST) -> bool:
    return any((isinstance(n, ast.Attribute) and _is_gate(n.value)) or _is_gate(n)
               for n in ast.walk(node) if not isinstance(n, ast.FunctionDef))


def ungated_reads(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, function, call) of each read not through the gate."""
    found = []
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef,
                                                             ast.AsyncFunctionDef))]
    for fn in functions:
        gated = _uses_gate(fn)
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call):
                continue
            if _plain_read(node) or (_library_read(node) and not gated):
                found.append((node.lineno, fn.name, ast.unparse(node.func)))
    return found


def test_every_read_goes_through_the_gate() -> None:
    offenders = [f"{rel}:{line} {fn}: {call}" for rel, tree in source_trees()
                 for line, fn, call in ungated_reads(tree)
                 if (rel, fn) not in ALLOWED and rel != GATE]
    assert sorted(set(offenders)) == []


def test_the_scan_sees_each_kind_of_read() -> None:
    source = ("def f(p):\n    open(p)\n    open(p, 'rb')\n    open(p, 'w')\n    p.read_text()\n"
              "    p.read_bytes()\n    gzip.open(p)\n    pq.read_table(p)\n"
              "def g(p):\n    pq.read_table(gate.checked(p, 'x'))\n    load_file(str(p))\n")
    found = [(fn, call) for _, fn, call in ungated_reads(ast.parse(source))]
    assert found == [("f", "open"), ("f", "open"), ("f", "p.read_text"), ("f", "p.read_bytes"),
                     ("f", "gzip.open"), ("f", "pq.read_table")]


# ------------------------------------------------------------------ the gate
@pytest.fixture
def specials(tmp_path: Path) -> dict[str, Path]:
    """A FIFO, a socket, links to a device, to a FIFO and in a loop, a folder."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    sock_path = tmp_path / "sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    (tmp_path / "zero").symlink_to("/dev/zero")
    (tmp_path / "to_fifo").symlink_to(fifo)
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    (tmp_path / "folder").mkdir()
    return {"fifo": fifo, "socket": sock_path, "device": Path("/dev/zero"),
            "link to a device": tmp_path / "zero", "link to a FIFO": tmp_path / "to_fifo",
            "link loop": tmp_path / "loop_a", "folder": tmp_path / "folder",
            "missing": tmp_path / "missing"}


REASONS = {"fifo": "FIFO", "socket": "socket", "device": "character device",
           "link to a device": "a link to /dev/zero", "link to a FIFO": "FIFO",
           "link loop": "loop of symbolic links", "folder": "a folder, not a regular file",
           "missing": "no such file"}


@pytest.mark.parametrize("case", list(REASONS))
def test_the_gate_refuses_what_is_not_a_regular_file(specials, case):
    with pytest.raises(gate.InputError, match=REASONS[case]) as caught:
        gate.read_input(specials[case], "--thing")
    assert str(caught.value).startswith("--thing: ") and "\n" not in str(caught.value)


def test_long_names_are_refused_before_the_file_system_is_asked(tmp_path):
    for path in (tmp_path / ("a" * 256), Path("/".join(["abcdefgh"] * 600))):
        with pytest.raises(gate.InputError, match="--thing: .*(a name of 256 bytes|bytes long)"):
            gate.read_input(path, "--thing")
    assert not gate.names_fit("x" * 300) and gate.names_fit("a/b.yaml")


def test_size_is_capped_before_reading(tmp_path):
    path = tmp_path / "big.json"
    path.write_bytes(b" " * 1000)
    with pytest.raises(gate.InputError, match="1 kB, more than 999 B"):
        gate.read_input(path, "", 999)
    assert gate.read_input(path, "", 1000) == b" " * 1000


def test_a_gzip_bomb_is_refused_by_its_ratio_and_by_its_size(tmp_path):
    bomb = tmp_path / "bomb.json.gz"
    with gzip.open(bomb, "wb") as fh:
        for _ in range(100):
            fh.write(b"\0" * (1 << 20))  # 100 MiB of zeros, about 100 kB on disk
    assert bomb.stat().st_size < 200_000
    with pytest.raises(gate.InputError, match="inflates more than 200 times"):
        gate.read_input(bomb, "", 1e12)
    with pytest.raises(gate.InputError, match="inflates to more than 10 MB"):
        gate.read_input(bomb, "", 10e6)


def test_what_it_reads(tmp_path):
    plain, packed = tmp_path / "t.json", tmp_path / "t.json.gz"
    plain.write_text('{"a": [1, 2]}')
    with gzip.open(packed, "wb") as fh:
        fh.write(b'{"a": [1, 2]}')
    link = tmp_path / "link.json"
    link.symlink_to(plain)
    for path in (plain, packed, link):
        assert gate.read_json(path, "") == {"a": [1, 2]}
    assert gate.read_input(os.devnull, "") == b""  # /dev/null: the empty file
    assert stat.S_ISDIR(os.stat(gate.checked(tmp_path, "", "dir")).st_mode)
