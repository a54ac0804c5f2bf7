"""The zoo of ordinary PyTorch jobs (``tests/zoo``, no megatronapp code in
them): each writes one torch.profiler trace per rank that megatronapp reads,
and the slow rank it is asked for really computes more, by its own trace.
(What MegaScan and its baselines make of these traces is measured by
``experiments/zoo_table.py``, not asserted here.)"""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from megatronapp.cli import main
from megatronapp.scan.ingest.kineto import kineto_files, load_kineto, read_json_any
from tests.zoo.measure import fastest_matmul_us, realized_slowdown

ROOT = Path(__file__).resolve().parents[1]
ZOO = ROOT / "tests" / "zoo"
WORLD, STEPS = 4, 2
JOBS = ("ddp_mlp.py", "fsdp2_mlp.py", "pipeline_1f1b.py", "pipelining_1f1b.py",
        "allreduce_uneven.py", "tp_mlp.py")


def run_job(script: str, out: Path, *flags: str) -> Path:
    subprocess.run([sys.executable, str(ZOO / script), "--out", str(out), "--world", str(WORLD),
                    "--steps", str(STEPS), *flags],
                   check=True, capture_output=True, timeout=600, cwd=ROOT)
    return out


def traces_by_rank(out: Path) -> dict[int, dict]:
    traces = [json.loads(path.read_text()) for path in kineto_files(out)]
    by_rank = {int(t["distributedInfo"]["rank"]): t for t in traces}
    assert len(by_rank) == len(traces)  # one file per rank
    return by_rank


def load_gz(path: Path) -> dict:
    return dict(read_json_any(path))


def step_ranges(trace: dict) -> int:
    return sum(1 for e in trace["traceEvents"] if str(e.get("name")).startswith("ProfilerStep#"))


def analyzed_ranks(out: Path, capsys: pytest.CaptureFixture[str]) -> set[str]:
    assert main(["analyze", str(out), "--json"]) == 0
    return set(json.loads(capsys.readouterr().out)["ranks"])


@pytest.mark.slow
@pytest.mark.parametrize("script", JOBS)
def test_a_healthy_zoo_job_writes_one_trace_per_rank_that_analyze_reads(script, tmp_path,
                                                                        capsys):
    out = run_job(script, tmp_path, "--annotate")
    traces = traces_by_rank(out)
    assert sorted(traces) == list(range(WORLD))
    assert Counter(step_ranges(t) for t in traces.values()) == {STEPS: WORLD}
    assert analyzed_ranks(out, capsys) == {str(rank) for rank in range(WORLD)}


@pytest.mark.slow
@pytest.mark.alone  # a slow rank judged on real timing
@pytest.mark.parametrize("script", JOBS)
def test_a_slowed_rank_computes_more_than_its_peers_by_its_own_trace(script, tmp_path):
    out = run_job(script, tmp_path, "--slow-rank", "1", "--factor", "3")
    assert realized_slowdown(fastest_matmul_us(out), slow_rank=1) > 1.5  # 3x the rows


@pytest.mark.slow
def test_without_profiler_steps_a_trace_has_no_step_ranges_and_is_still_read(tmp_path, capsys):
    out = run_job("tp_mlp.py", tmp_path, "--no-profiler-steps")
    traces = traces_by_rank(out)
    assert sorted(traces) == list(range(WORLD))
    assert not any(step_ranges(t) for t in traces.values())
    assert analyzed_ranks(out, capsys) == {str(rank) for rank in range(WORLD)}


def idle_after(trace: dict, span: dict) -> float:
    """µs from ``span``'s end to the next event its thread starts."""
    end = span["ts"] + span["dur"]
    later = [e["ts"] for e in trace["traceEvents"] if e.get("ph") == "X"
             and e.get("tid") == span["tid"] and e["ts"] >= end]
    return min(later) - end


@pytest.mark.slow
def test_a_slowed_link_holds_each_of_its_receivers_before_wait(tmp_path):
    """With ``record_shapes`` a receive names its source: each receive over
    link 1-2 is followed by the receiver's sleep before ``wait()`` (a floor
    the sleep sets, however loaded the machine), on both sides of the link."""
    delay_ms = 20.0
    out = run_job("pipeline_1f1b.py", tmp_path, "--record-shapes", "--slow-link", "1", "2",
                  "--delay-ms", str(delay_ms))
    traces = traces_by_rank(out)
    for receiver, sender in ((2, 1), (1, 2)):
        trace = traces[receiver]
        receives = [e for e in trace["traceEvents"] if e.get("name") == "c10d::recv_"
                    and e["args"]["Concrete Inputs"][2] == str(sender)]
        assert len(receives) == STEPS * 8  # one per microbatch and step
        assert min(idle_after(trace, e) for e in receives) >= delay_ms * 1e3


def _record(fault: str, realized: float, verdict: str, phantom: list | None = None) -> dict:
    return {"kind": "ddp", "fault": fault, "realized": realized,
            "methods": {"megascan": {"verdict": verdict, "phantom": phantom or [],
                                     "root_causes": []}}}


def test_the_goal_counts_only_slowed_ranks_the_trace_shows_slow_enough():
    from experiments.zoo_table import goal

    records = [_record("rank 1 x2.0", 1.6, "right"), _record("rank 1 x1.5", 1.2, "missed"),
               _record("rank 1 x2.0", 1.5, "missed"), _record("link 1-2 +5 ms", 1.1, "right"),
               _record("healthy", 1.3, "false alarm", [[0, 3]]), _record("healthy", 1.1, "right")]
    assert goal(records, ["megascan"]) == (
        "megascan: slowed ranks (realized >= 1.5x) named first 1 of 2; slow links named first "
        "1 of 1; false alarms 1 of 2 healthy; phantom links in 1 of 6 runs")



