"""summary.json carries its schema version and is validated when read: a file
from before the version existed reads as version 1; a malformed file, or one
from a newer megatronapp, is one line naming the field (exit 2). A run's
optional parts are typed sections of its RunResult."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from megatronapp.run.write import write_run
from megatronapp.scenario.config import load_scenario
from megatronapp.trace.sections import FbdSection
from megatronapp.trace.summary_file import SCHEMA_VERSION, SummaryError, read_summary
from sim import run_sim, simulate
from tests.support import ROOT, fixed_cost_scenario, run_cli


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    s = fixed_cost_scenario()
    out = tmp_path_factory.mktemp("run")
    write_run(s, run_sim(s), out)
    return out


def rewritten(run_dir: Path, tmp_path: Path, change: dict[str, object]) -> Path:
    """A copy of ``run_dir``'s summary.json with some keys changed (None: removed)."""
    data = json.loads((run_dir / "summary.json").read_text())
    for key, value in change.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(data))
    return path


def test_a_run_writes_the_schema_version_first(run_dir: Path) -> None:
    data = json.loads((run_dir / "summary.json").read_text())
    assert next(iter(data)) == "schema_version" and data["schema_version"] == SCHEMA_VERSION
    assert read_summary(run_dir / "summary.json").world_size == data["world_size"]


def test_a_summary_from_before_the_version_reads_as_version_1(run_dir: Path,
                                                              tmp_path: Path) -> None:
    old = read_summary(rewritten(run_dir, tmp_path, {"schema_version": None}))
    assert old.schema_version == 1
    assert old.scenario == json.loads((run_dir / "summary.json").read_text())["scenario"]


@pytest.mark.parametrize("change, field", [
    ({"schema_version": SCHEMA_VERSION + 1}, "schema_version: version"),
    ({"world_size": "four"}, "world_size:"),
    ({"scenario": None}, "scenario: Field required"),
    ({"fbd": {"stages": "gpt"}}, "fbd.virtual: Field required"),
])
def test_a_malformed_or_newer_summary_is_one_line_naming_the_field(
        run_dir: Path, tmp_path: Path, change: dict[str, object], field: str) -> None:
    path = rewritten(run_dir, tmp_path, change)
    with pytest.raises(SummaryError, match=f"^{path}: {field}"):
        read_summary(path)


def test_report_refuses_a_newer_summary_with_one_line(run_dir: Path, tmp_path: Path) -> None:
    for name in ("trace.parquet", "ground_truth.json"):
        (tmp_path / name).write_bytes((run_dir / name).read_bytes())
    rewritten(run_dir, tmp_path, {"schema_version": SCHEMA_VERSION + 1})
    result = run_cli("report", str(tmp_path))
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1
    assert "summary.json: schema_version: version" in result.stderr
    assert not (tmp_path / "report.html").exists()


def test_a_decoupled_run_is_a_typed_section_written_as_summary_keys(tmp_path: Path) -> None:
    s = load_scenario(ROOT / "scenarios" / "fbd_hetero.yaml", ["iterations=2"])
    result = simulate(s)
    assert isinstance(result.fbd, FbdSection) and result.training is None
    write_run(s, result, tmp_path)
    summary = read_summary(tmp_path / "summary.json")
    assert summary.fbd is not None and summary.world_size == result.fbd.world_size
    details = {k: v for k, v in asdict(result.fbd).items()
               if k not in ("world_size", "iteration_times_s", "bubble_fraction", "more")}
    assert summary.fbd.model_dump(include=set(details)) == details
    assert summary.dpp is None  # a decoupled run reports its own memory and idle time
