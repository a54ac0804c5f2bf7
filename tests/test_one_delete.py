"""Every delete in the code base goes through ``outdirs.discard``.

The source of ``megatronapp/``, ``backends/`` and ``sim/`` is read with ``ast``:
a call that deletes or renames over a file (``shutil.rmtree``, ``os.remove``,
``os.unlink``, ``os.rmdir``, ``os.replace``, ``os.rename``, ``shutil.move``,
``Path.unlink``, ``Path.rmdir``, ``Path.rename``, ``Path.replace``) or makes a
temporary folder that removes itself may appear only in the writer module,
or in the list below with its reason."""
from __future__ import annotations

import ast

from .support import source_trees

WRITER = "megatronapp/io/outdirs.py"
ALLOWED: set[tuple[str, str]] = set()  # (file, call) pairs allowed elsewhere, each with its reason
MODULE_CALLS = {"os": {"remove", "unlink", "rmdir", "removedirs", "replace", "rename", "renames"},
                "shutil": {"rmtree", "move"}, "tempfile": {"TemporaryDirectory"}}
PATH_METHODS = {"unlink", "rmdir"}
PATH_MOVES = {"rename", "replace"}  # with one argument: Path's, not str.replace(old, new)


def _deletes(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in MODULE_CALLS:
            found += [(node.lineno, a.name) for a in node.names
                      if a.name in MODULE_CALLS[node.module]]
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name, owner = node.func.attr, node.func.value
        if isinstance(owner, ast.Name) and name in MODULE_CALLS.get(owner.id, ()):
            found.append((node.lineno, name))
        elif name in PATH_METHODS or (name in PATH_MOVES and len(node.args) == 1
                                      and not node.keywords):
            found.append((node.lineno, name))
    return found


def test_no_delete_outside_the_writer() -> None:
    offenders = [f"{rel}:{line} {name}" for rel, tree in source_trees() if rel != WRITER
                 for line, name in _deletes(tree) if (rel, name) not in ALLOWED]
    assert offenders == []


def test_the_scan_sees_each_kind_of_delete() -> None:
    """The scan itself: each form of delete in a snippet is found, str.replace is not."""
    source = ("import os, shutil\nfrom shutil import rmtree\nshutil.rmtree(a)\nos.remove(a)\n"
              "os.replace(a, b)\np.unlink()\np.rmdir()\np.rename(q)\np.replace(q)\n"
              "text.replace('a', 'b')\n")
    assert [name for _line, name in _deletes(ast.parse(source))] == [
        "rmtree", "rmtree", "remove", "replace", "unlink", "rmdir", "rename", "replace"]
