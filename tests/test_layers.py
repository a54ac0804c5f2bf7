"""Layers point one way: the import-linter contracts in pyproject.toml hold,
and they do catch a core module that imports a backend, the CLI or SimPy, the
torch backend reaching into the simulator's modules, an import cycle, a core
subpackage importing one above it or a feature, and features importing each
other or the run composition above them, the run path or the simulator importing
a feature instead of taking its hooks, and a command importing a backend's module instead of
asking the registry."""
from __future__ import annotations

import re
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


def broken_contracts(lint_output: str) -> str:
    """import-linter's report with its line wrapping undone, so contract names read whole."""
    return " ".join(lint_output.split())


@pytest.mark.parametrize("module, bad_import, contract", [
    ("megatronapp/trace/summary.py", "from backends.sim import SimBackend",
     "The core does not import the simulator"),
    ("megatronapp/scan/evidence/detect.py", "from megatronapp.cli import main",  # the CLI imports scan
     "No import cycles between the core's subpackages"),
    ("megatronapp/dpp/windows.py", "from megatronapp.fidelity import predict",  # predict reads dpp
     "No import cycles between the core's subpackages"),
    ("megatronapp/host/limits.py", "import simpy", "The core does not import SimPy"),
    ("backends/torch/worker.py", "from sim.cluster import build_cluster",
     "The torch backend uses the simulator's public names only"),
    ("sim/fbd.py", "from sim.simulate import simulate",  # simulate imports fbd: a cycle
     "No import cycles between the core's subpackages"),
    ("megatronapp/io/text.py", "from megatronapp.trace import store",
     "The core's subpackages are layered"),
    ("megatronapp/parallel/ops.py", "from megatronapp.scenario import config",
     "The core's subpackages are layered"),
    ("megatronapp/costs/flops.py", "from megatronapp.fbd import hetero",
     "The core's subpackages import no feature module"),
    ("megatronapp/program/layout.py", "from megatronapp.run import jobs",
     "The core's subpackages import no feature module"),
    ("megatronapp/fbd/run.py", "from megatronapp.scope import summary",
     "The features are independent of each other"),
    ("megatronapp/scan/evidence/detect.py", "from megatronapp.run import report",
     "The features sit below the run composition"),
    ("megatronapp/run/report.py", "from megatronapp.fbd.run import summary_lines",
     "The run path imports no feature"),
    ("megatronapp/scope/cli.py", "from backends.torch.scope_lens import logit_lens",
     "Commands reach a backend through the registry"),
    ("sim/simulate.py", "from megatronapp.scope.cost import predicted_overhead",
     "The simulator imports no feature but MegaFBD"),
])
def test_a_module_importing_against_the_layers_breaks_its_contract(
        tmp_path: Path, module: str, bad_import: str, contract: str) -> None:
    for name in ("megatronapp", "backends", "sim"):
        shutil.copytree(ROOT / name, tmp_path / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n\ndef _upwards():\n    {bad_import}\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    report = broken_contracts(result.stdout)
    assert re.search(re.escape(contract) + r"(?:(?!KEPT).)*? BROKEN", report), result.stdout
