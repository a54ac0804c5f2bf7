"""Spawn one process per rank (gloo on CPU, NCCL on GPUs) and gather the run.

Workers stream their events back through a queue as they record them (so the
caller's ``on_record`` sees progress live) and send their full result at the
end. A failing rank's traceback is re-raised here and the other ranks are
stopped.
"""
from __future__ import annotations

import os
import queue as queue_mod
import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatronapp.config import Scenario
from megatronapp.tracer import Event, RunResult

from .stages import TrainOptions
from .worker import WorkerResult, assemble, quiet_megatron_warnings, run_rank

POLL_S = 0.5


class TorchRunError(RuntimeError):
    """A rank failed or died; carries its traceback."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawned(rank: int, s: Scenario, port: int, options: TrainOptions, coalesce: bool | None,
             threads: int, out: Any) -> None:
    quiet_megatron_warnings()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    try:
        dist.init_process_group(backend, rank=rank, world_size=s.world_size)
        result = run_rank(s, rank, rank, options, coalesce,
                          on_record=lambda r, e: out.put(("event", r, e)))
        out.put(("done", rank, result))
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(procs: list[Any], out: Any, world: int,
             on_record: Callable[[int, Event], None] | None) -> list[WorkerResult]:
    results: dict[int, WorkerResult] = {}
    while len(results) < world:
        try:
            kind, rank, payload = out.get(timeout=POLL_S)
        except queue_mod.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                raise TorchRunError(f"rank {dead[0]} died with exit code "
                                    f"{procs[dead[0]].exitcode}") from None
            continue
        if kind == "error":
            raise TorchRunError(f"rank {rank} failed:\n{payload}")
        if kind == "event" and on_record is not None:
            on_record(rank, payload)
        elif kind == "done":
            results[rank] = payload
    return [results[r] for r in range(world)]


def spawn_run(s: Scenario, options: TrainOptions = TrainOptions(), coalesce: bool | None = None,
              on_record: Callable[[int, Event], None] | None = None,
              ) -> tuple[RunResult, list[WorkerResult]]:
    """Run ``s`` on ``s.world_size`` fresh processes; the RunResult plus each
    rank's raw result (losses, gradient norms, optional step capture)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    threads = max(1, (os.cpu_count() or 1) // s.world_size)
    port = free_port()
    procs = [ctx.Process(target=_spawned, args=(r, s, port, options, coalesce, threads, out))
             for r in range(s.world_size)]
    for p in procs:
        p.start()
    try:
        results = _collect(procs, out, s.world_size, on_record)
    finally:
        for p in procs:
            p.join(timeout=5 if p.exitcode is None else None)
            if p.is_alive():
                p.terminate()
                p.join()
    return assemble(s, results), results
