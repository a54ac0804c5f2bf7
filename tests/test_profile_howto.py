"""docs/diagnose-your-job.md's how-to for users' own jobs, run: its torch.profiler
snippet, taken from the page, profiles a 2-rank CPU DDP job
(``tests/profile_howto_job.py``), and ``detect``, ``analyze`` and
``report`` read the folder it wrote, leaving it as it was."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from .support import ROOT, run_cli

PAGE = ROOT / "docs" / "diagnose-your-job.md"
MARKER = "<!-- profile snippet"


def snippet() -> str:
    """The Python block that follows the page's profile-snippet marker."""
    tokens = MarkdownIt("commonmark").parse(PAGE.read_text())
    for before, token in zip(tokens, tokens[1:]):
        if before.type == "html_block" and before.content.startswith(MARKER):
            assert token.type == "fence" and token.info == "python"
            return token.content
    raise AssertionError(f"{PAGE}: no block after {MARKER!r}")


def test_the_snippet_is_one_paste_with_nothing_of_ours() -> None:
    code = snippet()
    assert "megatronapp" not in code and "prof.step()" in code
    compile(code, "snippet", "exec")


def profile_the_job(out: Path, snippet_file: Path) -> None:
    """Runs the profiled job, and once more from an empty folder if it fails
    (gloo's transport on a loaded host is outside what is tested here; the
    one failure seen gave no error to read); both tries' errors if both fail."""
    errors: list[str] = []
    for _ in range(2):
        done = subprocess.run([sys.executable, str(ROOT / "tests" / "profile_howto_job.py"),
                               str(out), str(snippet_file)],
                              capture_output=True, text=True, timeout=600, cwd=ROOT)
        if done.returncode == 0:
            return
        errors.append(done.stderr[-4000:])
        shutil.rmtree(out, ignore_errors=True)
    raise AssertionError("the profiled job failed:\n" + "\n----\n".join(errors))


@pytest.mark.slow
def test_a_job_profiled_as_the_how_to_says_is_read_by_detect(tmp_path: Path) -> None:
    (tmp_path / "snippet.py").write_text(snippet())
    profile_the_job(tmp_path / "job", tmp_path / "snippet.py")
    traces = tmp_path / "job" / "traces"
    files = sorted(traces.iterdir())
    assert len(files) == 2 and all(f.name.endswith(".pt.trace.json") for f in files)
    before = {f.name: f.stat().st_mtime_ns for f in files}
    done = run_cli("detect", str(traces), "--json")
    assert done.returncode == 0, done.stderr
    verdict = json.loads(done.stdout)
    assert verdict["world_size"] == 2 and verdict["missing_ranks"] == []
    assert done.stderr == ""  # every rank is there: no warning
    analysis = json.loads(run_cli("analyze", str(traces), "--json").stdout)
    assert sorted(analysis["ranks"]) == ["0", "1"]
    schedule = re.search(r"active=(\d+)", snippet())
    assert schedule is not None
    active = int(schedule.group(1))
    assert len(analysis["iteration_times_s"]) == active  # the schedule's active steps
    assert run_cli("report", str(traces)).returncode == 0
    assert {f.name: f.stat().st_mtime_ns for f in traces.iterdir()} == before
    assert (tmp_path / "job" / "traces-megascan" / "report.html").is_file()
