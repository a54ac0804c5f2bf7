"""Everything about a results file lives here: what it records besides the
data (the command, the commit, the machine, its load, the date), where it is
written, and how it is read back.

A results file is ``results/NAME.json``::

    {"name": ..., "command": ..., "commit": ..., "dirty": ..., "machine": {...},
     "load": {"before": [1, 5, 15 min], "after": [...]}, "date": ..., "data": {...}}

It is written whole or not at all (a temporary file renamed into place).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"


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


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


@dataclass
class Run:
    """An experiment's run in progress: started with the load as it was."""

    name: str
    argv: list[str]
    load_before: list[float]

    def record(self, data: Any, root: Path = RESULTS) -> Path:
        """Write ``results/NAME.json`` (whole or not at all); returns its path."""
        doc = {"name": self.name,
               "command": "python -m experiments." + " ".join([self.name, *map(shlex.quote,
                                                                            self.argv)]),
               "commit": _git("rev-parse", "HEAD"), "dirty": bool(_git("status", "--porcelain")),
               "machine": machine(), "load": {"before": self.load_before, "after": load()},
               "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               "data": data}
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


def start(name: str, argv: list[str] | None = None) -> Run:
    """Begin an experiment named ``name`` (its module's short name) run with ``argv``."""
    return Run(name, list(sys.argv[1:] if argv is None else argv), load())


def jobs_option(name: str, doc: str | None, argv: list[str] | None) -> int:
    """An experiment's one option, ``--jobs N`` (what it simulates at once)."""
    import argparse

    parser = argparse.ArgumentParser(prog=f"python -m experiments.{name}",
                                     description=(doc or "").split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1, help="simulations run at once")
    return max(1, parser.parse_args(argv).jobs)


def read(name: str, root: Path = RESULTS) -> dict[str, Any]:
    """The whole results file ``results/NAME.json`` (data and provenance)."""
    doc: dict[str, Any] = json.loads((root / f"{name}.json").read_text())
    return doc
