"""Render every results table into README and docs, or check that they agree.

A document marks where a table goes::

    <!-- results: NAME TABLE -->
    | ... rendered table ... |
    <!-- /results -->

and the experiment module ``experiments.NAME`` defines
``tables(doc) -> dict[str, str]``: for its results file (``results.read``),
each table's Markdown by key. ``python -m experiments.render`` rewrites the
blocks in place; ``--check`` rewrites nothing, prints each block that differs
and exits 1 (``tests/test_results_render.py`` runs it).
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from .results import ROOT, RESULTS, read

BLOCK = re.compile(r"(<!-- results: (?P<name>[\w]+) (?P<table>[\w.-]+) -->\n)(?P<body>.*?)"
                   r"(<!-- /results -->)", re.DOTALL)


def documents(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
                   align: str = "") -> str:
    """A Markdown table; ``align`` holds one letter per column (l or r, default l)."""
    marks = ["---:" if (align[i:i + 1] == "r") else "---" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(marks) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


Tables = Callable[[dict[str, Any]], dict[str, str]]


def _tables_of(name: str) -> Tables:
    module = importlib.import_module(f"experiments.{name}")
    tables: Tables = getattr(module, "tables")
    return tables


def rendered(text: str, results: Path = RESULTS) -> tuple[str, list[str]]:
    """``text`` with every results block rendered, and the problems found
    (a missing results file, an unknown table)."""
    problems: list[str] = []
    cache: dict[str, dict[str, str]] = {}

    def one(match: re.Match[str]) -> str:
        name, table = match["name"], match["table"]
        if name not in cache:
            try:
                cache[name] = _tables_of(name)(read(name, results))
            except (OSError, ModuleNotFoundError, KeyError, ValueError) as exc:
                problems.append(f"{name}: {exc}")
                cache[name] = {}
        body = cache[name].get(table)
        if body is None:
            if cache[name]:
                problems.append(f"{name}: no table {table!r} (has {sorted(cache[name])})")
            return match.group(0)
        return match.group(1) + body + match.group(5)
    return BLOCK.sub(one, text), problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.render",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; print the blocks that differ and exit 1")
    args = parser.parse_args(argv)
    status = 0
    for doc in documents():
        text = doc.read_text()
        new, problems = rendered(text)
        for p in problems:
            print(f"{doc.relative_to(ROOT)}: {p}", file=sys.stderr)
            status = 1
        if new == text:
            continue
        if args.check:
            status = 1
            sys.stdout.writelines(difflib.unified_diff(
                text.splitlines(True), new.splitlines(True),
                f"{doc.relative_to(ROOT)} (as written)", f"{doc.relative_to(ROOT)} (from results/)"))
        else:
            doc.write_text(new)
            print(f"rendered {doc.relative_to(ROOT)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
