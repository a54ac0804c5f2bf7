"""Helpers more than one test module uses; tests/conftest.py keeps fixtures and hooks only."""
from __future__ import annotations

import ast
import gzip
import io
import json
import os
import socket
import subprocess
import sys
from collections import defaultdict
from dataclasses import replace
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from backends.torch.stages import TrainOptions, merge_tp_shards
from backends.torch.worker import WorkerResult
from megatronapp.io.outdirs import STAGING_MARKER
from megatronapp.program.layout import topology_of
from megatronapp.scenario.config import Scenario, ScenarioError, parse_scenario
from megatronapp.trace.events import Event, RunResult
from megatronapp.trace.kinds import COMPUTE_NAMES
from sim import run_sim

ROOT = Path(__file__).resolve().parents[1]


def source_trees() -> Iterator[tuple[str, ast.Module]]:
    """(path from the repository root, parsed source) of every module of the
    core, the backends and the simulator."""
    for top in ("megatronapp", "backends", "sim"):
        for path in sorted((ROOT / top).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def capped_cli(*args: str, cwd: Path = ROOT, memory: int = 3 << 30,
               timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The real command line in a child capped at ``memory`` bytes of address
    space and ``timeout`` seconds: an endless read, allocation or wait fails
    the test instead of hanging it."""
    def cap() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    return subprocess.run([sys.executable, "-m", "megatronapp.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, preexec_fn=cap,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def one_line_error(result: subprocess.CompletedProcess[str], *words: str) -> str:
    """The one line ``result`` printed on stderr, with exit status 2 and each of
    ``words`` in it (no traceback)."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


def free_port() -> int:
    """A port free on 127.0.0.1 now (for launchers that take one, as torchrun)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ------------------------------------------------------------ scenarios, CLI
def fixed_cost_scenario(**overrides: Any) -> Scenario:
    """Fixed compute costs and zero communication: closed forms hold exactly."""
    data: dict[str, Any] = {
        "schedule": "1f1b",
        "parallel": {"pp": 4, "microbatches": 8},
        "model": {"layers": 48, "hidden": 256, "heads": 4, "seq_len": 256, "vocab": 1024},
        "costs": {"forward_s": 1.0, "backward_s": 2.0, "p2p_s": 0.0, "allreduce_s": 0.0,
                  "optimizer_s": 0.0},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return parse_scenario(data)


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The console entry point's ``main`` run in this process (nothing is
    spawned): its exit status, stdout and stderr. tests/test_entry_point.py
    runs the installed command itself."""
    from megatronapp.cli import main

    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(cwd or ROOT)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            code = main(list(args))
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["megatronapp", *args], code, out.getvalue(), err.getvalue())


def assert_refused_naming(data: dict[str, Any], field: str, folder: Path) -> None:
    """The scenario ``data`` is refused naming ``field``: by the parser, and by
    ``predict`` with exit status 2 and exactly one line on stderr."""
    try:
        parse_scenario(data)
    except ScenarioError as err:
        assert err.field == field
    else:
        raise AssertionError(f"{field}: accepted")
    path = folder / "refused.json"
    path.write_text(json.dumps(data))
    result = run_cli("predict", str(path))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and field in result.stderr


# ---------------------------------------------------- output directories
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def mark_as_ours(folder: Path, pid: int, target: str, use: str = "partial") -> None:
    """The marker a command of process ``pid`` on this host writes into its staging folder."""
    (folder / STAGING_MARKER).write_text(json.dumps({
        "kind": "megatronapp staging", "use": use, "pid": pid,
        "host": os.uname().nodename, "target": target}))


# ------------------------------------------ real-like timing (MegaScan tests)
SKEWS = [{"kind": "clock_skew", "rank": 1, "offset_us": 7300.0, "drift_ppm": 60.0},
         {"kind": "clock_skew", "rank": 2, "offset_us": -4100.0, "drift_ppm": -80.0}]


def real_like(result: RunResult, seed: int, contended: dict[int, float] | None = None,
               link: tuple[tuple[int, int], str, float] | None = None) -> RunResult:
    """``contended``: rank -> share of its compute ops stretched 1.5-4x;
    ``link``: (pair, "slow" | "erratic", extra seconds) added after its receives."""
    rng = np.random.default_rng(seed)
    contended = contended or {}
    events: dict[int, list[Event]] = {}
    for rank, evs in result.events.items():
        iteration_end: dict[object, float] = {}
        for e in evs:
            key = e.args.get("iteration")
            iteration_end[key] = max(iteration_end.get(key, e.end_s), e.end_s)
        out = []
        for e in evs:
            end = e.end_s
            if "peer" in e.args and e.name.startswith("send"):
                end = iteration_end[e.args.get("iteration")]  # waited for at the end
            elif "peer" in e.args:
                end += 50e-6 + float(rng.exponential(1e-3))  # the receiver wakes up late
                pair = tuple(sorted((rank, int(e.args["peer"]))))
                if link is not None and pair == link[0]:
                    kind, extra = link[1], link[2]
                    end += extra if kind == "slow" else extra * float(rng.random() < 0.5)
            elif "group" in e.args:
                end += float(rng.exponential(0.5e-3))  # members leave at different times
            elif rng.random() < contended.get(rank, 0.0):
                end += e.dur_s * float(rng.uniform(0.5, 3.0))
            out.append(Event(e.name, e.start_s, end - e.start_s, e.args))
        events[rank] = out
    return replace(result, events=events, source=None)


def real_like_run(tp: int, pp: int, dp: int, iterations: int, seed: int = 4,
                  faults: tuple[dict, ...] = ()) -> RunResult:
    return run_sim(parse_scenario({
        "seed": seed, "iterations": iterations,
        "parallel": {"tp": tp, "pp": pp, "dp": dp, "microbatches": 8},
        # Untied: the first and last stages' embedding all-reduce (tied embeddings,
        # pp > 1), with this file's jittered completions, loosens the bounds of
        # the last stage past 300 us (follow-up for alignment); these thresholds
        # were set on pipelines without it.
        "model": {"layers": 8, "hidden": 1024, "heads": 16, "seq_len": 1024,
                  "untie_embeddings": True},
        "cluster": {"jitter": {"compute_sigma": 0.02, "link_sigma": 0.05}},
        "faults": SKEWS + list(faults)}))


# --------------------------------------------------- torch backend runs
TINY_MODEL = {"hidden": 32, "heads": 4, "seq_len": 8, "vocab": 64, "micro_batch_size": 2}
SGD = TrainOptions(optimizer="sgd", lr=0.5, capture_first_step=True)


def torch_scenario(parallel: dict[str, int], layers: int = 2, **top: Any) -> Scenario:
    return parse_scenario({"seed": 5, "iterations": 1, "schedule": "1f1b", **top,
                           "parallel": parallel, "model": {"layers": layers, **TINY_MODEL}})


def full_model(results: Sequence[WorkerResult], s: Scenario, field: str, dp: int = 0
               ) -> dict[str, np.ndarray]:
    """One replica's full-model tensors, TP shards concatenated."""
    topo = topology_of(s)
    shards: dict[str, dict[int, np.ndarray]] = defaultdict(dict)
    dims: dict[str, int | None] = {}
    for r in results:
        coord = topo.coord(r.rank)
        if coord.dp == dp:
            for name, value in getattr(r.capture, field).items():
                shards[name][coord.tp] = value
                dims[name] = r.capture.partition_dim[name]
    return {n: merge_tp_shards([by_tp[t] for t in sorted(by_tp)], dims[n])
            for n, by_tp in shards.items()}


def sample_losses(results: Sequence[WorkerResult], s: Scenario) -> dict[int, float]:
    """Iteration 0's loss per global sample (dp rank * microbatches + microbatch)."""
    topo, m = topology_of(s), s.parallel.microbatches
    return {topo.coord(r.rank).dp * m + mb: loss
            for r in results for mb, loss in r.losses.get(0, {}).items()}


def compute_sequence(events: Sequence[Event]) -> list[tuple[Any, ...]]:
    return [(e.name, e.args.get("microbatch"), e.args.get("chunk"))
            for e in sorted(events, key=lambda e: e.start_s) if e.name in COMPUTE_NAMES]


# ------------------------------------------ Kineto's trace schema, by hand
KINETO_BASE_NS = 1_790_000_000_000_000_000


def kineto_event(name: str, cat: str, pid: Any, tid: Any, ts: float, dur: float, **args: Any) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur,
            "args": args}


