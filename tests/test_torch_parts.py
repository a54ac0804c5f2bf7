"""The torch backend's in-process parts: CPU shim, fault pricing, watchdog policy (no processes)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pytest
import torch

from backends.torch import megatron_compat
from backends.torch.interpreter import works_per_op
from backends.torch.lifetime import is_stopped, process_state
from backends.torch.watchdog import (FINISHED, ProgressWatch, blocked_line, death_line,
                                     describe_blocked, describe_failure, short_path)
from megatronapp import cli
from megatronapp.scenario.config import parse_scenario
from megatronapp.parallel.ops import AllReduce, Compute, IRecv, ISend, Recv, Wait, WaitAny
from sim import injected_faults


def test_cpu_rng_fork_restores_the_outer_stream_and_continues_its_own():
    tracker = megatron_compat.CpuRNGStatesTracker()
    tracker.add("model-parallel-rng", 123)
    torch.manual_seed(0)
    expected_outer = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork("model-parallel-rng"):
        first = torch.rand(3)
    with tracker.fork("model-parallel-rng"):
        second = torch.rand(3)
    assert torch.equal(torch.rand(3), expected_outer)  # outer stream untouched
    assert torch.equal(torch.cat([first, second]),
                       torch.rand(6, generator=torch.Generator().manual_seed(123)))
    with pytest.raises(ValueError):
        tracker.add("other", 123)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim applies only without CUDA")
def test_global_memory_buffer_allocates_on_cpu_after_apply(monkeypatch: pytest.MonkeyPatch):
    from megatron.core.tensor_parallel import random
    from megatron.core.utils import GlobalMemoryBuffer

    # Let the patches be undone after the test.
    monkeypatch.setattr(GlobalMemoryBuffer, "get_tensor", GlobalMemoryBuffer.get_tensor)
    for name in ("_CUDA_RNG_STATE_TRACKER", "_CUDA_RNG_STATE_TRACKER_INITIALIZED"):
        monkeypatch.setattr(random, name, getattr(random, name))
    megatron_compat.apply()
    assert isinstance(random.get_cuda_rng_tracker(), megatron_compat.CpuRNGStatesTracker)
    buffer = GlobalMemoryBuffer()
    small = buffer.get_tensor((2, 3), torch.float32, "x")
    big = buffer.get_tensor((4, 5), torch.float32, "x")
    assert small.device.type == big.device.type == "cpu" and big.shape == (4, 5)


def test_causal_mask_hides_the_future_only():
    mask = megatron_compat.causal_mask(4)[0, 0]
    assert mask.shape == (4, 4)
    assert torch.equal(mask, torch.ones(4, 4, dtype=torch.bool).triu(1))


def _scenario(faults):
    return parse_scenario({"parallel": {"pp": 2, "dp": 2}, "model": {"layers": 2},
                           "costs": {"p2p_s": 0.01, "allreduce_s": 0.02}, "faults": faults})


def test_throttle_stretches_compute_inside_its_window_only():
    faults = injected_faults(_scenario([{"kind": "throttle", "rank": 1, "factor": 3.0,
                                         "start_s": 1.0, "end_s": 2.0}]), 1)
    assert faults.compute_extra_s(0.0, 0.5) == 0.0
    assert faults.compute_extra_s(1.2, 0.1) == pytest.approx(0.2)
    assert faults.compute_extra_s(0.9, 0.2) == pytest.approx(0.2)  # half inside: 0.1 -> 0.3
    assert injected_faults(_scenario([]), 1).compute_extra_s(1.2, 0.1) == 0.0


def test_slow_link_delays_its_own_pair_and_the_rings_crossing_it():
    faults = injected_faults(_scenario([{"kind": "slow_link", "ranks": [0, 2],
                                         "factor": 4.0}]), 2)
    assert faults.transfer_extra_s(0, 2, 1000) == pytest.approx(3 * 0.01)
    assert faults.transfer_extra_s(1, 3, 1000) == 0.0
    assert faults.allreduce_extra_s((0, 2), 1000) == pytest.approx(3 * 0.02)
    assert faults.allreduce_extra_s((0, 1), 1000) == 0.0


def test_link_jitter_never_speeds_a_transfer_up():
    faults = injected_faults(_scenario([{"kind": "link_jitter", "ranks": [0, 2],
                                         "sigma": 1.0}]), 2)
    extras = [faults.transfer_extra_s(0, 2, 1000) for _ in range(200)]
    assert min(extras) == 0.0 and max(extras) > 0.0


# ------------------------------------------------------------- watchdog
def test_progress_watch_is_armed_by_the_first_op_and_reset_by_any_progress():
    watch = ProgressWatch(timeout_s=10.0)
    assert not watch.stalled([0, 0], 0.0)
    assert not watch.stalled([0, 0], 100.0)  # set-up (imports, model building) is not timed
    assert not watch.stalled([1, 0], 100.0)
    assert not watch.stalled([1, 0], 109.0)
    assert watch.stalled([1, 0], 110.0)
    assert not watch.stalled([1, 1], 111.0)  # one rank moving is progress
    assert not watch.stalled([1, 1], 120.5) and watch.stalled([1, 1], 121.0)


@dataclass
class _Handle:  # what the interpreter's handles expose to a description
    op: object
    finished: bool = False


def test_blocked_ops_are_described_like_the_simulators_deadlock():
    recv = IRecv(src=1, tag=("bwd", 2, 0), nbytes=8)
    send = ISend(dst=3, tag=("fwd", 2, 0), nbytes=8)
    assert describe_blocked(Recv(src=1, tag=("fwd", 0, 0), nbytes=8)) == \
        "Recv(src=1, tag=('fwd', 0, 0))"
    assert describe_blocked(Wait(_Handle(recv))) == "Wait(IRecv(src=1, tag=('bwd', 2, 0)))"
    assert describe_blocked(WaitAny((_Handle(recv, finished=True), _Handle(send)))) == \
        "WaitAny(ISend(dst=3, tag=('fwd', 2, 0)))"
    assert describe_blocked(AllReduce(group=(0, 2), nbytes=4)) == "AllReduce(group=[0, 2])"
    assert describe_blocked(Compute("forward", 0.0)) == "Compute(forward)"
    assert describe_blocked(None) == "set-up"


def test_blocked_line_leaves_finished_ranks_out():
    line = blocked_line({2: "Recv(src=0, tag=1)", 0: FINISHED, 1: "AllReduce(group=[1, 2])"})
    assert line == "2 rank(s) blocked: rank 1 on AllReduce(group=[1, 2]), rank 2 on Recv(src=0, tag=1)"


def test_a_coalesced_batchs_single_work_serves_every_op():
    assert works_per_op(["w"], 3) == ["w", "w", "w"]  # NCCL: one work per batch
    assert works_per_op(["a", "b"], 2) == ["a", "b"]  # gloo: one per op
    with pytest.raises(RuntimeError):
        works_per_op(["a", "b"], 3)


def test_only_link_faults_make_transfers_priced():
    assert not injected_faults(_scenario([{"kind": "throttle", "rank": 1, "factor": 2.0}]), 1).links
    assert injected_faults(_scenario([{"kind": "link_jitter", "ranks": [0, 2],
                                       "sigma": 0.5}]), 0).links


@pytest.mark.parametrize("argv, field", [(["--stall-timeout", "0"], "must be a finite number > 0"),
                                         (["--stall-timeout", "5", "--backend", "sim"],
                                          "the sim backend does not take it")])
def test_bad_stall_timeout_exits_2_naming_the_option(argv, field, tmp_path, capsys):
    scenario_file = tmp_path / "s.yaml"
    scenario_file.write_text("parallel: {pp: 2}\nmodel: {layers: 2}\n")
    code = cli.main(["run", str(scenario_file), "--out", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"--stall-timeout: {field}" in err
    assert not (tmp_path / "run").exists()


def test_vocab_not_divisible_by_tp_is_refused_before_any_rank_starts(tmp_path, capsys):
    scenario_file = tmp_path / "s.yaml"
    scenario_file.write_text("parallel: {tp: 2, microbatches: 2}\n"
                             "model: {layers: 2, hidden: 32, heads: 4, seq_len: 8, vocab: 127}\n")
    argv = ["run", str(scenario_file), "--out", str(tmp_path / "run"), "--quiet"]
    code = cli.main([*argv, "--backend", "torch"])
    err = capsys.readouterr().err
    assert code == 2 and err == ("megatronapp: scenario error: model.vocab: 127 is not divisible "
                                 "by parallel.tp = 2 (megatron-core splits the vocabulary over "
                                 "the TP ranks)\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.yaml"]
    assert cli.main([*argv, "--backend", "sim"]) == 0  # the simulator has no vocabulary split


# ------------------------------------------------- failed, dead and stopped ranks
def _raise_in_megatron_like_code() -> None:
    raise AssertionError("127 is not divisible by 2\nsecond line")


def test_a_failure_is_its_type_first_message_line_and_innermost_frame():
    try:
        _raise_in_megatron_like_code()
    except AssertionError as err:
        failure = describe_failure(err)
    line = _raise_in_megatron_like_code.__code__.co_firstlineno + 1
    assert failure.line == ("AssertionError: 127 is not divisible by 2 "
                            f"(tests/test_torch_parts.py:{line})")
    assert "Traceback" in failure.traceback and "second line" in failure.traceback
    try:
        raise KeyError
    except KeyError as err:
        assert describe_failure(err).line.startswith("KeyError (tests/test_torch_parts.py:")


def test_short_path_is_relative_to_the_longest_sys_path_entry_holding_it():
    roots = ["/venv/lib/site-packages", "/venv", "/repo"]
    assert short_path("/venv/lib/site-packages/megatron/core/utils.py", roots) == \
        "megatron/core/utils.py"
    assert short_path("/repo/backends/torch/stages.py", roots) == "backends/torch/stages.py"
    assert short_path("/elsewhere/x.py", roots) == "/elsewhere/x.py"
    assert short_path("/repository/x.py", roots) == "/repository/x.py"  # not under /repo


def test_a_death_names_the_exit_code_or_the_signal():
    assert death_line(1, 3, 7) == "rank 1 died with exit code 3 after 7 ops"
    assert death_line(2, -9, 0) == "rank 2 was killed by SIGKILL after 0 ops"
    assert death_line(0, -15, 4) == "rank 0 was killed by SIGTERM after 4 ops"


def test_process_state_reads_proc_and_is_unknown_for_no_process():
    assert process_state(os.getpid()) == "R"  # this process, reading its own stat
    assert process_state(None) == "?" and not is_stopped(None)


@pytest.fixture
def core_taken():
    """This thread pinned to one core, and a busy process beside it on that core
    (already running): the thread must wait its turn."""
    import subprocess
    import sys

    mine = os.sched_getaffinity(0)
    core = min(mine)
    os.sched_setaffinity(0, {core})
    busy = subprocess.Popen([sys.executable, "-c",
                             f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
    try:
        while _cpu_ns(busy.pid) == 0:  # it has run: it competes from now on
            os.sched_yield()
        yield
    finally:
        busy.kill()
        busy.wait()
        os.sched_setaffinity(0, mine)


def _cpu_ns(pid: int) -> int:
    """CPU time ``pid`` has had so far (0 before it ran)."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0])


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"),
                    reason="the run queue is known on Linux only")
