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
from statistics import mean

import pytest

from megatronapp.cli import main
from megatronapp.errors import UserError
from megatronapp.host import limits
from megatronapp.report.baseline import simulated
from megatronapp.scenario.config import load_scenario, parse_scenario, scenario_to_dict
from megatronapp.run.write import write_run
from megatronapp.trace.summary import run_iteration_times
from sim import run_sim
from tests.scope_view_support import launch_chromium, page_with_errors

ROOT = Path(__file__).resolve().parents[1]
QUICK_START = ROOT / "scenarios" / "throttle.yaml"
SECTIONS = ("scenario", "verdict", "cost", "iterations", "timeline", "heatmap", "marey", "memory")
# "The faults cost 9.41 ms of each 118 ms iteration (8%); without them, 108 ms (...)"
COST = re.compile(r"costs? ([\d.]+) ms of each ([\d.]+) ms iteration \(([\d.]+)%\); "
                  r"without (?:it|them), ([\d.]+) ms \((.*?)\)\.")


def section_of(page: str, ident: str) -> str:
    start = page.index(f'<section id="{ident}">')
    return page[start:page.index("</section>", start)]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quick-start run (rank 5 throttled) and its report."""
    s = load_scenario(str(QUICK_START))
    run = tmp_path_factory.mktemp("report") / "run"
    run.mkdir()
    write_run(s, run_sim(s), run)
    assert main(["report", str(run)]) == 0
    return run / "report.html"


def test_the_page_has_the_sections_that_apply_and_names_the_root_cause(report: Path) -> None:
    page = report.read_text()
    for ident in SECTIONS:
        assert f'<section id="{ident}">' in page, ident
    assert "rank 5" in section_of(page, "verdict")
    # a plain 1F1B run: no MegaDPP section, no closed loop, no raw byte counts
    assert '<section id="dpp">' not in page and '<section id="mitigation">' not in page
    assert "35757686784" not in page.split("<details>")[0]


def test_faults_are_in_words_not_json(report: Path) -> None:
    head = section_of(report.read_text(), "scenario").split("<details>")[0]
    assert "rank 5 at 1/1.5 speed from 0.02 s" in head
    assert "clock of rank 9 off by 1.5 ms, drifting 40 ppm" in head
    assert "kind" not in head


def test_the_cost_is_against_the_same_scenario_simulated_without_its_faults(
        report: Path) -> None:
    """The page's numbers agree with running the healthy scenario here."""
    s = load_scenario(str(QUICK_START))
    healthy = run_iteration_times(run_sim(parse_scenario({**scenario_to_dict(s), "faults": []})))
    faulty = json.loads((report.parent / "summary.json").read_text())["iteration_times_s"]
    found = COST.search(section_of(report.read_text(), "cost"))
    assert found, section_of(report.read_text(), "cost")
    cost, iteration, share, without, source = found.groups()
    assert float(iteration) == pytest.approx(1e3 * mean(faulty), rel=5e-3)
    assert float(without) == pytest.approx(1e3 * mean(healthy), rel=5e-3)
    assert float(cost) == pytest.approx(1e3 * (mean(faulty) - mean(healthy)), rel=5e-3)
    assert float(cost) > 0 and float(share) == pytest.approx(
        100 * float(cost) / float(iteration), rel=0.02)
    assert "simulated" in source


def test_a_real_runs_cost_is_megascans_blame(report: Path, tmp_path: Path) -> None:
    """No simulator stands in for a real run: the cost is the verdict's blame."""
    run = tmp_path / "real"
    shutil.copytree(report.parent, run)
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "backend": "torch"}))
    assert main(["report", str(run), "--out", str(tmp_path / "page.html")]) == 0
    page = (tmp_path / "page.html").read_text()
    blame = re.search(r"blame: ([\d.]+) ms of each", section_of(page, "verdict"))
    found = COST.search(section_of(page, "cost"))
    assert blame and found and "MegaScan&#x27;s blame" in found.group(5)
    assert found.group(1) == blame.group(1)


def test_a_healthy_run_too_large_for_the_limits_is_not_simulated(report: Path) -> None:
    summary = json.loads((report.parent / "summary.json").read_text())
    tiny = limits.Limits(memory_bytes=1.0, disk_bytes=None, max_seconds=1e9, max_torch_ranks=1)

    def refuse(_scenario: object) -> object:
        raise AssertionError("simulated past the limits")

    baseline = simulated(summary, refuse, lambda e: limits.check(e, tiny), lambda _: None)
    assert baseline.healthy_s is None
    assert baseline.sentence().startswith("The healthy baseline is unknown: not simulated "
                                          "(limits:")
    with pytest.raises(UserError):  # the check the sentence reports is the real one
        limits.check(limits.estimate_run(load_scenario(str(QUICK_START))), tiny)


def reported(scenario: str, out: Path) -> str:
    """``megatronapp run`` of a scenario file, then its report page."""
    assert main(["run", str(ROOT / "scenarios" / scenario), "--out", str(out)]) == 0
    assert main(["report", str(out)]) == 0
    return (out / "report.html").read_text()


def test_a_closed_loop_run_shows_its_segments_and_goodput(tmp_path: Path) -> None:
    page = reported("crash_restart.yaml", tmp_path / "crash")
    loop = section_of(page, "mitigation")
    assert "rank 3 failed" in loop and "ran to the end" in loop and "goodput:" in loop
    assert "Mitigation" in section_of(page, "cost")


def test_a_megadpp_run_shows_its_section_in_readable_units(tmp_path: Path) -> None:
    page = reported("dpp_healthy.yaml", tmp_path / "dpp")
    dpp = section_of(page, "dpp")
    assert re.search(r"peak memory</th><td>[\d.]+ GB<", dpp), dpp
    assert not re.search(r"\d{7,}", dpp)  # no raw byte counts
    assert "injects no faults" in section_of(page, "cost")


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
            cost = page.locator("section#cost p.cost")
            assert cost.is_visible() and COST.search(cost.inner_text()), cost.inner_text()
            chart = page.locator("section#iterations img")
            assert "healthy baseline" in (chart.get_attribute("alt") or "")
            assert chart.is_visible() and chart.bounding_box()["y"] < 2000  # in the shot
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
