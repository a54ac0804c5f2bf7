"""The frozen held-out sets (``tests/data/heldout``, recorded by
``tests/zoo_heldout/record.py``, ``tests/data/heldout2``, by
``tests/zoo_heldout2/record.py``, ``tests/data/heldout3``, by
``tests/zoo_heldout3/record.py``, ``tests/data/heldout4``, by
``tests/zoo_heldout4/record.py``, ``tests/data/heldout5``, by
``tests/zoo_heldout5/record.py``, ``tests/data/heldout6``, by
``tests/zoo_heldout6/record.py``, ``tests/data/heldout7``, by
``tests/zoo_heldout7/record.py``, ``tests/data/heldout8``, by
``tests/zoo_heldout8/record.py``, ``tests/data/heldout9``, by
``tests/zoo_heldout9/record.py``, ``tests/data/heldout10``, by
``tests/zoo_heldout10/record.py``, ``tests/data/heldout11``, by
``tests/zoo_heldout11/record.py``, ``tests/data/heldout12``, by
``tests/zoo_heldout12/record.py``, ``tests/data/heldout13``, by
``tests/zoo_heldout13/record.py``, ``tests/data/heldout14``, by
``tests/zoo_heldout14/record.py``, ``tests/data/heldout15``, by
``tests/zoo_heldout15/record.py``, ``tests/data/heldout16``, by
``tests/zoo_heldout16/record.py``, ``tests/data/heldout17``, by
``tests/zoo_heldout17/record.py``, ``tests/data/heldout18``, by
``tests/zoo_heldout18/record.py``, ``tests/data/heldout19``, by
``tests/zoo_heldout19/record.py``, and ``tests/data/heldout20``, by
``tests/zoo_heldout20/record.py``): each plan covers every job and fault,
and each manifest and its traces agree; the scoring reads the sets' runs.
Nothing here runs a detector on them: nothing may be chosen by looking at
results on a held-out set. A set's jobs and plan are committed before it
is recorded; a set is added to ``SETS`` with its data."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from experiments.scan_accuracy import collect, parser
from megatronapp.scan.eval import sets
from tests.zoo_heldout import record
from tests.zoo_heldout2 import record as record2
from tests.zoo_heldout3 import record as record3
from tests.zoo_heldout4 import record as record4
from tests.zoo_heldout5 import record as record5
from tests.zoo_heldout6 import record as record6
from tests.zoo_heldout7 import record as record7
from tests.zoo_heldout8 import record as record8
from tests.zoo_heldout9 import record as record9
from tests.zoo_heldout10 import record as record10
from tests.zoo_heldout11 import record as record11
from tests.zoo_heldout12 import record as record12
from tests.zoo_heldout13 import record as record13
from tests.zoo_heldout14 import record as record14
from tests.zoo_heldout15 import record as record15
from tests.zoo_heldout16 import record as record16
from tests.zoo_heldout17 import record as record17
from tests.zoo_heldout18 import record as record18
from tests.zoo_heldout19 import record as record19
from tests.zoo_heldout20 import record as record20

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
# every set's recorder, in the order the sets were recorded
RECORDERS = (record, record2, record3, record4, record5, record6, record7, record8, record9,
             record10, record11, record12, record13, record14, record15, record16,
             record17, record18, record19, record20)
NAMES = tuple(f"heldout{i + 1 if i else ''}" for i in range(len(RECORDERS)))
FOLDERS = tuple(DATA / name for name in NAMES)
FAULTS = ("extra-calls-2x", "loader-stall", "step-stall", "intermittent-2x-every-3",
          "noisy-neighbour", "two-slowed-2x")
STALL_MS = 50.0
# the fewest healthy runs a set must hold: the first two sets' plans asked for more
FEWEST_HEALTHY = {"heldout": 30, "heldout2": 15}
# each set, its plan, and the fewest healthy runs it must hold
SETS = {name: (folder, record.HELDOUT if r is record else r.PLAN, FEWEST_HEALTHY.get(name, 12))
        for name, folder, r in zip(NAMES, FOLDERS, RECORDERS)}
# each later set and the jobs of the sets before it
LATER = {name: (r, tuple(earlier.JOBS for earlier in RECORDERS[:i]))
         for i, (name, r) in enumerate(zip(NAMES, RECORDERS)) if i}

@pytest.fixture(params=sorted(SETS))
def held_out(request: pytest.FixtureRequest) -> tuple[Path, record.Plan, int]:
    return SETS[request.param]


def recorded(folder: Path) -> None:
    """Every set in ``SETS`` is committed with its data: a missing manifest fails."""
    assert (folder / "manifest.json").is_file(), f"{folder.name}: no manifest.json"


def plan(p: record.Plan) -> list[record.Run]:
    return [run for job in p.jobs for run in p.runs(job, STALL_MS)]


# ------------------------------------------------------------------ the plan
def test_the_plan_runs_every_job_healthy_and_under_every_fault_once(held_out):
    _, p, fewest_healthy = held_out
    runs = plan(p)
    assert len({r.name for r in runs}) == len(runs)
    slowed = tuple(f"slow-{factor:g}x" for factor in p.slowdowns)
    for job in p.jobs:
        names = [r.name for r in runs if r.job is job]
        assert sum("-healthy-" in n for n in names) == p.healthy
        assert all(f"{job.name}-{fault}" in names for fault in FAULTS + slowed)
    assert sum(not r.faults for r in runs) >= fewest_healthy  # false alarms are measurable


@pytest.mark.parametrize("name", sorted(LATER))
def test_a_later_set_slows_a_rank_at_the_bar_and_has_jobs_of_its_own(name):
    recorder, earlier = LATER[name]
    assert min(recorder.PLAN.slowdowns) == sets.MIN_SLOWDOWN  # the bar: 1.3x
    seen = {p.stem for p in (ROOT / "tests" / "zoo").glob("*.py")}
    seen |= {job.name for jobs in earlier for job in jobs}
    assert not {job.name for job in recorder.JOBS} & seen
    for job in recorder.JOBS:
        assert (ROOT / recorder.PLAN.jobs_dir / f"{job.name}.py").is_file()


def test_every_point_to_point_channel_is_slowed_with_and_without_peers_recorded(held_out):
    _, p, _ = held_out
    for job in p.jobs:
        links = [(f, r.record_shapes) for r in plan(p) if r.job is job
                 for f in r.faults if f["kind"] == "slow_link"]
        for channel in job.channels:
            on_it = [(f, shapes) for f, shapes in links if f["channel"] == channel.kind]
            assert {shapes for _, shapes in on_it} == {True, False}
            for fault, _ in on_it:
                assert (fault["sender"], fault["receiver"]) in channel.pairs
                assert record.LINK_MS[0] <= fault["nominal_delay_ms"] <= record.LINK_MS[1]
                seconds = fault["message_bytes"] * 8 / (fault["mbit"] * 1e6)
                assert seconds * 1e3 == pytest.approx(fault["nominal_delay_ms"], rel=0.01)
        assert any(len({f["kind"] for f in r.faults}) == 2 for r in plan(p)
                   if r.job is job) == bool(job.channels)  # a slowed rank and a slow link


@pytest.mark.parametrize("recorder, name, floats", [
    (record4, "gossip_sgd", "PARAMETERS"), (record5, "ring_allreduce_autoencoder", "PARAMETERS"),
    (record6, "context_parallel_tagger", "MESSAGE"), (record7, "zero_bubble_pipeline", "MESSAGE"),
    (record8, "looped_bfs_pipeline", "MESSAGE"),
    (record9, "interleaved_zero_bubble_pipeline", "MESSAGE"),
    (record10, "pipelining_gpipe_dp2", "MESSAGE"), (record11, "batched_p2p_pipeline", "MESSAGE"),
    (record12, "pipeline_1f1b_send_recv_two_stage_dp2", "MESSAGE"),
    (record14, "ring_attention_isend_irecv", "MESSAGE"),
    (record14, "butterfly_allreduce_send_recv", "MESSAGE"),
    (record15, "pipeline_two_stage_dp2_isend_irecv_gpipe_activation_checkpoint", "MESSAGE"),
    (record15, "hierarchical_allreduce_two_level", "MESSAGE"),
    (record17, "pipeline_tp2_pp2_scatter_gather_1f1b", "MESSAGE"),
    (record18, "chimera_bidirectional_pipeline_isend_irecv", "MESSAGE"),
    (record19, "encoder_decoder_pipeline_cross_attention_isend_irecv", "MESSAGE"),
    (record20, "mamba2_sequence_parallel_state_passing_send_recv", "MESSAGE"),
    (record20, "splitfed_u_shaped_server_send_recv", "MESSAGE")])
def test_the_ring_channels_carry_the_message_the_job_sends(recorder, name, floats):
    """Each slow link's rate is sized by one message of the job (gossip's
    parameters, the ring's, the butterfly's and the two-level all-reduce's
    gradients: its parameters' count, flattened; a chunk's keys and values,
    stacked; a microbatch's activations, or a tensor-parallel rank's half of
    them, or in Chimera's two pipelines a microbatch's activations one way
    and its gradients the other, or the encoder-decoder pipeline's encoder
    memory, sent to both decoder stages, or a Mamba-2 block's state passed
    on to the next chunk's rank, or a split-learning client's batch of
    activations), in float32."""
    printed = subprocess.run(
        [sys.executable, "-c", f"import {name}; print({name}.{floats})"], cwd=ROOT,
        env={"PYTHONPATH": f"tests/zoo:{recorder.PLAN.jobs_dir}"}, check=True,
        capture_output=True, text=True).stdout
    (job,) = [job for job in recorder.JOBS if job.name == name]
    assert {c.message_bytes for c in job.channels} == {int(printed) * 4}


def test_the_loader_ranks_pipeline_channels_carry_the_messages_the_job_sends():
    """The sixteenth set's pipeline sends a microbatch's features (from the
    loader rank), activations and their gradients, in float32, on the
    forward, backward and feed channels, and a batch's int64 labels on
    the labels channel."""
    name = "pipeline_three_stage_loader_rank_send_recv"
    printed = subprocess.run(
        [sys.executable, "-c", f"import {name}; print({name}.MESSAGE, {name}.LABELS)"], cwd=ROOT,
        env={"PYTHONPATH": f"tests/zoo:{record16.PLAN.jobs_dir}"}, check=True,
        capture_output=True, text=True).stdout
    floats, labels = map(int, printed.split())
    (job,) = [job for job in record16.JOBS if job.name == name]
    assert {c.kind: c.message_bytes for c in job.channels} == {
        "forward": floats * 4, "backward": floats * 4, "feed": floats * 4, "labels": labels * 8}


def test_drawn_faults_fit_their_job(held_out):
    _, p, _ = held_out
    for run in plan(p):
        for fault in run.faults:
            if fault["kind"] == "loader_stall":
                assert set(fault["ranks"]) <= set(run.job.readers)
            if fault["kind"] == "slow_rank" and len(fault["ranks"]) == 2:
                assert frozenset(fault["ranks"]) not in run.job.exclusive
    assert [r.flags for r in plan(p)] == [r.flags for r in plan(p)]  # drawn, not random


@pytest.mark.parametrize("main", [r.main for r in RECORDERS])
def test_the_recorder_refuses_to_overwrite_a_frozen_set(tmp_path, capsys, main):
    (tmp_path / "manifest.json").write_text("{}")
    assert main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out" in err
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


# ------------------------------------------------------------- the frozen sets
@pytest.fixture
def manifest(held_out) -> dict[str, Any]:
    recorded(held_out[0])
    return dict(json.loads((held_out[0] / "manifest.json").read_text()))


def trace_rank(path: Path) -> int:
    """The rank in a gzipped trace's ``distributedInfo`` (near its start)."""
    with gzip.open(path, "rt") as f:
        head = f.read(8192)
    info, _ = json.JSONDecoder().raw_decode(head, head.index("{", head.index('"distributedInfo"')))
    return int(info["rank"])


