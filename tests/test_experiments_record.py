"""Every experiment with a ``main`` writes ``results/NAME.json`` through
``experiments.results.start`` (directly or through the module whose run it
is), or is listed here with the reason it records nothing."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"

RECORDS_NOTHING = {
    "render": "writes README and docs from the results files; measures nothing",
    "zoo_tuning": "records a trace set under --out (the traces scan_accuracy scores), no table",
    "intermittent_bar": "prints a diagnostic table for the journal (the intermittent bar's "
                        "trade-off on recorded healthy runs); no page renders from it",
    "compute_statistics": "prints a diagnostic table for the journal (which compute "
                          "statistic separates slowed ranks on recorded runs); no page "
                          "renders from it",
}
RECORDS_THROUGH = {  # experiment -> the module whose run (and results.start) it is
    "scan_today": "scan_accuracy",
}


def _results_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """The names this module binds to ``experiments.results`` and to its ``start``."""
    modules, starts = set(), set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        for alias in node.names:
            bound = alias.asname or alias.name
            if node.module in ("experiments", None) and alias.name == "results":
                modules.add(bound)
            elif node.module in ("experiments.results", "results") and alias.name == "start":
                starts.add(bound)
    return modules, starts


def calls_start(source: str) -> bool:
    """Whether ``source`` calls ``experiments.results.start`` (by any name it imports it as)."""
    tree = ast.parse(source)
    modules, starts = _results_names(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in starts:
            return True
        if (isinstance(f, ast.Attribute) and f.attr == "start" and isinstance(f.value, ast.Name)
                and f.value.id in modules):
            return True
    return False


def has_main(source: str) -> bool:
    return any(isinstance(n, ast.FunctionDef) and n.name == "main"
               for n in ast.parse(source).body)


def source(name: str) -> str:
    return (EXPERIMENTS / f"{name}.py").read_text()


MAINS = sorted(p.stem for p in EXPERIMENTS.glob("*.py") if has_main(p.read_text()))


def test_every_experiment_records_or_says_why_not() -> None:
    silent = [name for name in MAINS if not calls_start(source(name))
              and name not in RECORDS_NOTHING and name not in RECORDS_THROUGH]
    assert not silent, f"neither call results.start nor are listed with a reason: {silent}"


def test_the_listed_ones_are_experiments_that_record_nothing_themselves() -> None:
    listed = {**RECORDS_NOTHING, **RECORDS_THROUGH}
    assert set(listed) <= set(MAINS)
    assert not [name for name in listed if calls_start(source(name))]


def test_a_delegating_experiment_runs_a_module_that_records() -> None:
    for name, through in RECORDS_THROUGH.items():
        assert calls_start(source(through)), through
        assert f"{through}." in source(name), f"{name} does not run {through}"


def test_the_check_tells_a_recording_main_from_a_silent_one() -> None:
    silent = "def main() -> None:\n    print('| a | 1 |')\n"
    assert has_main(silent) and not calls_start(silent)
    assert calls_start("from experiments import results\n"
                       "def main():\n    results.start('x').record({})\n")
    assert calls_start("from experiments import results as r\ndef main():\n    r.start('x')\n")
    assert calls_start("from experiments.results import start\ndef main():\n    start('x')\n")
    assert not calls_start("import time\ndef main():\n    time.start('x')\n")


def test_a_part_is_recorded_beside_the_parts_other_runs_recorded(tmp_path: Path) -> None:
    from experiments.results import Run, read

    Run("demo_modes", ["compare"], [0.0] * 3).record_part("compare", {"rows": [1]}, tmp_path)
    Run("demo_modes", ["versus", "--x"], [0.0] * 3).record_part("versus", [2], tmp_path)
    Run("demo_modes", ["compare", "-y"], [0.0] * 3).record_part("compare", {"rows": [3]},
                                                                  tmp_path)
    doc = read("demo_modes", tmp_path)
    parts = doc["data"]["parts"]
    assert {k: v["data"] for k, v in parts.items()} == {"compare": {"rows": [3]},
                                                         "versus": [2]}
    assert parts["versus"]["command"] == "python -m experiments.demo_modes versus --x"
    assert doc["command"] == "python -m experiments.demo_modes compare -y"


def test_printed_table_lines_are_recorded_as_their_cells(capsys) -> None:
    from experiments.results import Printed

    show = Printed()
    show("| job | mean \\|error\\| |\n|---|---:|")
    show("| a | 1.5% |")
    show("not a table line")
    assert capsys.readouterr().out.splitlines()[2] == "| a | 1.5% |"
    assert show.cells() == [["job", "mean |error|"], ["a", "1.5%"]]
