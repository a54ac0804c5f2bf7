"""MegaScan's model: the replay of a trace's dependency graph, blame in
seconds, and what the detector may read (the trace, never what was injected)."""
from __future__ import annotations

import builtins
import json
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from megatronapp.cli import main
from megatronapp.scan.align.inputs import load_scan_input
from megatronapp.scan.eval.validate import scan_of_result
from megatronapp.scan.evidence.blame import blame_batch
from megatronapp.scan.evidence.detect import megascan
from megatronapp.scan.evidence.graph import COMPUTE, graph_of
from megatronapp.scan.evidence.replay import Replayer, Suspects, critical_share
from megatronapp.scenario.config import parse_scenario
from sim import run_sim


def _scenario(tp: int, pp: int, dp: int, seed: int, faults: list[dict] | None = None,
              iterations: int = 2):
    return parse_scenario({
        "seed": seed, "iterations": iterations,
        "parallel": {"tp": tp, "pp": pp, "dp": dp, "microbatches": max(4, 2 * pp)},
        "model": {"layers": 4 * pp, "hidden": 512, "heads": 8, "seq_len": 512},
        "cluster": {"jitter": {"compute_sigma": 0.03, "link_sigma": 0.05}},
        "faults": faults or []})


def _scan(tp: int, pp: int, dp: int, seed: int, faults: list[dict] | None = None,
          iterations: int = 2):
    s = _scenario(tp, pp, dp, seed, faults, iterations)
    return scan_of_result(run_sim(s), scenario=s)


layouts = st.tuples(st.sampled_from([1, 2]), st.sampled_from([1, 2, 3]),
                    st.sampled_from([1, 2, 4]), st.integers(0, 10_000))
quick = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@quick
@given(layouts)
def test_replaying_the_recorded_durations_gives_back_each_iterations_end(layout):
    scan = _scan(*layout)
    g = graph_of(scan.cols, scan.sync)
    recorded = np.full(len(g.iterations), -np.inf)
    np.maximum.at(recorded, g.iteration[g.blocking], g.end[g.blocking])
    replayed = Replayer.of(g).recorded_ends()
    assert np.allclose(replayed, recorded, rtol=0, atol=1e-9)


@quick
@given(layouts, st.integers(0, 2**31 - 1))
def test_taking_less_time_anywhere_never_ends_an_iteration_later(layout, draw_seed):
    scan = _scan(*layout)
    g = graph_of(scan.cols, scan.sync)
    replayer = Replayer.of(g)
    rng = np.random.default_rng(draw_seed)
    none = Suspects.none(g)
    picked = [np.where(rng.random(len(a)) < 0.3, rng.integers(0, 3, len(a)), -1)
              for a in (none.compute, none.host, none.link)]
    suspects = Suspects(*picked, rng.uniform(0.0, 1.0, (3, len(g.iterations))))
    shortened = replayer.ends(suspects, np.ones(3, np.bool_))
    # a rounding overlap (a gap below zero) shortened is an overlap made smaller
    overlaps = -g.gap[g.gap < 0].sum()
    assert np.all(shortened <= replayer.recorded_ends() + overlaps + 1e-12)


def _finding(scan, kind: str, key):
    batch = blame_batch(scan, {}, 16)
    return next(f for f in batch.findings if f.kind == kind and f.key == key)


def test_a_throttled_data_parallel_rank_is_blamed_about_what_it_is_late():
    # every all-reduce waits for it: the iteration ends as late as its own excess
    scan = _scan(1, 1, 4, 3, [{"kind": "throttle", "rank": 2, "factor": 1.5}])
    f = _finding(scan, "compute", 2)
    excess = f.actual - f.expected
    assert np.all(excess > 0)
    assert np.all(f.blame > 0.8 * excess) and np.all(f.blame <= excess * 1.05)


def test_two_slow_ranks_at_once_are_each_blamed_their_own_delay():
    # fixing one alone would not speed the job (the other still holds it);
    # each is blamed what it alone costs a job whose others ran as expected.
    # Half the group is slow: the noise is how each rank's excess moves from
    # one iteration to the next, which two steady faults do not inflate
    scan = _scan(1, 1, 4, 3, [{"kind": "throttle", "rank": 1, "factor": 1.5},
                              {"kind": "throttle", "rank": 2, "factor": 1.4}], iterations=4)
    for rank in (1, 2):
        f = _finding(scan, "compute", rank)
        assert np.all(f.blame > 0.5 * (f.actual - f.expected)), rank
    d = megascan(scan)
    assert {c.rank for c in d.root_causes} == {1, 2}


