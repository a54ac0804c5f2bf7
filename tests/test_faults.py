"""The fault protocol: every kind is one module behind it, a new kind plugs in
by registering one, each kind's effect in the simulator is what its keys say,
and faults that cannot touch the job are refused."""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from megatronapp.faults import KINDS, FaultSpec, Speed, Window, registered
from megatronapp.scenario.config import ScenarioError, parse_scenario
from sim import run_sim

from .support import ROOT, run_cli

FIXED = {"seed": 3, "iterations": 4, "schedule": "1f1b",
         "parallel": {"tp": 1, "pp": 2, "dp": 2, "microbatches": 4},
         "model": {"layers": 4, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 128},
         "costs": {"forward_s": 0.01, "backward_s": 0.02, "p2p_s": 0.001, "allreduce_s": 0.002,
                   "optimizer_s": 0.001}}


def _run(faults: list[dict[str, Any]], **changes: Any) -> Any:
    return run_sim(parse_scenario({**FIXED, **changes, "faults": faults}))


def _iteration_ends(result: Any) -> list[float]:
    ends: dict[int, float] = {}
    for events in result.events.values():
        for e in events:
            it = e.args.get("iteration", -1)
            if it >= 0:
                ends[it] = max(ends.get(it, 0.0), e.start_s + e.dur_s)
    return [ends[i] for i in sorted(ends)]


def _durations(result: Any, rank: int, name: str) -> list[float]:
    return [e.dur_s for e in result.events[rank] if e.name == name]