def test_every_run_folder_is_in_the_manifest_with_one_trace_per_rank(held_out, manifest):
    folder = held_out[0]
    runs = {e["run"] for e in manifest["runs"]}
    assert len(runs) == len(manifest["runs"])
    assert {p.name for p in folder.iterdir() if p.is_dir()} == runs
    for run in runs:
        files = sorted((folder / run).iterdir())
        assert all(p.name.endswith(".pt.trace.json.gz") for p in files), run
        assert sorted(map(trace_rank, files)) == list(range(record.WORLD)), run


def test_the_manifest_records_each_planned_run_as_the_recorder_plans_it(held_out, manifest):
    """Each run's command is what the recorder plans for it today (the
    stalls sized by the first healthy run it recorded), its faults hit
    traced steps, and what its traces showed is recorded."""
    folder, p, _ = held_out
    entries = manifest["runs"]
    planned = {run.name: run for job in p.jobs
               for run in p.runs(job, record.stall_ms(entries, job))}
    assert {e["run"] for e in entries} == set(planned)
    for entry in entries:
        run = planned[entry["run"]]
        out = folder.relative_to(ROOT) / run.name
        assert entry["command"].split() == record.command(run, out, p.jobs_dir, p.steps), run.name
        traced = list(range(record.FIRST_TRACED, record.FIRST_TRACED + p.steps))
        assert entry["traced_steps"] == traced
        for fault in entry["faults"]:
            assert set(fault["steps_hit"]) <= set(traced)
            assert fault["kind"] in entry["realized"]
        assert {"date", "load", "realized"} <= set(entry)