def test_a_table_from_kept_records_is_printed_and_recorded(tmp_path, capsys):
    from experiments.results import read
    from experiments.zoo_table import main

    records = [_record("rank 1 x2.0", 1.6, "right"), _record("healthy", 1.1, "false alarm")]
    kept = tmp_path / "zoo.json"
    kept.write_text(json.dumps(records))
    assert main(["--table-from", str(kept), "--methods", "megascan",
                 "--results-dir", str(tmp_path / "results")]) == 0
    printed = capsys.readouterr().out
    data = read("zoo_table", tmp_path / "results")["data"]
    assert data["records"] == records and data["goal"][0] in printed
    assert [row[:3] for row in data["cells"]] == [["job", "fault", "runs"],
                                                  ["ddp", "rank 1 x2.0", "1"],
                                                  ["ddp", "healthy", "1"]]
    assert [row[4] for row in data["cells"][1:]] == ["right 1", "false alarm 1"]

@pytest.mark.slow
@pytest.mark.alone  # a throttled stage judged on real timing
def test_megatron_core_profiled_by_the_torch_backend_names_its_throttled_stage(tmp_path):
    """The zoo's Megatron-core job: ``megatronapp run --backend torch
    --profile`` with the scenario's throttle on a middle stage; ``detect``
    on its torch.profiler folder (not the run's own trace) names that stage.
    Real timing on a shared machine: where a busy neighbour's load makes the
    first run name something else, the job runs once more from an empty
    folder, and the failure shows both runs' causes."""
    from experiments import zoo_table

    fault = next(f for f in zoo_table.FAULTS if f.expected and f.factor == 2.0)
    verdicts = []
    for attempt in ("first", "second"):
        traces = zoo_table.run_megatron(fault, tmp_path / attempt)
        assert sorted(p.name for p in traces.iterdir()) == [
            f"rank{r}.pt.trace.json.gz" for r in range(zoo_table.WORLD)]
        causes = zoo_table.detect(traces, "megascan")["root_causes"]
        verdicts.append(causes)
        if causes and (causes[0]["kind"], causes[0]["rank"]) == ("compute", zoo_table.SLOW_RANK):
            return
    pytest.fail(f"rank {zoo_table.SLOW_RANK}'s compute not named first in two runs: {verdicts}")


@pytest.mark.slow
@pytest.mark.alone  # a slow link judged on real timing
def test_megatron_core_profiled_with_a_slow_link_records_every_send_and_names_the_link(
        tmp_path, monkeypatch):
    """The torch backend's slow link lets its sends leave late from a thread
    of their own: the profile (every thread profiled) still holds every
    send, one ``ProfilerStep`` per iteration, and the peers the sends and
    receives' timing forces, on pipeline links only. Each send shows as
    posted when the program posted it, so the receive's wait past it is the
    link's: ``detect`` names link 1-2 first (20 ms a message, well above a
    loaded machine's delivery noise). Twelve iterations, not the zoo's six:
    a receive posted after the delay ends shows none of it, and on a quiet
    machine six iterations left the link's rank-sum z at its bar of 2."""
    from experiments import zoo_table

    monkeypatch.setattr(zoo_table, "DELAY_MS", 20.0)
    monkeypatch.setattr(zoo_table, "MEGATRON_SCENARIO",
                        {**zoo_table.MEGATRON_SCENARIO, "iterations": 12})
    fault = next(f for f in zoo_table.FAULTS if f.needs_link)
    traces = zoo_table.run_megatron(fault, tmp_path)
    iterations = zoo_table.MEGATRON_SCENARIO["iterations"]
    for trace in map(load_gz, kineto_files(traces)):
        assert step_ranges(trace) >= iterations
    ops = Counter(e.name for evs in load_kineto(kineto_files(traces)).events.values()
                  for e in evs if e.name in ("send", "recv"))
    assert ops["send"] == ops["recv"] > 0
    linked = {frozenset((r, e.args["peer"])) for r, evs in
              load_kineto(kineto_files(traces)).events.items() for e in evs if "peer" in e.args}
    assert linked and linked <= zoo_table.PIPELINE_LINKS
    causes = zoo_table.detect(traces, "megascan")["root_causes"]
    assert (causes[0]["kind"], causes[0]["rank"], causes[0]["peer"]) == ("link", *zoo_table.SLOW_LINK)


def test_a_realized_slowdown_compares_only_the_ranks_doing_the_same_work():
    # Megatron's end stages hold the embedding and the output layer too
    seconds = {0: 5.0, 1: 2.0, 2: 1.0, 3: 4.0}
    assert realized_slowdown(seconds, 1, alike=(1, 2)) == seconds[1] / seconds[2]
    assert realized_slowdown(seconds, None, alike=(1, 2)) == seconds[1] / seconds[2]
    assert realized_slowdown(seconds, 1) == seconds[1] / seconds[3]  # the median of 5, 1, 4


def test_an_existing_out_file_is_replaced_only_with_force_and_never_an_input(tmp_path, capsys):
    from experiments import zoo_table
    records, out = tmp_path / "records.json", tmp_path / "zoo.json"
    records.write_text("[]")
    out.write_text("a user's table")
    assert zoo_table.main(["--rescore", str(records), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out" in err and "Traceback" not in err
    assert out.read_text() == "a user's table"
    assert zoo_table.main(["--rescore", str(records), "--out", str(records), "--force"]) == 2
    assert records.read_text() == "[]"
    results = tmp_path / "results"  # its record, kept out of the repository's results/
    assert zoo_table.main(["--rescore", str(records), "--out", str(out), "--force",
                           "--results-dir", str(results)]) == 0
    assert json.loads(out.read_text()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["records.json", "results", "zoo.json"]
