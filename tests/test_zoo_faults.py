"""The launcher's injected faults (``tests/zoo/injection.py``,
``tests/zoo/shaping.py``) and the per-step measures of ``tests/zoo/measure.py``:
each fault has its effect, read back from the job's own trace (the slow
tests run real 4-rank jobs), and the measures read synthetic traces right."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.profiler import profile

from tests.zoo.injection import (Clock, ExtraCalls, NoisyNeighbour, StalledDataset,
                                 busy_python, steps_hit)
from tests.zoo.measure import (COMPUTE, STEP_PREFIX, by_rank, covered, main_thread_events,
                               measure_step, receive_waits, run_measures, step_measures)
from tests.zoo.shaping import BURST, Connection, channel_ports, established

ROOT = Path(__file__).resolve().parents[1]
ZOO = ROOT / "tests" / "zoo"
WORLD, STEPS = 4, 4
TRACED = range(2, 2 + STEPS)  # the launcher skips one step and warms up one


# ------------------------------------------------------------ fast: pieces
def test_an_intermittent_fault_hits_every_kth_step_from_the_kth():
    assert steps_hit(3, first=2, count=4) == [2, 5]
    assert steps_hit(1, first=2, count=4) == [2, 3, 4, 5]
    clock = Clock(every=2)
    hits = []
    for step in range(6):
        clock.step = step
        hits.append(clock.hit())
    assert hits == [False, True] * 3


def linear_calls(factor: float | None) -> tuple[Counter[str], torch.Tensor]:
    """Two forward/backward passes of a linear layer (with the fault, if
    ``factor``): its matmul calls by name and input shapes, and its gradient."""
    torch.manual_seed(0)
    layer, x = nn.Linear(8, 4), torch.randn(5, 8)
    fault = ExtraCalls(factor, Clock()) if factor else None
    with profile(record_shapes=True) as prof:
        for _ in range(2):
            with fault or nullcontext():
                layer(x).square().sum().backward()
    calls = Counter(f"{e.name} {e.input_shapes}" for e in prof.events()
                    if e.name in ("aten::addmm", "aten::mm"))
    assert layer.weight.grad is not None
    return calls, layer.weight.grad


@pytest.mark.parametrize("factor", [2.0, 1.5])
def test_extra_calls_repeat_each_matmul_with_the_same_shapes_and_leave_gradients_alone(factor):
    plain, plain_grad = linear_calls(None)
    faulty, faulty_grad = linear_calls(factor)
    assert set(faulty) == set(plain)  # no new shapes: only more calls
    assert {key: faulty[key] / plain[key] for key in plain} == dict.fromkeys(plain, factor)
    torch.testing.assert_close(faulty_grad, plain_grad)


def test_extra_calls_repeat_an_lstm_whose_layers_count_as_compute():
    """A CPU LSTM does its matmuls inside oneDNN's layer ops: extra calls
    repeat the whole LSTM (its layers run twice), and the per-step measure
    counts those layers as compute."""
    torch.manual_seed(0)
    lstm, x = nn.LSTM(8, 8, 2), torch.randn(3, 2, 8)

    def layer_calls(fault: ExtraCalls | None) -> Counter[str]:
        with profile() as prof, fault or nullcontext():
            lstm(x)[0].sum().backward()
        return Counter(e.name for e in prof.events() if e.name in COMPUTE)
    plain, faulty = layer_calls(None), layer_calls(ExtraCalls(2.0, Clock()))
    assert plain["aten::mkldnn_rnn_layer"] == 2 and plain["aten::mkldnn_rnn_layer_backward"] == 2
    assert {name: faulty[name] / plain[name] for name in plain} == dict.fromkeys(plain, 2.0)


def test_extra_calls_repeat_a_transposed_convolution_counted_as_compute():
    """A generator's transposed convolution runs twice under extra calls,
    forward and backward, and the per-step measure counts it as compute."""
    torch.manual_seed(0)
    layer, x = nn.ConvTranspose2d(4, 2, 4, 2, 1), torch.randn(3, 4, 5, 5)

    def conv_calls(fault: ExtraCalls | None) -> Counter[str]:
        with profile() as prof, fault or nullcontext():
            layer(x).sum().backward()
        return Counter(e.name for e in prof.events() if e.name in COMPUTE)
    plain, faulty = conv_calls(None), conv_calls(ExtraCalls(2.0, Clock()))
    assert plain["aten::convolution"] == 1 and plain["aten::convolution_backward"] == 1
    assert {name: faulty[name] / plain[name] for name in plain} == dict.fromkeys(plain, 2.0)

def test_a_stalled_dataset_spends_its_cpu_only_in_the_steps_it_hits():
    clock = Clock(every=2)
    dataset = StalledDataset(list(range(8)), ms_per_item=20.0, clock=clock)
    spent = []
    for step in (0, 1):
        clock.step = step
        start, cpu = time.perf_counter(), time.thread_time()
        assert dataset.__getitems__([0, 1, 2]) == [0, 1, 2]
        spent.append((time.perf_counter() - start, time.thread_time() - cpu))
    assert spent[1][0] >= 0.060  # 3 items x 20 ms, a floor
    assert spent[0][1] < 0.060  # the spared step: the read's own CPU only


def thread_cpu_s(native_id: int) -> float:
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_a_noisy_neighbour_burns_cpu_in_its_own_thread_only_when_its_steps_come():
    clock = Clock(every=2, step=0)  # step 0: spared
    neighbour = NoisyNeighbour(clock)
    thread = neighbour.start()
    try:
        time.sleep(1.0)
        spared = thread_cpu_s(thread.native_id)
        clock.step = 1
        time.sleep(1.0)
        busy = thread_cpu_s(thread.native_id) - spared
    finally:
        neighbour.stop.set()
        thread.join()
    assert spared < 0.03  # naps of a millisecond: far less CPU than a second's
    assert busy > 0.03  # CPU-bound: its share of a loaded machine's second


def test_busy_python_returns_after_the_time_asked_having_used_the_cpu():
    start, cpu = time.perf_counter(), time.thread_time()
    busy_python(0.2)
    assert time.perf_counter() - start >= 0.2
    assert time.thread_time() - cpu > 0.005  # computed whenever it ran (a sleep uses µs)


TCP_TABLE = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:A000 0100007F:B000 01 00000000:00000000 00:00000000 00000000     0        0 111 1
   1: 0100007F:A001 0100007F:C000 01 00000000:00000000 00:00000000 00000000     0        0 112 1
   2: 0100007F:A002 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 113 1
   3: 0100007F:B000 0100007F:A000 01 00000000:00000000 00:00000000 00000000     0        0 211 1
   4: 0100007F:C000 0100007F:A001 01 00000000:00000000 00:00000000 00000000     0        0 311 1
""".splitlines()[1:]