def test_a_blame_never_exceeds_the_time_its_suspect_ran_over():
    scan = _scan(2, 2, 2, 11, [{"kind": "throttle", "rank": 5, "factor": 1.6}])
    for f in blame_batch(scan, {}, 16).findings:
        # (a microsecond for the timestamps' rounding along the path)
        assert f.blame.sum() <= max((f.actual - f.expected).sum(), 0.0) + 1e-6, (f.kind, f.key)


def test_the_critical_path_of_a_pipeline_is_held_mostly_by_its_slowest_stage():
    scan = _scan(1, 3, 1, 5, [{"kind": "throttle", "rank": 1, "factor": 3.0}])
    g = graph_of(scan.cols, scan.sync)
    share = critical_share(Replayer.of(g))
    held = share.compute + share.host + share.communication
    assert np.all(np.argmax(held, axis=1) == 1)
    # the path's time never exceeds its iteration
    assert np.all(held.sum(axis=1) <= np.diff(np.r_[g.start.min(), np.maximum.accumulate(
        Replayer.of(g).recorded_ends())]) + 1e-6)
    assert set(np.unique(g.how).tolist()) >= {COMPUTE}


def test_the_detector_never_reads_what_was_injected(tmp_path: Path, monkeypatch, capsys):
    run = tmp_path / "run"
    scenario = tmp_path / "s.yaml"
    scenario.write_text(json.dumps({
        "seed": 3, "iterations": 2, "parallel": {"tp": 1, "pp": 1, "dp": 4, "microbatches": 4},
        "model": {"layers": 4, "hidden": 512, "heads": 8, "seq_len": 512},
        "faults": [{"kind": "throttle", "rank": 2, "factor": 1.5},
                   {"kind": "clock_skew", "rank": 1, "offset_us": 3000, "drift_ppm": 20}]}))
    assert main(["run", str(scenario), "--out", str(run), "--quiet"]) == 0
    assert (run / "ground_truth.json").is_file()
    # the scenario the detector gets is the job without its faults
    assert load_scan_input(run).scenario.faults == ()
    opened: list[str] = []
    real_path_open, real_open = Path.open, builtins.open

    def path_spy(self: Path, *args, **kwargs):
        opened.append(self.name)
        return real_path_open(self, *args, **kwargs)

    def spy(file, *args, **kwargs):
        opened.append(Path(str(file)).name)
        return real_open(file, *args, **kwargs)
    monkeypatch.setattr(Path, "open", path_spy)
    monkeypatch.setattr(builtins, "open", spy)
    capsys.readouterr()
    assert main(["detect", str(run), "--json"]) == 0
    verdict = json.loads(capsys.readouterr().out)
    assert "ground_truth.json" not in opened
    assert verdict["root_causes"][0]["rank"] == 2


def test_a_throttled_rank_is_named_not_the_last_stages_that_hold_the_output_layer():
    # tp 1, pp 4, dp 2, a 32k vocabulary: both replicas' last stage compute the
    # logits too, and each is its replica's peer; the throttled stage-1 rank is named
    s = parse_scenario({
        "seed": 9, "iterations": 3,
        "parallel": {"tp": 1, "pp": 4, "dp": 2, "microbatches": 8},
        "model": {"layers": 8, "hidden": 1024, "heads": 16, "seq_len": 1024, "vocab": 32000},
        "cluster": {"jitter": {"compute_sigma": 0.03, "link_sigma": 0.05}},
        "faults": [{"kind": "throttle", "rank": 3, "factor": 1.3}]})
    d = megascan(scan_of_result(run_sim(s), scenario=s))
    assert [c.rank for c in d.root_causes] == [3]
    assert d.root_causes[0].kind == "compute"