def test_a_compute_op_on_a_shared_core_says_how_long_it_waited_to_run(
        core_taken, monkeypatch: pytest.MonkeyPatch):
    """Its wall time less that wait is the time it held the core, as a GPU
    kernel's time is; a throttle stretches that time, not the wait."""
    from backends.torch.interpreter import INJECTED, HostClock, Interpreter
    from megatronapp.scan.online.live import QUEUED
    from megatronapp.trace.events import Tracer

    monkeypatch.setattr("backends.torch.interpreter.dist.get_backend", lambda: "gloo")
    clock = HostClock(time.perf_counter_ns())
    tracer = Tracer(1, now=clock.now_s)
    faults = injected_faults(_scenario([{"kind": "throttle", "rank": 1, "factor": 2.0}]), 1)
    interp = Interpreter(1, None, clock, tracer, faults, lambda: torch.zeros(1))  # type: ignore[arg-type]

    def work() -> None:
        start = time.thread_time()
        while time.thread_time() - start < 0.05:  # CPU seconds, however long it waits
            pass

    interp._compute(Compute("forward", 0.0, run=work))
    interp.flush(final=True)
    (event,) = tracer.events
    assert event.args[QUEUED] > 0
    assert event.args[INJECTED] < event.dur_s - event.args[QUEUED]


def test_a_wait_to_run_after_the_op_never_makes_its_device_time_negative():
    """The thread waits 2 s for a core right after a 1 s op, between the
    clock's two end reads: the wait is read first, so the op's device time
    is never less than nothing (the throttle would then add no sleep)."""
    from backends.torch.interpreter import Busy, HostClock

    class Scripted(HostClock):
        """Time and the run-queue wait as the kernel would report them: each
        read of one lets the 2 s wait happen before the next read of the
        other, once."""

        def __init__(self) -> None:
            super().__init__(0)
            self.t, self.q, self.waited = 1.0, 0.0, False

        def _wait_once(self) -> None:
            if not self.waited:
                self.waited, self.t, self.q = True, self.t + 2.0, self.q + 2.0

        def now_s(self) -> float:
            now = self.t
            self._wait_once()
            return now

        def queued_s(self) -> float | None:
            queued = self.q
            self._wait_once()
            return queued

    device = Scripted().on_device_s(Busy(0.0, 0.0, 0.0))
    assert device >= 1.0
