"""Features plug into `megatronapp run` through the hooks of
``megatronapp.program.features``: a feature module listed in ``FEATURES`` adds
its summary section, its printed lines and, for the scenarios it owns, the
rank programs, without the run path importing it."""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import pytest

from megatronapp.program import features
from megatronapp.run.report import print_summary
from megatronapp.run.write import write_run
from sim import run_sim
from tests.support import fixed_cost_scenario

FEATURE = "planted_feature"
PLANTED = textwrap.dedent('''
    from megatronapp.program.features import FeatureHooks
    from megatronapp.program.ranks import static_programs


    def counted(s, result, source):
        return {"planted": {"ranks_with_events": sum(1 for e in result.events.values() if e)}}


    def said(summary, out):
        planted = summary.model_extra["planted"]
        return [f"  planted: {planted['ranks_with_events']} ranks in {out.name}"]


    def one_iteration(s):
        """Owns every scenario: its programs run the first iteration only."""
        return lambda s, stages_for, capture: static_programs(
            s.model_copy(update={"iterations": 1}), stages_for, capture)


    HOOKS = FeatureHooks(summary_sections=counted, lines=said)
    OWNER = FeatureHooks(programs=one_iteration)
''')


@pytest.fixture
def planted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A feature module outside the project, listed after the project's own."""
    (tmp_path / f"{FEATURE}.py").write_text(PLANTED)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(features, "FEATURES", (*features.FEATURES, FEATURE))
    yield tmp_path
    sys.modules.pop(FEATURE, None)


def test_a_listed_feature_adds_its_summary_section_and_printed_line(
        planted: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = fixed_cost_scenario()
    run = planted / "run"
    run.mkdir()
    summary = write_run(s, run_sim(s), run)
    written = json.loads((run / "summary.json").read_text())
    assert written["planted"] == {"ranks_with_events": s.world_size}
    assert list(written)[-2:] == ["planted", "trace"]  # after the core's own sections
    print_summary(summary, run)
    assert f"  planted: {s.world_size} ranks in run" in capsys.readouterr().out.splitlines()


def test_a_feature_that_owns_a_scenario_builds_its_programs(
        planted: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = fixed_cost_scenario(iterations=3)
    module = __import__(FEATURE)
    monkeypatch.setattr(module, "HOOKS", module.OWNER)
    result = run_sim(s)
    iterations = {e.args["iteration"] for evs in result.events.values() for e in evs
                  if "iteration" in e.args}
    assert iterations == {0}  # the owner's programs ran, not the scenario's three iterations