def kineto_meta(pid: int) -> list[dict]:
    """What every Kineto file carries besides work: metadata (string pids too),
    counters, instants, flows."""
    return [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "python"}},
            {"ph": "M", "name": "process_sort_index", "pid": "Spans", "tid": 0,
             "args": {"sort_index": 536870912}},
            {"ph": "i", "s": "g", "name": "Iteration Start: PyTorch Profiler", "pid": "Traces",
             "tid": "Trace PyTorch Profiler", "ts": 1.0},
            {"ph": "C", "name": "GPU 0 Memory", "pid": 0, "tid": 0, "ts": 2.0,
             "args": {"Total Allocated": 1024}},
            kineto_event("PyTorch Profiler (0)", "Trace", "Spans", "PyTorch Profiler", 0.0, 1e6)]


MAIN, GLOO = 1, 21  # a gloo job's main thread and a gloo worker thread


def gloo_file(rank: int, world: int, events: list[dict[str, Any]]) -> dict:
    """One rank's Kineto file as a gloo job on one host writes it."""
    return {"schemaVersion": 1, "baseTimeNanoseconds": KINETO_BASE_NS, "host_name": "node0",
            "traceEvents": kineto_meta(rank) + events,
            "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": world,
                                "pg_config": [{"pg_name": "0", "pg_desc": "default_pg",
                                               "pg_size": world, "ranks": list(range(world))}]}}


