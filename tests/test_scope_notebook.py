"""docs/megascope-notebook.md runs as written: its ```python blocks, in order,
in one fresh interpreter, on the tiny model trained by the session's run."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.slow  # trains the tiny model (torch processes)

PAGE = ROOT / "docs" / "megascope-notebook.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


def test_the_page_has_code_for_each_part() -> None:
    code = "\n".join(python_blocks(PAGE.read_text()))
    for call in ("ms.load(", "model.run_with_cache(", "model.run_with_hooks(", "model.hooks(",
                 "ms.logit_lens(", "ms.activation_patching(", "ms.direct_logit_attribution(",
                 "ms.import_checkpoint("):
        assert call in code
    loads = re.findall(r"^\s*(?:\w+ = |with )ms\.load\(", code, flags=re.M)
    assert len(loads) == 2  # the tiny model and the imported GPT-2, each loaded once


def test_the_notebook_page_runs(scope_tiny_run: Path, tmp_path: Path) -> None:
    script = tmp_path / "notebook.py"
    script.write_text("\n\n".join(python_blocks(PAGE.read_text())))
    env = {**os.environ, "RUN": str(scope_tiny_run), "PLOTS": str(tmp_path),
           "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "mean rank of the next character" in r.stdout
    assert "each head's direct share" in r.stdout
    assert "patched heads: (2, 4)" in r.stdout
    assert "Warning" not in r.stderr  # megatron-core's are kept in model.warnings
    assert (tmp_path / "patching-heads.png").is_file()
