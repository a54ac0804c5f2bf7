"""`megatronapp report`: one self-contained HTML page per run, written through
the project's writer, checked in a real browser (Debian's chromium driven by
Playwright). With ``$MEGATRONAPP_SCREENSHOTS`` set to a directory
(``docs/img`` for the documentation) the page's screenshot is copied there."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from megatronapp.cli import main
from megatronapp.scenario.config import load_scenario
from megatronapp.run.write import write_run
from sim import run_sim
from tests.scope_view_support import launch_chromium, page_with_errors

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("scenario", "verdict", "iterations", "timeline", "heatmap", "marey", "memory", "dpp")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quick-start run (rank 5 throttled) and its report."""
    s = load_scenario(str(ROOT / "scenarios" / "throttle.yaml"))
    run = tmp_path_factory.mktemp("report") / "run"
    run.mkdir()
    write_run(s, run_sim(s), run)
    assert main(["report", str(run)]) == 0
    return run / "report.html"


def test_the_page_has_every_section_and_names_the_root_cause(report: Path) -> None:
    page = report.read_text()
    for ident in SECTIONS:
        assert f'<section id="{ident}">' in page, ident
    verdict = page[page.index('<section id="verdict">'):page.index('<section id="iterations">')]
    assert "rank 5" in verdict


def test_the_page_fetches_nothing(report: Path) -> None:
    page = report.read_text()
    sources = re.findall(r'(?:src|href)="([^"]*)"', page)
    assert sources and all(s.startswith("data:image/png;base64,") for s in sources)


def test_a_foreign_file_is_replaced_only_with_force(report: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    foreign = report.parent.parent / "mine.html"
    foreign.write_text("not megatronapp's")
    assert main(["report", str(report.parent), "--out", str(foreign)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--force" in err[0] and foreign.read_text() == "not megatronapp's"
    assert main(["report", str(report.parent), "--out", str(foreign), "--force"]) == 0
    assert foreign.read_text().startswith("<!DOCTYPE html>")


def test_a_directory_without_a_run_is_one_line(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "summary.json" in err[0]
    assert not list(tmp_path.iterdir())


def test_the_page_in_a_browser(report: Path, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page, errors = page_with_errors(browser, {"width": 1280, "height": 2000})
            page.goto(report.as_uri())
            for ident in SECTIONS:
                assert page.locator(f"section#{ident} h2").is_visible(), ident
            loaded = page.evaluate("[...document.images].every(i => i.complete && "
                                   "i.naturalWidth > 0)")
            assert loaded
            shot = tmp_path / "report.png"
            page.screenshot(path=str(shot))
        finally:
            browser.close()
    assert errors == []
    target = os.environ.get("MEGATRONAPP_SCREENSHOTS")
    if target:
        shutil.copyfile(shot, Path(target) / shot.name)


def test_a_run_that_trained_gets_its_loss_curve(report: Path, tmp_path: Path) -> None:
    """A real run's summary has losses: the page plots them beside iteration time."""
    run = tmp_path / "trained"
    shutil.copytree(report.parent, run)
    summary = json.loads((run / "summary.json").read_text())
    summary["loss_per_iteration"] = [10.4, 9.8, 9.1, 8.7]
    (run / "summary.json").write_text(json.dumps(summary))
    assert main(["report", str(run), "--out", str(tmp_path / "page.html")]) == 0
    page = (tmp_path / "page.html").read_text()
    iterations = page[page.index('<section id="iterations">'):page.index('<section id="timeline">')]
    assert "Iteration time and loss" in iterations and iterations.count("<img ") == 2
    assert "Iteration time and loss" not in report.read_text()