def collective(rank: int, op: str, gloo_op: str, at: float, done: float) -> list[dict]:
    """A c10d call on the main thread, run by gloo on its own thread until ``done``."""
    return [kineto_event(f"c10d::{op}", "cpu_op", rank, MAIN, at, 20.0),
            kineto_event(f"gloo:{gloo_op}", "user_annotation", rank, GLOO, at + 5, done - at - 5)]


def write_kineto(directory: Path, files: dict[int, dict], gz: bool = False) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for rank, data in files.items():
        name = directory / f"host_{rank}.{rank}.pt.trace.json"
        if gz:
            with gzip.open(f"{name}.gz", "wt") as fh:
                json.dump(data, fh)
        else:
            name.write_text(json.dumps(data))
    return directory


def _kineto_step_work(rank: int, step: int, factor: float) -> list[tuple[str, float]]:
    return [(name, base * factor * (1 + 0.01 * ((step * 7 + rank) % 3)))
            for name, base in (("forward", 900.0), ("backward", 1800.0))]


def kineto_cycle_file(rank: int, world: int, steps: range, slow: dict[int, float]) -> dict:
    """One rank's file of one profiling cycle (``tensorboard_trace_handler``
    writes one per rank per cycle): a data-parallel group on GPUs, each step a
    ``ProfilerStep#N`` range holding forward and backward kernels, then an NCCL
    all-reduce of the whole group that ends when its last member arrives.
    ``slow``: step -> factor of rank 1's kernels."""
    pid = 4000 + rank
    events = kineto_meta(pid)
    group = {"Process Group Name": "1", "Process Group Description": "undefined",
             "Process Group Ranks": str(list(range(world)))}

    def work(r: int, step: int) -> list[tuple[str, float]]:
        return _kineto_step_work(r, step, slow.get(step, 1.0) if r == 1 else 1.0)

    for step in steps:
        t0 = 30000.0 * step
        t = t0 + 100
        events.append(kineto_event(f"ProfilerStep#{step}", "user_annotation", pid, pid, t0, 29000.0))
        for name, dur in work(rank, step):
            events += [kineto_event(name, "gpu_user_annotation", 0, 7, t, dur),
                       kineto_event("ampere_sgemm_128x64_nn", "kernel", 0, 7, t, dur, stream=7)]
            t += dur + 50
        last = t0 + 100 + max(sum(d + 50 for _, d in work(r, step)) for r in range(world))
        corr = 1000 * step + rank
        events += [kineto_event("record_param_comms", "cpu_op", pid, pid, t - 10, 5.0,
                                **{"Collective name": "allreduce", "dtype": "Float",
                                   "In msg nelems": 4096, "Out msg nelems": 4096,
                                   "Group size": world, **group}),
                   kineto_event("cudaLaunchKernel", "cuda_runtime", pid, pid, t - 5, 3.0,
                                correlation=corr),
                   kineto_event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", 0, 20, t,
                                last + 300 - t, correlation=corr, stream=20)]
    return {"schemaVersion": 1, "baseTimeNanoseconds": KINETO_BASE_NS, "traceEvents": events,
            "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world, "pg_config": [
                {"pg_name": "0", "pg_desc": "default_pg", "pg_size": world,
                 "ranks": list(range(world))},
                {"pg_name": "1", "pg_desc": "undefined", "pg_size": world,
                 "ranks": list(range(world))}]}}


# the constants a simulated run is made with, which calibrate must recover
CALIBRATION_TRUTH = {"cluster.gpu.efficiency": 0.3, "cluster.gpu.gemm_overhead_us": 50.0,
                     "cluster.gpu.module_overhead_us": 300.0, "cluster.gpu.hbm_tbps": 0.01,
                     "cluster.gpu.backward_ratio": 1.4, "cluster.gpu.op_overhead_us": 100.0,
                     "cluster.links.intra_node_latency_us": 40.0,
                     "cluster.links.intra_node_gbps": 16.0}


# A command's peak memory in a child: VmHWM, the high-water mark of its own
# address space (ru_maxrss would count the pytest process it was forked from).
PEAK_OF_COMMAND = ("import sys; from megatronapp.cli import main; code = main(sys.argv[1:]); "
                   "print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM:'))); "
                   "sys.exit(code)")


def peak_memory_of(argv: Sequence[str]) -> int:
    """Peak resident bytes of ``megatronapp argv`` in a child that must succeed."""
    done = subprocess.run([sys.executable, "-c", PEAK_OF_COMMAND, *argv], cwd=ROOT, text=True,
                          capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split("VmHWM:")[1].split()[0]) * 1024
