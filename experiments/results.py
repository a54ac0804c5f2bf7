"""Everything about a results file lives here: what it records besides the
data (the command, the commit, the machine, its load, the date), where it is
written, and how it is read back.

A results file is ``results/NAME.json``::

    {"name": ..., "command": ..., "commit": ..., "dirty": ..., "machine": {...},
     "load": {"before": [1, 5, 15 min], "after": [...]}, "date": ..., "data": {...}}

It is written whole or not at all (a temporary file renamed into place).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
_CELL_BAR = re.compile(r"(?<!\\)\|")  # a Markdown cell's edge (an escaped bar is text)


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                             timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """What ran it: CPU model, cores this process may use, memory, Python, torch."""
    try:
        memory_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        memory_gb = None
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    return {"cpu": _cpu_model(), "cores": len(os.sched_getaffinity(0)),
            "memory_gb": memory_gb, "python": platform.python_version(),
            "torch": torch_version, "system": platform.platform()}


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


@dataclass
class Run:
    """An experiment's run in progress: started with the load as it was."""

    name: str
    argv: list[str]
    load_before: list[float]

    @property
    def command(self) -> str:
        return "python -m experiments." + " ".join([self.name, *map(shlex.quote, self.argv)])

    def record(self, data: Any, root: Path = RESULTS) -> Path:
        """Write ``results/NAME.json`` (whole or not at all); returns its path."""
        doc = {"name": self.name, "command": self.command,
               "commit": _git("rev-parse", "HEAD"), "dirty": bool(_git("status", "--porcelain")),
               "machine": machine(), "load": {"before": self.load_before, "after": load()},
               "date": _now(), "data": data}
        root.mkdir(parents=True, exist_ok=True)
        path = root / f"{self.name}.json"
        fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{self.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=1, sort_keys=False)
                f.write("\n")
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    def record_part(self, part: str, data: Any, root: Path = RESULTS) -> Path:
        """Record ``data`` as ``part`` of ``results/NAME.json`` (``{"parts": {PART:
        {"command", "date", "data"}}}``), keeping the parts other runs recorded: for an
        experiment whose modes measure different tables."""
        try:
            kept = read(self.name, root)["data"].get("parts", {})
        except (OSError, ValueError, KeyError, AttributeError):
            kept = {}
        return self.record({"parts": {**kept, part: {"command": self.command, "date": _now(),
                                                     "data": data}}}, root)


@dataclass
class Printed:
    """Markdown table lines printed as they come and kept, to be recorded as cells
    (for an experiment whose rows are the lines it prints)."""

    lines: list[str] = field(default_factory=list)

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)

    def cells(self) -> list[list[str]]:
        """Each table line's cells (header and rows; rules and blank lines dropped)."""
        rows = [line.strip() for text in self.lines for line in text.splitlines()]
        return [[c.strip().replace("\\|", "|") for c in _CELL_BAR.split(row[1:-1])]
                for row in rows if row.startswith("|") and not set(row) <= set("|-: ")]


def start(name: str, argv: list[str] | None = None) -> Run:
    """Begin an experiment named ``name`` (its module's short name) run with ``argv``."""
    return Run(name, list(sys.argv[1:] if argv is None else argv), load())


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """An experiment's parser: named as it is run, described by its docstring's first paragraph."""
    return argparse.ArgumentParser(prog=f"python -m experiments.{name}",
                                   description=(doc or "").split("\n\n")[0])


def shown(path: Path | str) -> str:
    """``path`` as a results file names it: from the repository's root when inside it
    (the same on every machine), else as given."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)


def results_dir_option(options: argparse.ArgumentParser) -> None:
    """``--results-dir DIR``: where the experiment writes NAME.json (default results/)."""
    options.add_argument("--results-dir", type=Path, default=RESULTS,
                         help="where NAME.json is written (default results/)")


def jobs_option(name: str, doc: str | None, argv: list[str] | None) -> int:
    """An experiment's one option, ``--jobs N`` (what it simulates at once)."""
    options = parser(name, doc)
    options.add_argument("--jobs", type=int, default=1, help="simulations run at once")
    return max(1, options.parse_args(argv).jobs)


def read(name: str, root: Path = RESULTS) -> dict[str, Any]:
    """The whole results file ``results/NAME.json`` (data and provenance)."""
    doc: dict[str, Any] = json.loads((root / f"{name}.json").read_text())
    return doc
