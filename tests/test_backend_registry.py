"""The CLI runs backends through the registry and the ``Backend`` protocol:
``--backend`` accepts the registry's names, options travel typed, and an
option a backend cannot take is one line naming it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from backends import registry
from megatronapp.program.backend import PROFILE, RunHooks, RunOptions
from megatronapp.cli import main
from megatronapp.scenario.config import Scenario
from megatronapp.trace.events import RunResult

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = str(ROOT / "scenarios" / "throttle.yaml")


class RecordingBackend:
    """A backend the project does not ship: the simulator, keeping the options it got."""

    name = "recording"
    capabilities = frozenset({PROFILE})
    seen: list[RunOptions] = []

    def run(self, scenario: Scenario, options: RunOptions, hooks: RunHooks) -> RunResult:
        from sim import simulate

        self.seen.append(options)
        return simulate(scenario, hooks)


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> list[RunOptions]:
    monkeypatch.setitem(registry.BACKENDS, "recording", (__name__, "RecordingBackend"))
    monkeypatch.setitem(registry.DESCRIPTIONS, "recording", "the simulator, recorded")
    RecordingBackend.seen.clear()
    return RecordingBackend.seen


def test_run_takes_any_registered_backend_and_hands_it_typed_options(
        recording: list[RunOptions], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(["run", SCENARIO, "--backend", "recording", "--profile", "--out", str(out),
                 "--quiet", "--json"]) == 0
    (options,) = recording
    assert options.profile_dir is not None and options.profile_dir.name == "profile"
    assert options.stall_timeout_s is None and not options.replica
    summary = json.loads(capsys.readouterr().out)
    assert summary["iteration_times_s"] == json.loads(
        (out / "summary.json").read_text())["iteration_times_s"]


@pytest.mark.parametrize("option", [["--profile"], ["--stall-timeout", "5"]])
def test_an_option_the_backend_cannot_take_is_one_line_and_writes_nothing(
        option: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(["run", SCENARIO, "--backend", "sim", *option, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"megatronapp: {option[0]}: the sim backend does not take it\n"
    assert not out.exists()


def test_backend_choices_are_the_registry_names(recording: list[RunOptions], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", SCENARIO, "--backend", "nonesuch", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert all(f"'{name}'" in err for name in registry.backend_names())


@pytest.mark.parametrize("command", [
    ["scope", "patch", "RUN", "--clean", "ab", "--corrupt", "ac"],
    ["scope", "lens", "RUN", "--prompt", "ab"],
    ["scope", "dla", "RUN", "--prompt", "ab"],
    ["scope", "generate", "RUN", "--prompt", "ab", "--out", "OUT"],
])
def test_scope_commands_ask_the_registry_for_the_backend_that_runs_checkpoints(
        command: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Registered as "torch", a backend without the capability is refused by name."""
    from megatronapp.scope.storage import FORMAT

    monkeypatch.setitem(registry.BACKENDS, "torch", (__name__, "RecordingBackend"))
    run_dir = tmp_path / "run"
    (run_dir / "scope").mkdir(parents=True)  # a capture the results would join
    (run_dir / "scope" / "manifest.json").write_text(json.dumps({"format": FORMAT}))
    paths = {"RUN": str(run_dir), "OUT": str(tmp_path / "out")}
    assert main([paths.get(arg, arg) for arg in command]) == 2
    err = capsys.readouterr().err
    assert err == "megatronapp: the torch backend does not run MegaScope's checkpoints\n"
    assert not (tmp_path / "out").exists()
