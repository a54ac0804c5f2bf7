"""``scope summary``, ``scope query`` and ``scope serve`` open what users have:
the run directory ``megatronapp run`` writes (it holds a result manifest of its
own beside scope/), a capture directory, and a ``scope generate`` output."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatronapp.scope.view.source import open_source
from tests.support import run_cli
from tests.scope_view_support import ViewServer

pytestmark = pytest.mark.slow  # the run spawns torch processes


@pytest.fixture(scope="module")
def generated(scope_tiny_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("generated") / "gen"
    r = run_cli("scope", "generate", str(scope_tiny_run), "--prompt", "def f(x):",
                "--tokens", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    return out


def test_summary_and_query_open_a_run_directory_a_capture_and_a_generation(
        scope_tiny_run: Path, generated: Path) -> None:
    for target, source in ((scope_tiny_run, "train"), (scope_tiny_run / "scope", "train"),
                           (generated, "generate"), (generated / "clean", "generate")):
        r = run_cli("scope", "summary", str(target))
        assert r.returncode == 0, r.stderr
        assert f"{source} capture of" in r.stdout
        q = run_cli("scope", "query", str(target), "SELECT count(*) AS n FROM stats")
        assert q.returncode == 0, q.stderr


def test_the_view_opens_a_run_directory_with_its_checkpoint(scope_tiny_run: Path,
                                                             generated: Path) -> None:
    run = open_source(scope_tiny_run)
    assert run.capture_dir == scope_tiny_run / "scope"
    assert run.checkpoint_dir == scope_tiny_run / "checkpoint"
    gen = open_source(generated)
    assert gen.capture_dir == generated / "clean"
    assert gen.checkpoint_dir == scope_tiny_run / "checkpoint"  # named in its manifest


@pytest.mark.parametrize("which", ["run", "generated"])
def test_scope_serve_starts_on_a_run_directory_and_a_generation(
        scope_tiny_run: Path, generated: Path, which: str) -> None:
    target = scope_tiny_run if which == "run" else generated
    with ViewServer(target) as srv:
        assert srv.alive() and srv.token


def test_a_run_without_a_capture_says_how_to_get_one(tmp_path: Path) -> None:
    run = tmp_path / "throttle"
    assert run_cli("run", "scenarios/throttle.yaml", "--out", str(run)).returncode == 0
    for command in ("summary", "serve"):
        r = run_cli("scope", command, str(run))
        assert r.returncode == 2 and r.stdout == ""
        assert r.stderr.count("\n") == 1
        assert "run without a MegaScope capture" in r.stderr and "scope:" in r.stderr
