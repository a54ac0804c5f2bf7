"""MegaScan against real torch-backend runs: the real-run validation harness
end to end, and the two tracing paths (ours and torch.profiler) on one run."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

from megatronapp.cli import main
from megatronapp.trace.store import read_columns
from megatronapp.scan.align.inputs import load_scan_input
from megatronapp.trace.kinds import event_kind
from megatronapp.scan.eval.trials import REAL, REAL_BANDS, make_real_trial
from megatronapp.parallel.topology import Topology


def test_real_trials_fit_a_small_machine_and_repeat_by_seed():
    trials = [make_real_trial(3, i) for i in range(200)]
    assert trials[7] == make_real_trial(3, 7)
    assert {t.band for t in trials} == set(REAL_BANDS)
    for t in trials:
        p = t.scenario.parallel
        assert p.tp == 1 and 2 <= p.world_size <= 4  # TP runs inside megatron's layers
        if t.truth_pair is not None:  # a faulty link has another pipeline link to compare with
            topo = Topology(tp=1, pp=p.pp, dp=p.dp)
            assert (p.pp - 1) * p.dp >= 2 and topo.pp_neighbor(t.truth_pair[0], 1) == t.truth_pair[1]
        skews = [f for f in t.scenario.faults if f.kind == "clock_skew"]
        assert all(f.rank != 0 for f in skews) and (t.band != "clock_skew only" or skews)


def _run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("argv, fragment", [
    (["validate-detector", "--backend", "torch", "--jobs", "2"], "--jobs:"),
    (["validate-detector", "--backend", "gpu"], "--backend:"),
    (["validate-detector", "--replay", "/nonexistent/corpus"], "--replay:"),
])
def test_validate_detector_bad_options_exit_2(capsys, argv, fragment):
    code, out, err = _run_cli(capsys, *argv)
    assert code == 2 and not out and err.startswith("megatronapp: " + fragment)
    assert len(err.strip().splitlines()) == 1


def test_profile_needs_the_torch_backend(tmp_path, capsys):
    scenario = tmp_path / "s.yaml"
    scenario.write_text(yaml.safe_dump({"parallel": {"pp": 2}}))
    code, _, err = _run_cli(capsys, "run", str(scenario), "--profile", "--out", str(tmp_path / "r"))
    assert code == 2 and err.startswith("megatronapp: --profile:") and not (tmp_path / "r").exists()


@pytest.mark.slow
def test_real_validation_runs_scores_keeps_and_replays_a_trial(tmp_path, capsys):
    corpus, first, again = tmp_path / "corpus", tmp_path / "a.csv", tmp_path / "b.csv"
    code, out, _ = _run_cli(capsys, "validate-detector", "--backend", "torch", "--trials", "1",
                            "--seed", "11", "--save-runs", str(corpus), "--csv", str(first))
    trial = make_real_trial(11, 0)
    assert code == 0 and f"| megascan | {trial.band} | 1 |" in out
    assert "machine load" in out and "s per trial" in out
    saved = corpus / "trial0000"
    assert json.loads((saved / "trial.json").read_text())["band"] == trial.band
    cols, _meta = read_columns(saved / "trace.parquet")  # every rank's events, as runs keep them
    assert sorted(set(cols.rank.tolist())) == list(range(trial.scenario.world_size))
    code, out, _ = _run_cli(capsys, "validate-detector", "--replay", str(corpus), "--csv", str(again))
    assert code == 0
    with open(first) as a, open(again) as b:
        assert list(csv.reader(a)) == list(csv.reader(b))  # the same scores from the kept traces
    methods = {row[0] for row in csv.reader(open(first))} - {"method"}
    assert methods == {"megascan", "slowest-mean", "nvidia-0.75", "hta-latest", "megatronapp-orig"}
    assert REAL.bands == REAL_BANDS


def _compute_names(events: dict) -> dict[int, list[str]]:
    return {r: [e.name for e in evs if event_kind(e.name, e.args) == "compute"
                and e.name in ("forward", "backward", "optimizer")] for r, evs in events.items()}


@pytest.mark.slow
@pytest.mark.alone  # a throttled rank judged on real timing
def test_profiled_run_gives_the_same_verdict_from_both_traces(tmp_path, capsys):
    scenario = tmp_path / "throttled.yaml"
    scenario.write_text(yaml.safe_dump({
        "name": "throttled", "seed": 3, "iterations": 4, "schedule": "1f1b",
        "parallel": {"tp": 1, "pp": 1, "dp": 2, "microbatches": 6},
        "model": {"layers": 2, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 64,
                  "micro_batch_size": 2},
        "faults": [{"kind": "throttle", "rank": 1, "factor": 4.0}]}))
    run_dir = tmp_path / "run"
    code, out, _ = _run_cli(capsys, "run", str(scenario), "--backend", "torch", "--profile",
                            "--out", str(run_dir), "--quiet")
    assert code == 0 and "profile" in out
    profile = run_dir / "profile"
    assert sorted(p.name for p in profile.iterdir()) == ["rank0.pt.trace.json.gz",
                                                         "rank1.pt.trace.json.gz"]
    ours, theirs = load_scan_input(run_dir), load_scan_input(profile)
    assert _compute_names(ours.events) == _compute_names(theirs.events)  # one op, one range
    verdicts = []
    for target in (run_dir, profile):
        code, out, _ = _run_cli(capsys, "detect", str(target), "--json")
        verdicts.append([(c["rank"], c["kind"]) for c in json.loads(out)["root_causes"]])
    assert verdicts[0] == verdicts[1]