# ------------------------------------------------------------ the protocol
def test_nothing_outside_the_faults_package_dispatches_on_a_fault_kind() -> None:
    """A kind is looked at only in its own module: no ``kind ==`` on a fault,
    no fault class tested with isinstance, no list of kinds, anywhere else."""
    names = "|".join(re.escape(k) for k in KINDS)
    classes = "|".join(cls.__name__ for cls in KINDS.values())
    pattern = re.compile(rf"""(\bf(ault)?\.kind\s*(==|!=|in)|isinstance\([^)]*\b({classes})\b|
                              ["']({names})["']\s*(==|,\s*["'](?:{names})["']))""", re.VERBOSE)
    found = []
    for folder in ("megatronapp", "sim", "backends"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.parent.name == "faults" and path.parent.parent.name == "megatronapp":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


KIND_MODULE = '''
from typing import Literal

from megatronapp.faults.effects import Window
from megatronapp.faults.protocol import Effects, Job, RankFault, Truth


class Molasses(RankFault):
    """A rank whose compute is ``factor`` x slow in the second iteration only."""

    kind: Literal["molasses"]
    factor: float

    def effects(self, job: Job) -> Effects:
        return Effects(compute=((self.rank, Window(factor=self.factor, every_k=2)),))

    def truth(self, job: Job) -> tuple[Truth, ...]:
        return (Truth("molasses", "compute", self.rank, iterations=(1, 3), injected=self.factor),)
'''


def test_a_new_kind_in_its_own_module_runs_end_to_end(tmp_path: Path) -> None:
    """A kind written in a module of its own, registered, is parsed, simulated,
    reported as injected and refused with a hint when mistyped."""
    (tmp_path / "molasses.py").write_text(KIND_MODULE)
    spec = importlib.util.spec_from_file_location("molasses", tmp_path / "molasses.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["molasses"] = module
    spec.loader.exec_module(module)
    scenario = tmp_path / "slow.yaml"
    scenario.write_text(json.dumps({**FIXED, "faults": [
        {"kind": "molasses", "rank": 2, "factor": 3.0}]}))
    with registered(module.Molasses):
        proc = run_cli("run", str(scenario), "--out", str(tmp_path / "run"), "--quiet")
        assert proc.returncode == 0, proc.stderr
        with pytest.raises(ScenarioError, match="did you mean 'molasses'"):
            parse_scenario({**FIXED, "faults": [{"kind": "molases", "rank": 2, "factor": 3}]})
    assert "molasses" not in KINDS  # gone with its registration
    truth = json.loads((tmp_path / "run" / "ground_truth.json").read_text())["truth"]
    assert truth == [{"kind": "molasses", "effect": "compute", "rank": 2, "peer": None,
                      "iterations": [1, 3], "injected": 3.0, "unit": "x", "label": "compute:2",
                      "should_name": "rank 2"}]
    forwards = [e for e in json.loads((tmp_path / "run" / "trace.json").read_text())
                ["traceEvents"] if e.get("pid") == 2 and e.get("name") == "forward"]
    by_iteration = {e["args"]["iteration"]: e["dur"] for e in forwards}
    assert by_iteration[1] == pytest.approx(3 * by_iteration[0])  # 0.01 s at 3x
    assert by_iteration[2] == pytest.approx(by_iteration[0])


EXAMPLES = {  # one of each built-in kind, on FIXED's 4 ranks (tp 1, pp 2, dp 2)
    "throttle": {"kind": "throttle", "rank": 1, "factor": 2.0, "start_s": 0.1, "end_s": 0.3},
    "slow_link": {"kind": "slow_link", "ranks": [0, 2], "factor": 2.0},
    "link_jitter": {"kind": "link_jitter", "ranks": [0, 1], "sigma": 0.5},
    "clock_skew": {"kind": "clock_skew", "rank": 2, "offset_us": 50.0},
    "host_stall": {"kind": "host_stall", "rank": 1, "seconds": 0.01},
    "link_flap": {"kind": "link_flap", "ranks": [1, 3], "down_ms": 5, "every_s": 0.1},
    "crash": {"kind": "crash", "rank": 3, "at_s": 0.2},
    "device_variation": {"kind": "device_variation", "sigma": 0.1},
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_answers_the_whole_protocol(kind: str) -> None:
    """Its module is named after it and says what it does; its schema parses;
    it has an effect, a ground truth, a place in a re-planned job and a cost."""
    from megatronapp.scenario.config import fault_job

    cls = KINDS[kind]
    module = sys.modules[cls.__module__]
    assert cls.__module__ == f"megatronapp.faults.{kind}" and f"``{kind}``" in (module.__doc__ or "")
    s = parse_scenario({**FIXED, "faults": [EXAMPLES[kind]]})
    fault, job = s.faults[0], fault_job(s)
    effects = fault.effects(job)
    assert any(getattr(effects, f) for f in effects.__dataclass_fields__)
    assert [t.kind for t in fault.truth(job)] == [kind]
    assert fault.moved(lambda rank: rank, 0.0) == fault
    assert fault.cost(job).bytes >= 0


def test_a_stall_or_throttle_moves_with_its_gpu_and_keeps_its_place_in_time() -> None:
    s = parse_scenario({**FIXED, "faults": [EXAMPLES["throttle"], EXAMPLES["link_flap"],
                                            EXAMPLES["crash"]]})
    throttle, flap, crash = s.faults
    moved = throttle.moved(lambda rank: rank + 10, 0.15)
    assert (moved.rank, moved.start_s, moved.end_s) == (11, 0.0, pytest.approx(0.15))
    assert throttle.moved(lambda rank: rank, 0.3) is None  # over by then
    assert flap.moved(lambda rank: None if rank == 3 else rank, 0.0) is None  # gone with a GPU
    assert flap.moved(lambda rank: rank, 0.25).start_s == pytest.approx(0.05)  # the next drop
    assert crash.moved(lambda rank: rank, 0.2) is None  # it has happened


# ------------------------------------------------------------ the effects
def test_a_window_product_is_integrated_the_same_one_op_or_in_bulk() -> None:
    speed = Speed((Window(0.1, 2.0, 3.0, period_s=0.05, duty=0.4), Window(0.5, np.inf, 1.5),
                   Window(0.0, np.inf, 2.0, every_k=3)), scale=1.1)
    rng = np.random.default_rng(0)
    start, work = rng.uniform(0, 3, 500), rng.uniform(0, 0.3, 500)
    iteration = rng.integers(0, 7, 500)
    bulk = speed.durations(start, work, iteration)
    one = [speed.duration(a, b, int(i)) for a, b, i in zip(start, work, iteration)]
    assert bulk == pytest.approx(one, rel=1e-9)
    # from 0.3 s, iteration 2 (a third, gated in): 6.6x until the period's slow 20 ms end, then 2.2x
    assert speed.duration(0.3, 0.005, 2) == pytest.approx(0.02 + (0.005 - 0.02 / 6.6) * 2.2)
    assert speed.duration(0.3, 0.005, 1) == pytest.approx(0.005 * 3.3)  # ends inside the 20 ms
    periodic = speed.windows[0]
    assert list(periodic.factors(start)) == [periodic.factor_at(t) for t in start]


def test_a_host_stall_delays_the_rank_between_its_ops_not_inside_them() -> None:
    healthy = _run([])
    stalled = _run([{"kind": "host_stall", "rank": 1, "seconds": 0.05, "every_k_iterations": 2}])
    assert _durations(stalled, 1, "forward") == _durations(healthy, 1, "forward")
    gap = [b - a for a, b in zip(_iteration_ends(healthy), _iteration_ends(stalled))]
    # iterations 1 and 3 are stalled: the job ends 0.05 s later after each of them
    assert gap[0] == pytest.approx(0.0, abs=1e-12)
    assert gap[1] == pytest.approx(0.05) and gap[3] == pytest.approx(0.10)
    first = [e for e in stalled.events[1] if e.name == "forward" and e.args["iteration"] == 1][0]
    before = max(e.start_s + e.dur_s for e in stalled.events[1]
                 if e.start_s + e.dur_s <= first.start_s)
    assert first.start_s - before >= 0.05 - 1e-12  # the stall lies between two ops


def test_a_host_stall_before_the_optimizer_delays_the_step() -> None:
    healthy = _run([])
    stalled = _run([{"kind": "host_stall", "rank": 0, "seconds": 0.02,
                     "where": "before_optimizer"}])
    starts = [e.start_s for e in stalled.events[0] if e.name == "optimizer"]
    before = [e.start_s for e in healthy.events[0] if e.name == "optimizer"]
    assert starts[0] - before[0] == pytest.approx(0.02)


def test_an_intermittent_throttle_slows_only_the_iterations_it_hits() -> None:
    run = _run([{"kind": "throttle", "rank": 0, "factor": 3.0, "every_k_iterations": 2}])
    by_iteration: dict[int, list[float]] = {}
    for e in run.events[0]:
        if e.name == "forward":
            by_iteration.setdefault(e.args["iteration"], []).append(e.dur_s)
    assert by_iteration[0] == pytest.approx([0.01] * 4)
    assert by_iteration[1] == pytest.approx([0.03] * 4)


def test_a_periodic_throttle_slows_the_duty_share_of_each_period() -> None:
    run = _run([{"kind": "throttle", "rank": 0, "factor": 2.0, "period_s": 0.5, "duty": 0.5}],
               iterations=6)
    slowed = [e for e in run.events[0] if e.name == "forward" and e.dur_s > 0.0101]
    assert slowed and all(e.start_s % 0.5 < 0.25 + 1e-9 or (e.start_s + e.dur_s) % 0.5 < 0.25
                          for e in slowed)


def test_a_link_flap_delays_the_transfers_that_meet_a_drop() -> None:
    healthy = _run([])
    flap = _run([{"kind": "link_flap", "ranks": [0, 2], "down_ms": 20, "every_s": 0.05,
                  "retry_ms": 10}])
    assert _iteration_ends(flap)[-1] > _iteration_ends(healthy)[-1] + 0.01

    def arrivals(run: Any) -> list[float]:
        return [e.start_s + e.dur_s for e in run.events[2] if e.name == "recv_forward"]

    late = [b - a for a, b in zip(arrivals(healthy), arrivals(flap))]
    assert min(late) >= -1e-12 and max(late) >= 0.01  # one waited out a drop and the retry
    assert _durations(flap, 0, "forward") == pytest.approx(_durations(healthy, 0, "forward"))


def test_a_crash_stops_the_job_and_the_stop_is_recorded(tmp_path: Path) -> None:
    scenario = tmp_path / "crash.yaml"
    scenario.write_text(json.dumps({**FIXED, "faults": [{"kind": "crash", "rank": 3,
                                                          "at_s": 0.35}]}))
    proc = run_cli("run", str(scenario), "--out", str(tmp_path / "run"), "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    healthy = _iteration_ends(_run([]))
    assert summary["stopped"] == {"by": "crash", "rank": 3, "at_s": 0.35,
                                  "iterations_completed": sum(e <= 0.35 for e in healthy)}
    stored = json.loads((tmp_path / "run" / "trace.json").read_text())["traceEvents"]
    assert max((e["ts"] + e["dur"]) * 1e-6 for e in stored if "dur" in e) <= 0.35 + 1e-9


def test_device_variation_makes_the_step_wait_for_the_slowest_draw() -> None:
    """Data parallelism alone: every replica computes, then all reduce; the
    step is the slowest device's compute, the expected maximum of the draws."""
    job = {"parallel": {"tp": 1, "pp": 1, "dp": 16, "microbatches": 1}, "iterations": 1}
    fault = {"kind": "device_variation", "sigma": 0.2}
    spread = parse_scenario({**FIXED, **job, "faults": [fault]})
    from megatronapp.scenario.config import fault_job

    factors = KINDS["device_variation"].model_validate(fault).factors(fault_job(spread))
    ran, base = run_sim(spread), _run([], **job)
    # forward, backward and the optimizer step of the slowest device, after the all-reduce
    assert _iteration_ends(ran)[0] - _iteration_ends(base)[0] == pytest.approx(
        (factors.max() - 1.0) * 0.031, rel=1e-9)
    assert run_sim(spread).events[0][0].dur_s == pytest.approx(0.01 * factors[0])


# --------------------------------------------- faults that touch the job
@pytest.mark.parametrize("job,fault,field,words", [
    ({"parallel": {"dp": 8}}, {"kind": "slow_link", "ranks": [0, 4], "factor": 10},
     "faults[0].ranks", "ranks 0 and 4 exchange no data in tp 1, pp 1, dp 8: rank 0's peers "
                        "are 1 and 7 (data-parallel ring)"),
    ({"parallel": {"tp": 2, "pp": 4, "dp": 2, "microbatches": 4}, "model": {"layers": 8}},
     {"kind": "link_flap", "ranks": [3, 11], "down_ms": 5, "every_s": 1},
     "faults[0].ranks", "rank 3's peers are 2 (tensor-parallel ring); 1 (data-parallel ring); "
                        "7 (pipeline); 15 (embedding all-reduce)"),
    ({"parallel": {"pp": 4, "microbatches": 4}, "model": {"layers": 8}},
     {"kind": "link_jitter", "ranks": [0, 2], "sigma": 0.5}, "faults[0].ranks",
     "rank 0's peers are 1 (pipeline); 3 (embedding all-reduce)"),
    ({}, {"kind": "clock_skew", "rank": 0, "offset_us": 100}, "faults[0].rank",
     "a job of one rank"),
    ({"iterations": 2}, {"kind": "host_stall", "rank": 0, "seconds": 0.1,
                         "every_k_iterations": 3}, "faults[0].every_k_iterations",
     "more than the job's 2 iterations"),
    ({"iterations": 2}, {"kind": "throttle", "rank": 0, "factor": 2, "every_k_iterations": 5},
     "faults[0].every_k_iterations", "never acts"),
])
def test_a_fault_that_cannot_touch_the_job_is_refused_naming_the_field(
        job: dict[str, Any], fault: dict[str, Any], field: str, words: str) -> None:
    data = {**job, "faults": [fault]}
    with pytest.raises(ScenarioError) as err:
        parse_scenario(data)
    assert err.value.field == field and words in err.value.reason
    assert parse_scenario({**data, "allow_idle_faults": True}).faults[0].kind == fault["kind"]


def test_ranks_that_exchange_data_are_accepted() -> None:
    for ranks in ([0, 1], [0, 7], [3, 2]):  # the dp 8 ring's neighbours, both ways round
        parse_scenario({"parallel": {"dp": 8}, "faults": [
            {"kind": "slow_link", "ranks": ranks, "factor": 2}]})
    # interleaved: the last stage hands its chunk to the first (embeddings untied)
    parse_scenario({"schedule": "interleaved", "parallel": {"pp": 4, "vpp": 2, "microbatches": 4},
                    "model": {"layers": 8, "untie_embeddings": True},
                    "faults": [{"kind": "slow_link", "ranks": [3, 0], "factor": 2}]})


@pytest.mark.parametrize("fault,field", [
    ({"kind": "throttle", "rank": 1, "factor": 2, "start_s": 50}, "faults[0].start_s"),
    ({"kind": "slow_link", "ranks": [0, 2], "factor": 2, "start_s": 50}, "faults[0].start_s"),
    ({"kind": "crash", "rank": 1, "at_s": 50}, "faults[0].at_s"),
    ({"kind": "link_flap", "ranks": [0, 2], "down_ms": 5, "every_s": 100, "start_s": 50},
     "faults[0].start_s"),
])
def test_a_window_after_the_job_is_refused_after_the_run_and_nothing_is_written(
        tmp_path: Path, fault: dict[str, Any], field: str) -> None:
    scenario = tmp_path / "late.yaml"
    scenario.write_text(json.dumps({**FIXED, "faults": [fault]}))
    out = tmp_path / "run"
    proc = run_cli("run", str(scenario), "--out", str(out), "--quiet")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert field in proc.stderr and "changes nothing" in proc.stderr
    assert not out.exists()
    scenario.write_text(json.dumps({**FIXED, "faults": [fault], "allow_idle_faults": True}))
    assert run_cli("run", str(scenario), "--out", str(out), "--quiet").returncode == 0


def test_the_torch_backend_is_told_what_each_kind_does_to_a_rank() -> None:
    """What a real rank asks before each op (no processes here)."""
    from sim import injected_faults

    s = parse_scenario({**FIXED, "faults": [
        {"kind": "host_stall", "rank": 1, "seconds": 0.05, "every_k_iterations": 2},
        {"kind": "link_flap", "ranks": [0, 2], "down_ms": 20, "every_s": 0.1, "retry_ms": 5},
        {"kind": "crash", "rank": 1, "at_s": 3.0}]})
    stalled, peer = injected_faults(s, 1), injected_faults(s, 0)
    assert stalled.host_delay_s("forward", 0) == 0.0
    assert stalled.host_delay_s("forward", 1) == 0.05
    assert stalled.host_delay_s("forward", 1) == 0.0  # once an iteration: its first forward
    assert stalled.host_delay_s("backward", 3) == 0.0
    assert (stalled.stop_s, peer.stop_s) == (3.0, None)
    # 5 ms into a 20 ms drop: the rest of it and the retry; between drops nothing
    assert peer.transfer_extra_s(0, 2, 1000, at=0.105) == pytest.approx(0.015 + 0.005)
    assert peer.transfer_extra_s(0, 2, 1000, at=0.05) == 0.0
    assert peer.transfer_extra_s(1, 3, 1000, at=0.105) == 0.0  # another link


def test_a_link_is_priced_the_same_one_use_or_in_bulk() -> None:
    """What a vectorised engine asks of a link (its slowdown and its drops over
    arrays of transfers) is what the engines ask one transfer at a time."""
    from sim.cluster import build_cluster

    s = parse_scenario({**FIXED, "cluster": {"jitter": {"link_sigma": 0.3}}, "faults": [
        {"kind": "slow_link", "ranks": [0, 2], "factor": 2.0, "start_s": 0.05, "end_s": 0.2},
        {"kind": "link_flap", "ranks": [0, 2], "down_ms": 7, "every_s": 0.03, "retry_ms": 2}]})
    rng = np.random.default_rng(1)
    at = np.sort(rng.uniform(0, 0.3, 300))
    nbytes = rng.integers(1, 10**7, 300)
    one, bulk = build_cluster(s).network.link(0, 2), build_cluster(s).network.link(0, 2)
    slow_one = np.array([one.slowdown(t) for t in at])
    assert bulk.slowdowns(at) == pytest.approx(slow_one, rel=1e-12)
    delays_one = [one.delay_s(t, int(n), f) for t, n, f in zip(at, nbytes, slow_one)]
    assert bulk.delays_s(at, nbytes, slow_one) == pytest.approx(delays_one, abs=1e-12)
    assert max(delays_one) > 0.002 and min(delays_one) == 0.0


@pytest.mark.parametrize("fault, words", [
    ({"kind": "throttle", "rank": 5, "factor": 1.5, "start_s": 0.02},
     "rank 5 at 1/1.5 speed from 0.02 s"),
    ({"kind": "slow_link", "ranks": [3, 7], "factor": 4}, "link 3 <-> 7 4x slow"),
    ({"kind": "clock_skew", "rank": 9, "offset_us": 1500, "drift_ppm": 40},
     "clock of rank 9 off by 1.5 ms, drifting 40 ppm"),
    ({"kind": "host_stall", "rank": 2, "seconds": 0.01, "every_k_iterations": 3},
     "rank 2's host stalls 10 ms before its forward in every 3rd iteration")])
def test_a_fault_is_described_in_words(fault: dict[str, Any], words: str) -> None:
    from megatronapp.faults import parse_fault

    assert parse_fault(fault, "faults[0]").describe() == words


def test_every_kind_says_itself_in_words_not_as_its_fields() -> None:
    """A report shows ``describe()``: a kind without its own shows raw keys."""
    assert all(cls.describe is not FaultSpec.describe for cls in KINDS.values())
    assert "kind" not in FaultSpec.model_construct(kind="made_up").describe().split("(")[1]