def test_the_fits_fast_verdicts_are_the_outcomes_verdicts():
    """``fit_thresholds`` judges each grid point without building causes; it
    must reach the verdict ``outcome`` reaches, for any thresholds."""
    from megatronapp.scan.eval.sets import LabelledRun
    from megatronapp.scan.eval.tuning import Case, _fast_verdict, _suspects, outcome
    from megatronapp.scan.evidence.detect import Detector
    from megatronapp.scan.evidence.params import Params

    for faults, truth in (([{"kind": "throttle", "rank": 1, "factor": 1.5},
                            {"kind": "throttle", "rank": 2, "factor": 1.2}], (("rank", 1, None),
                                                                              ("rank", 2, None))),
                          ([], ())):
        scan = _scan(1, 2, 2, 13, faults, iterations=4)
        d = Detector(scan.gpus_per_node, scan.scenario)
        d.feed(scan)
        run = LabelledRun("t", "sim", "tp1 pp2 dp2", "x", truth, 1.5, True, True, lambda: scan)
        case = Case(run, tuple(d.evidence()))
        for p in (Params(), Params(noise_multiple=1, min_slowdown=0.05, min_share=0.0,
                                   recur_multiple=3), Params(noise_multiple=50)):
            o = outcome(case, p)
            assert _fast_verdict(run, _suspects(case), p) == (o.verdict, o.all_named), p


def test_no_part_of_megascan_but_its_evaluation_mentions_what_was_injected():
    """Reading, aligning, judging and following a trace never touch a
    scenario's faults or a run's ground truth (the one exception strips the
    faults off the scenario the detector is given)."""
    root = Path(__file__).resolve().parents[1] / "megatronapp" / "scan"
    found = []
    for part in ("ingest", "align", "evidence", "online"):
        for path in sorted((root / part).glob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#")[0]
                if ("ground_truth" in code or ".faults" in code) and "def job_of" not in code:
                    found.append(f"{path.relative_to(root)}: {line.strip()}")
    assert found == ["ingest/work.py: return s if s is None or not s.faults else "
                     "s.model_copy(update={\"faults\": ()})"]


def test_a_rank_slowed_every_third_iteration_is_named_for_the_iterations_it_hits():
    # throttled 2x in iterations 2 and 5 of six: not slow in every iteration seen,
    # so only the intermittent path (two iterations far out) can name it; its
    # bar is set here (about 48 noise units where it strikes), not the fitted one
    from megatronapp.scan.evidence.params import Params

    s = _scenario(1, 2, 2, 21, [{"kind": "throttle", "rank": 1, "factor": 2.0,
                                 "every_k_iterations": 3}], iterations=6)
    d = megascan(scan_of_result(run_sim(s), scenario=s), Params(recur_multiple=20.0))
    assert d.root_causes and d.root_causes[0].rank == 1
    assert d.root_causes[0].evidence["iterations_hit"] == [2, 5]


def test_one_far_out_iteration_is_a_hiccup_and_two_are_a_recurring_fault():
    from megatronapp.scan.evidence.detect import named_iterations
    from megatronapp.scan.evidence.params import Params

    p = Params(recur_multiple=10.0)
    every = np.array([True, True, True])
    assert named_iterations(np.array([2.0, 3.0, 2.5]), every, p).all()  # persistent
    once = np.array([False, True, False])
    assert not named_iterations(np.array([0.1, 50.0, 0.2]), once, p).any()
    twice = np.array([True, False, True, False])
    assert named_iterations(np.array([40.0, 0.1, 30.0, 0.3]), twice, p).tolist() == twice.tolist()
    weak = np.array([True, False, True, False])  # recurs, but not far enough out
    assert not named_iterations(np.array([4.0, 0.1, 3.0, 0.3]), weak, p).any()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from([0.0, 1.0, 2.0, float("-inf")])),
                max_size=30))
def test_the_op_that_ends_each_iteration_is_the_latest_end_the_last_of_ties(ops):
    from megatronapp.scan.evidence.replay import _last_ends

    iteration = np.array([i for i, _ in ops], np.int64)
    ends = np.array([e for _, e in ops], float)
    expected = np.full(4, -1, np.int64)
    for j in np.argsort(ends, kind="stable").tolist():  # the plain reading: the last write wins
        if np.isfinite(ends[j]):
            expected[iteration[j]] = j
    assert _last_ends(iteration, ends, 4).tolist() == expected.tolist()
