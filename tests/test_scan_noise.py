"""MegaScan's noise is measured on the others: a suspect's own excess never
widens the bar it is judged against; and a healthy run in which the machine
alone made a straggler is reported apart, not counted as a false alarm."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from hypothesis import given, settings, strategies as st

from megatronapp.scan.eval import sets
from megatronapp.scan.eval.tuning import outcome_of, scores
from megatronapp.scan.evidence.detect import NoiseModel
from megatronapp.scan.ingest.sketch import Reservoirs


def _noise(excess: dict[int, list[float]]) -> NoiseModel:
    samples: Reservoirs = Reservoirs(64)
    samples.add_all({("compute", r): np.asarray(v) for r, v in excess.items()})
    return NoiseModel(samples, {}, fewest=4)


@settings(max_examples=60, deadline=None)
@given(st.integers(3, 8), st.integers(3, 6), st.floats(1.0, 50.0), st.integers(0, 2**31 - 1))
def test_a_suspects_own_excess_does_not_widen_its_own_bar(ranks, iterations, swing, seed):
    """However wildly one suspect's excess swings from one iteration to the
    next, its noise is what its peers show."""
    rng = np.random.default_rng(seed)
    calm = {r: (0.05 * rng.standard_normal(iterations)).tolist() for r in range(ranks)}
    wild = dict(calm)
    wild[0] = (swing * np.abs(rng.standard_normal(iterations)) + 1.0).tolist()
    assert _noise(wild).sigma(("compute", 0)) == _noise(calm).sigma(("compute", 0))


def test_a_single_suspect_falls_back_to_its_own_iterations():
    """With no other suspect of its kind there is nothing to leave it out of."""
    alone = _noise({0: [0.0, 0.1, -0.1, 0.2]}).sigma(("compute", 0))
    assert np.isfinite(alone) and alone > 0


def _manifest(tmp_path: Path, spreads: list[float]) -> Path:
    runs = [{"run": f"job-healthy-{i}", "job": "job", "faults": [], "record_shapes": False,
             "realized": {"max_compute_over_peers": s}} for i, s in enumerate(spreads)]
    runs.append({"run": "job-slow-2x", "job": "job", "record_shapes": False,
                 "faults": [{"kind": "slow_rank", "ranks": [1]}],
                 "realized": {"max_compute_over_peers": 2.0,
                              "slow_rank": {"compute_over_peers": {"1": 1.8}}}})
    (tmp_path / "manifest.json").write_text(json.dumps({"runs": runs}))
    return tmp_path


def test_a_healthy_run_with_a_machine_made_straggler_is_shown_not_counted(tmp_path):
    runs = sets.recorded(_manifest(tmp_path, [1.05, 1.29, 1.3, 2.4]), "tuning-zoo")
    healthy = [r for r in runs if r.healthy]
    assert [r.eligible for r in healthy] == [True, True, False, False]
    assert [r.category for r in healthy] == ["healthy", "healthy", sets.STRAGGLED, sets.STRAGGLED]
    faulted = next(r for r in runs if not r.healthy)
    assert faulted.eligible and faulted.category == "slow-2x"
    # a detector that names a rank in every run: two false alarms counted, not four
    from megatronapp.scan.diagnosis import RootCause
    named = (RootCause(1, "compute", None, 0.9, {}),)
    s = scores([outcome_of(r, named) for r in runs])
    assert (s.healthy, s.false_alarms, s.faulted, s.named_first) == (2, 2, 1, 1)


def test_the_slow_at_no_cost_list_is_scored_apart_from_the_causes(tmp_path):
    """A fault first in the list of what is slow at no cost is not named first
    (no cause names it) but is flagged first; a cause ahead of the list
    comes first; a healthy run with anything listed is flagged."""
    from megatronapp.scan.diagnosis import RootCause
    runs = sets.recorded(_manifest(tmp_path, [1.05]), "tuning-zoo")
    healthy, faulted = (next(r for r in runs if r.healthy), next(r for r in runs if not r.healthy))
    slow = (RootCause(1, "compute", None, 0.9, {}),)
    other = (RootCause(2, "compute", None, 0.9, {}),)
    listed = outcome_of(faulted, (), slow=slow)
    assert (listed.verdict, listed.flagged_first, listed.flagged) == ("missed", True, True)
    behind = outcome_of(faulted, other, slow=slow)
    assert (behind.verdict, behind.flagged_first) == ("wrong", False)
    quiet = outcome_of(healthy, (), slow=other)
    assert (quiet.verdict, quiet.flagged, quiet.flagged_first) == ("quiet", True, False)
    assert outcome_of(healthy, ()).flagged is False


def test_two_links_of_one_class_are_each_others_partner():
    """In tp 1, pp 2, dp 2 each direction of the pipeline has two links: the
    faster is its own expectation and the slower's, so each one's noise may
    not be read off the other (it would be nought, and any excess endless)."""
    from megatronapp.scan.eval.validate import scan_of_result
    from megatronapp.scan.evidence.expected import link_table
    from megatronapp.scan.evidence.graph import graph_of
    from megatronapp.scenario.config import parse_scenario
    from sim import run_sim

    s = parse_scenario({"seed": 3, "iterations": 3,
                        "parallel": {"tp": 1, "pp": 2, "dp": 2, "microbatches": 4},
                        "model": {"layers": 8, "hidden": 512, "heads": 8, "seq_len": 512},
                        "cluster": {"jitter": {"compute_sigma": 0.03, "link_sigma": 0.05}}})
    scan = scan_of_result(run_sim(s), scenario=s)
    table = link_table(graph_of(scan.cols, scan.sync), scan.cols, scan.gpus_per_node)
    partners = dict(zip(table.keys, table.partner or ()))
    assert partners == {(0, 2): (1, 3), (1, 3): (0, 2)}