def test_a_channel_is_the_senders_connections_whose_other_end_the_receiver_holds():
    sender = established(TCP_TABLE, {"111", "112", "113"})
    assert sender == [Connection(0xA000, 0xB000), Connection(0xA001, 0xC000)]  # 113 listens
    receiver = established(TCP_TABLE, {"211"})
    assert channel_ports(sender, receiver) == [Connection(0xA000, 0xB000)]
    assert channel_ports(receiver, sender) == [Connection(0xB000, 0xA000)]
    assert channel_ports(sender, established(TCP_TABLE, {"999"})) == []


def test_covered_time_is_the_union_of_intervals():
    assert covered([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert covered([]) == 0


def event(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op",
          **args: object) -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "cat": cat, "args": args}


def synthetic_trace(peers: bool) -> dict:
    """One step of 100 µs: a matmul, a receive (posted, then waited for), a
    collective that a gloo thread runs while the training thread waits in no
    op, and 30 µs in no op at all."""
    source = ["", "", "3", "0"] if peers else ["", "", "", ""]
    return {"distributedInfo": {"rank": 2}, "traceEvents": [
        event("ProfilerStep#7", 0, 100, cat="user_annotation"),
        event("aten::linear", 0, 20), event("aten::addmm", 1, 18, **{"Input Dims": [[2, 2]]}),
        event("c10d::recv_", 20, 5, **{"Concrete Inputs": source}),
        event("gloo:recv", 24, 16, cat="user_annotation"),
        event("gloo:all_reduce", 40, 30, tid=9, cat="user_annotation"),
        event("aten::mm", 200, 50)]}  # another step's


def test_a_step_measure_separates_compute_waits_and_time_outside_ops():
    (measure,) = step_measures(synthetic_trace(peers=True))
    assert (measure.step, measure.duration, measure.compute) == (7, 100, 18)
    assert measure.calls == Counter({"aten::addmm [[2, 2]]": 1})
    assert measure.outside == 100 - 70  # linear 0-20, recv 20-40, all-reduce 40-70
    assert [e["tid"] for e in main_thread_events(synthetic_trace(True))] == [1] * 6


def test_a_receive_wait_names_its_sender_only_where_shapes_are_recorded():
    assert receive_waits(synthetic_trace(peers=True)) == {3: [16]}
    assert receive_waits(synthetic_trace(peers=False)) == {None: [16]}


# ------------------------------------------------------------ slow: real jobs
def run_job(script: str, out: Path, *flags: str) -> dict[int, list]:
    """Run a zoo job (4 ranks, 4 traced steps); each rank's step measures."""
    subprocess.run([sys.executable, str(ZOO / script), "--out", str(out), "--world", str(WORLD),
                    "--steps", str(STEPS), *flags],
                   check=True, capture_output=True, timeout=600, cwd=ROOT)
    return run_measures(out)


@pytest.mark.slow
def test_extra_calls_on_two_ranks_every_third_step_double_their_calls_there_only(tmp_path):
    """Intermittent extra work on two ranks: ranks 1 and 3 call each matmul
    twice (same shapes: the same name-and-shape keys) in steps 2 and 5,
    and as often as their peers in steps 3 and 4."""
    measures = run_job("ddp_mlp.py", tmp_path, "--record-shapes", "--extra-rank", "1", "3",
                       "--extra-factor", "2", "--every", "3")
    assert sorted(measures) == list(range(WORLD))
    for rank, steps in measures.items():
        for m, peer in zip(steps, measures[0]):
            doubled = rank in (1, 3) and m.step in (2, 5)
            assert m.calls == (Counter({k: 2 * n for k, n in peer.calls.items()})
                               if doubled else peer.calls), (rank, m.step)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [("--loader-rank", "2", "--loader-ms", "150"),
                                   ("--step-stall-rank", "2", "--step-stall-ms", "150")])
def test_a_host_stall_shows_as_time_outside_ops_on_its_rank(tmp_path, flags):
    """A slow data loader (150 ms of CPU-bound Python per batch, in the
    loader the launcher gives a job without one) or a stall before the optimizer step
    (150 ms asleep, inside the optimizer's own range) is time in no op of
    the stalled rank's training thread, every step: the stall is a floor
    however loaded the machine."""
    measures = run_job("ddp_mlp.py", tmp_path, *flags)
    assert [m.step for m in measures[2]] == list(TRACED)
    # time in no op of its training thread (a gloo thread's range may still
    # be closing as the stall begins: its tail is not the stall's)
    events = main_thread_events(by_rank(tmp_path)[2])
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    idle = [measure_step(s, ops, []).outside for s in events
            if s["name"].startswith(STEP_PREFIX)]
    assert len(idle) == STEPS and min(idle) >= 150e3
    if flags[0] == "--step-stall-rank":
        for rank, trace in by_rank(tmp_path).items():
            optimizer = [e["dur"] for e in main_thread_events(trace)
                         if e["name"] == "Optimizer.step#SGD.step"]
            assert len(optimizer) == STEPS
            assert (min(optimizer) >= 150e3) == (rank == 2)


def sends_to(trace: dict, receiver: int) -> list[float]:
    return [e["ts"] for e in main_thread_events(trace) if e["name"] == "c10d::send"
            and e["args"]["Concrete Inputs"][2] == str(receiver)]


def arrivals_from(trace: dict, sender: int) -> list[float]:
    """The ends of the receiver's waits for messages from ``sender``."""
    arrivals, source = [], None
    for e in main_thread_events(trace):
        if e["name"] == "c10d::recv_":
            source = int(e["args"]["Concrete Inputs"][2])
        elif e["name"] == "gloo:recv" and source == sender:
            arrivals.append(e["ts"] + e["dur"])
    return arrivals


def message_latencies_us(traces: dict[int, dict], sender: int, receiver: int) -> list[float]:
    """Each message's time from its send's post to its receive's end (the
    ranks share the host's clock; a pair's messages arrive in order)."""
    sent, arrived = sends_to(traces[sender], receiver), arrivals_from(traces[receiver], sender)
    assert len(sent) == len(arrived) == STEPS * 8  # one per microbatch and step
    return [end - start for start, end in zip(sent, arrived)]


@pytest.mark.slow
@pytest.mark.alone  # the unshaped pairs' latency is judged against the shaped floor
def test_a_shaped_link_delays_every_message_on_its_channel_and_no_other(tmp_path):
    """``--shaped-link 1 2`` at 40 Mbit/s: a 256 KiB activation cannot reach
    rank 2 before its bytes beyond the burst have passed at that rate (about
    104 ms, a floor the kernel sets); the gradients going back (2 -> 1) and
    the other links' messages do arrive sooner."""
    if os.geteuid() != 0:
        pytest.skip("a shaped link needs root (a network namespace of its own)")
    mbit = 20.0
    run_job("pipeline_1f1b.py", tmp_path, "--record-shapes", "--shaped-link", "1", "2",
            "--link-mbit", str(mbit))
    traces = by_rank(tmp_path)
    floor_us = (128 * 512 * 4 - 1024 * int(BURST.rstrip("k"))) * 8 / mbit
    assert min(message_latencies_us(traces, 1, 2)) >= floor_us
    for sender, receiver in ((2, 1), (0, 1), (1, 0), (2, 3), (3, 2)):
        assert min(message_latencies_us(traces, sender, receiver)) < floor_us, (sender, receiver)