def test_the_set_names_the_commit_that_froze_its_jobs(manifest):
    frozen = manifest["frozen_at_commit"]
    ancestor = subprocess.run(["git", "merge-base", "--is-ancestor", frozen, "HEAD"], cwd=ROOT)
    assert ancestor.returncode == 0
    assert {"host", "cpu", "cores", "torch"} <= set(manifest["machine"])


def test_the_set_holds_enough_healthy_runs_and_every_fault_kind(held_out, manifest):
    """Every fault kind, slow links where a job sends point to point (a
    set whose jobs meet in collectives only has no channel to slow)."""
    kinds = Counter(f["kind"] for e in manifest["runs"] for f in e["faults"])
    assert sum(not e["faults"] for e in manifest["runs"]) >= held_out[2]
    links = {"slow_link"} if any(job.channels for job in held_out[1].jobs) else set()
    assert set(kinds) == {"slow_rank", "extra_calls", "loader_stall", "optimizer_step_stall",
                          "noisy_neighbour"} | links


def test_the_readme_forbids_choosing_anything_by_the_held_out_results(held_out):
    recorded(held_out[0])
    text = " ".join((held_out[0] / "README.md").read_text().split())
    assert "nothing may be chosen by looking at results on it" in text.lower()


# ------------------------------------------------------------- scoring reads them
def test_the_scoring_reads_each_held_out_set_given_apart():
    folders = list(FOLDERS)
    for folder in folders:
        recorded(folder)
    chosen = collect(parser().parse_args(["--sim-trials", "0", "--heldout", *map(str, folders)]))
    assert set(chosen) == {"tuning", *(f"held-out {f.name}" for f in folders)}
    for folder in folders[1:]:
        entries = json.loads((folder / "manifest.json").read_text())["runs"]
        runs = chosen[f"held-out {folder.name}"]
        assert sorted(r.name for r in runs) == sorted(e["run"] for e in entries)
        assert sum(r.healthy for r in runs) == sum(not e["faults"] for e in entries)


@pytest.mark.parametrize("name", sorted(LATER))
def test_each_job_of_a_later_set_loads_with_every_rank(name):
    """One run per job of each later set (``tests/data/heldout2`` on) read as the
    scoring reads it (parsed and aligned; no detector)."""
    folder, recorder = SETS[name][0], LATER[name][0]
    recorded(folder)
    firsts = {r.job: r for r in reversed(sets.recorded(folder, "heldout"))}
    assert set(firsts) == {job.name for job in recorder.JOBS}
    for run in firsts.values():
        assert run.load().ranks == list(range(record.WORLD)), run.name


def test_scoring_a_set_that_is_not_there_is_one_line_and_status_2(tmp_path, capsys):
    from experiments import scan_accuracy

    missing = tmp_path / "no-such-set"
    code = scan_accuracy.main(["--tuning-only", "--sim-trials", "0", "--tuning-zoo",
                               str(missing), "--methods"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "no-such-set" in err
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []
