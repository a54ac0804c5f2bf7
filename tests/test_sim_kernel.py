"""The compiled event loop (``sim.kernel``) against the reference engine (``sim.engine``).

The reference engine is checked event for event against the SimPy generator
path (``tests/test_sim_scale.py``); the loop must record the very same start
and end of every event, bit for bit, for the same seed: on random jobs
(layouts, schedules, faults and seeds drawn by hypothesis, jitter on every
link and device among them), reduced to classes or not, and on every static
scenario in ``scenarios/``. The bulk pricing methods it relies on must hand
out what the one-at-a-time methods of the same models give.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings, HealthCheck
from hypothesis import strategies as st

from megatronapp.faults import Speed, Window
from megatronapp.program.compiled import CompiledRun
from megatronapp.run.jobs import compile_static
from megatronapp.scenario.config import Scenario, ScenarioError, load_scenario, parse_scenario
from sim.cluster import build_cluster
from sim.devices import Device
from sim.draws import exact_exp
from sim.engine import run_compiled
from sim.kernel_run import kernel_prices, run_on_kernel
from sim.symmetry import identity_classes, pipe_classes

from .test_sim_scale import jobs

ROOT = Path(__file__).resolve().parents[1]
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _both(s: Scenario, reduce: bool) -> tuple[CompiledRun, CompiledRun]:
    """The job on the reference engine and on the loop, each on a cluster of its own."""
    program = compile_static(s)
    assert program is not None
    overhead = s.cluster.gpu.op_overhead_us * 1e-6
    runs = []
    for run in (run_compiled, run_on_kernel):
        cluster = build_cluster(s)
        classes = pipe_classes(cluster) if reduce else identity_classes(cluster.topo)
        runs.append(run(cluster, program, classes, None, overhead))
    return runs[0], runs[1]


def _assert_same(reference: CompiledRun, loop: CompiledRun) -> None:
    assert loop.classes == reference.classes
    for times in ("starts", "ends"):
        for a, b in zip(getattr(reference, times), getattr(loop, times)):
            for stage, (x, y) in enumerate(zip(a, b)):
                np.testing.assert_array_equal(y, x, err_msg=f"{times}, stage {stage}")


@FAST
@given(data=jobs(overlap=True), reduce=st.booleans(), device_noise=st.booleans())
def test_the_loop_records_the_reference_engines_times_bit_for_bit(
        data: dict[str, Any], reduce: bool, device_noise: bool) -> None:
    if device_noise:  # jitter on every device and link: nothing reduces
        data["cluster"]["jitter"] = {"compute_sigma": 0.05, "link_sigma": 0.1}
    s = parse_scenario(data)
    if not kernel_prices(build_cluster(s)):
        return
    _assert_same(*_both(s, reduce))


def _static_scenarios() -> list[Path]:
    out = []
    for path in sorted((ROOT / "scenarios").rglob("*.yaml")):
        if "sweeps" in path.parts or path.name == "runs.yaml":
            continue
        out.append(path)
    return out


@pytest.mark.parametrize("path", _static_scenarios(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_static_scenario_runs_the_same_on_the_loop(path: Path) -> None:
    s = load_scenario(path, [])
    if not kernel_prices(build_cluster(s)):  # a fail-stop demo of 2 million steps among them
        pytest.skip("the loop does not price it (kernel_prices): the reference engine runs it")
    try:
        static = s.fbd is None and compile_static(s) is not None
    except ScenarioError as err:  # a published configuration its GPU's memory refuses
        pytest.skip(str(err).splitlines()[0])
    if not static:
        pytest.skip("not a static schedule: the SimPy path runs it")
    _assert_same(*_both(s, reduce=True))


def test_the_bulk_exponential_is_the_c_librarys() -> None:
    x = np.random.default_rng(0).standard_normal(200_000) * 0.7
    assert exact_exp(x).tolist() == [math.exp(v) for v in x.tolist()]


@given(seed=st.integers(0, 2**32), sigma=st.sampled_from([0.0, 0.02, 0.3]),
       windows=st.sampled_from([(), (Window(0.5, 2.0, 1.5),),
                                (Window(0.0, math.inf, 2.0), Window(1.0, 1.5, 3.0)),
                                (Window(0.2, 2.5, 2.0, period_s=0.3, duty=0.4),
                                 Window(0.0, math.inf, 1.5, every_k=3))]),
       scale=st.sampled_from([1.0, 1.3]), n=st.integers(0, 200))
@settings(max_examples=60, deadline=None)
def test_device_durations_in_bulk_are_the_one_at_a_time_durations(
        seed: int, sigma: float, windows: tuple[Window, ...], scale: float, n: int) -> None:
    rng = np.random.default_rng(seed)
    starts, work = rng.uniform(0, 3, n), rng.uniform(0, 0.5, n)
    iteration = rng.integers(0, 6, n)
    one = Device(0, Speed(windows, scale), sigma, np.random.default_rng(seed) if sigma else None)
    bulk = Device(0, Speed(windows, scale), sigma, np.random.default_rng(seed) if sigma else None)
    expected = [one.duration(t, w, i) for t, w, i in zip(starts.tolist(), work.tolist(),
                                                         iteration.tolist())]
    split = n // 3  # two bulk calls in a row continue the same stream
    got = np.concatenate((bulk.durations(starts[:split], work[:split], iteration[:split]),
                          bulk.durations(starts[split:], work[split:], iteration[split:])))
    assert got.tolist() == expected
    assert one.duration(0.1, 0.2) == bulk.durations(np.array([0.1]), np.array([0.2]))[0]


@given(seed=st.integers(0, 2**16), sigma=st.sampled_from([0.0, 0.05]),
       jittered=st.sampled_from([None, 0.5]), n=st.integers(0, 30))
@settings(max_examples=30, deadline=None)
def test_link_and_ring_multipliers_in_bulk_are_the_one_at_a_time_ones(
        seed: int, sigma: float, jittered: float | None, n: int) -> None:
    faults = [{"kind": "link_jitter", "ranks": [0, 4], "sigma": jittered}] if jittered else []
    data = {"seed": seed, "parallel": {"tp": 1, "pp": 2, "dp": 4, "microbatches": 2},
            "model": {"layers": 2, "hidden": 64, "heads": 2, "seq_len": 16, "vocab": 64},
            "cluster": {"jitter": {"link_sigma": sigma}}, "faults": faults}
    one, bulk = build_cluster(parse_scenario(data)).network, build_cluster(parse_scenario(data)).network
    assert bulk.link(0, 4).slowdowns(np.zeros(n)).tolist() == [one.link(0, 4).slowdown()
                                                               for _ in range(n)]
    group = (0, 1, 2, 3)
    ring_one, ring_bulk = one.ring(group), bulk.ring(group)
    seconds = [ring_one.seconds(1 << 20) for _ in range(n)]
    worsts = ring_bulk.worsts(n)
    assert [2 * ((ring_bulk.n - 1) / ring_bulk.n * (1 << 20) / (ring_bulk.min_bandwidth / w)
                 + ring_bulk.latency_s) for w in worsts.tolist()] == seconds


def _small(faults: list[dict[str, Any]], iterations: int = 1) -> Scenario:
    return parse_scenario({"seed": 3, "schedule": "1f1b", "iterations": iterations,
                           "parallel": {"tp": 2, "pp": 2, "dp": 2, "microbatches": 4},
                           "model": {"layers": 4, "hidden": 128, "heads": 4, "seq_len": 64,
                                     "vocab": 256},
                           "cluster": {"jitter": {"compute_sigma": 0.05}}, "faults": faults})


def test_a_throttle_with_an_onset_is_priced_while_the_loop_runs() -> None:
    # rank 3 is tp 1, dp 1, stage 0: pipeline 3's first stage
    reference, loop = _both(_small([{"kind": "throttle", "rank": 3, "factor": 2.0,
                                     "start_s": 1e-4}]), reduce=False)
    _assert_same(reference, loop)
    calm = _both(_small([]), reduce=False)[1]
    assert loop.ends[3][0].max() > calm.ends[3][0].max()


def test_a_periodic_throttle_and_device_variation_run_the_same_on_the_loop() -> None:
    faults = [{"kind": "throttle", "rank": 3, "factor": 2.0, "start_s": 1e-4,
               "period_s": 2e-4, "duty": 0.5},
              {"kind": "device_variation", "sigma": 0.1}]
    s = _small(faults)
    assert kernel_prices(build_cluster(s))
    reference, loop = _both(s, reduce=False)
    _assert_same(reference, loop)
    assert loop.ends[3][0].max() > _both(_small([]), reduce=False)[1].ends[3][0].max()


@pytest.mark.parametrize("fault", [
    {"kind": "throttle", "rank": 3, "factor": 2.0, "every_k_iterations": 2},
    {"kind": "host_stall", "rank": 1, "seconds": 0.001},
    {"kind": "link_flap", "ranks": [0, 2], "down_ms": 0.05, "every_s": 0.0002, "retry_ms": 0.01},
    {"kind": "slow_link", "ranks": [0, 2], "factor": 2.0, "start_s": 1e-4},
    {"kind": "crash", "rank": 1, "at_s": 1e-3},
], ids=lambda f: f["kind"])
def test_what_the_loop_does_not_model_runs_on_the_reference_engine(fault: dict[str, Any]) -> None:
    """Iterations, host time, link drops, timed links and stops are the
    reference engine's: the loop declines the job, and a run of it is the
    reference engine's run."""
    from sim.run import run_sim

    s = _small([fault], iterations=3)
    assert not kernel_prices(build_cluster(s))
    auto, reference = run_sim(s), run_sim(s, engine="reference")
    assert auto.stopped == reference.stopped
    for r in range(s.world_size):
        assert [(e.name, e.start_s, e.dur_s) for e in auto.events[r]] == \
            [(e.name, e.start_s, e.dur_s) for e in reference.events[r]]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=jobs(overlap=True), every=st.sampled_from([7, 97, 1000]))
def test_the_loop_with_its_times_in_a_file_records_the_same_times_and_rows(
        data: dict[str, Any], every: int) -> None:
    """Times kept in a mapped file (``sim.spill``), their pages handed back
    every ``every`` operations and after each batch of rows, are the times and
    the rows of the loop that keeps them in memory (jitter everywhere)."""
    import sim.kernel_run as kernel_run

    data["cluster"]["jitter"] = {"compute_sigma": 0.05, "link_sigma": 0.1}
    s = parse_scenario(data)
    if not kernel_prices(build_cluster(s)):
        return
    program = compile_static(s)
    assert program is not None
    overhead = s.cluster.gpu.op_overhead_us * 1e-6
    in_memory = run_on_kernel(build_cluster(s), program, pipe_classes(build_cluster(s)), None,
                              overhead)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernel_run, "PROGRESS_EVERY", every)
        patch.setattr(kernel_run, "RELEASE_RANKS", 2)
        cluster = build_cluster(s)
        loop = kernel_run.KernelRun(cluster, program, pipe_classes(cluster), None, overhead,
                                    spill_bytes=0)
        loop.run()
    assert loop.spill is not None
    spilled = loop.result()
    _assert_same(in_memory, spilled)
    for a, b in zip(in_memory.batches(max_rows=50), spilled.batches(max_rows=50)):
        np.testing.assert_array_equal(b.start_s, a.start_s)
        np.testing.assert_array_equal(b.dur_s, a.dur_s)
        np.testing.assert_array_equal(b.name, a.name)
