"""Layers point one way: the import-linter contracts in pyproject.toml hold,
and they do catch a core module that imports a backend, the CLI or SimPy, the
torch backend reaching into the simulator's modules, and an import cycle."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # import-linter runs in a fresh interpreter
ROOT = Path(__file__).resolve().parents[1]


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """Run import-linter on the packages under ``root`` (its own pyproject)."""
    code = ("import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")
    return subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, timeout=300)


def test_the_layer_contracts_hold() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "broken" in result.stdout and "0 broken" in result.stdout


@pytest.mark.parametrize("module, bad_import", [
    ("megatronapp/summary.py", "from backends.sim import SimBackend"),
    ("megatronapp/scan/detect.py", "from megatronapp.cli import main"),
    ("megatronapp/dpp/windows.py", "from megatronapp import runs"),  # runs imports dpp: a cycle
    ("megatronapp/speed.py", "import simpy"),
    ("backends/torch/worker.py", "from sim.cluster import build_cluster"),
    ("sim/fbd.py", "from sim.simulate import simulate"),  # simulate imports fbd: a cycle
])
def test_a_core_module_importing_upwards_breaks_a_contract(tmp_path: Path, module: str,
                                                           bad_import: str) -> None:
    for name in ("megatronapp", "backends", "sim"):
        shutil.copytree(ROOT / name, tmp_path / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n\ndef _upwards():\n    {bad_import}\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout, result.stdout
