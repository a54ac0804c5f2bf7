"""One rank's process: set up megatron-core, run the rank program, report.

Used by the in-process launcher (``launch.py``) and by torchrun::

    torchrun --nproc-per-node 4 -m backends.torch.worker SCENARIO --out DIR [--set k=v]
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from megatronapp.scenario.config import Scenario, ScenarioError, load_scenario
from megatronapp.run.jobs import StagesFor, rank_programs
from megatronapp.program.layout import topology_of
from megatronapp.parallel.ops import RankProgram
from megatronapp.program.ranks import NullStages
from megatronapp.io.progress import Say, quiet
from megatronapp.trace.events import Event, RunResult, Tracer
from megatronapp.trace.sections import TorchInfo, TrainingSection
from sim import clocks_of, injected_faults

from . import megatron_compat
from .interpreter import CudaClock, GroupCache, HostClock, Interpreter
from .profile import kineto_profile
from .scope_run import attach_session, save_shard
from .stages import MegatronStages, StepCapture, TrainOptions
from .stopping import StopSwitch, stoppable
from .watchdog import OpBeacon

# scenario, stages of each rank -> rank programs (``rank_programs`` unless a test swaps it)
ProgramsFor = Callable[[Scenario, StagesFor], dict[int, RankProgram]]


@dataclass(frozen=True)
class WorkerResult:
    """What one rank hands back to whoever gathers the run."""

    rank: int  # its trace process: the global rank (a MegaFBD worker's id)
    events: list[Event]
    losses: dict[int, dict[int, float]]  # iteration -> microbatch -> loss (last stage only)
    grad_norms: dict[int, float]
    capture: StepCapture | None
    dist_backend: str
    coalesce: bool


def quiet_megatron_warnings() -> None:
    """Megatron warns at import about Apex/TE fallbacks on every rank."""
    warnings.filterwarnings("ignore", module=r"megatron\.")


def device_for(local_rank: int) -> torch.device:
    """One GPU per local rank: NCCL refuses two ranks of a communicator on one GPU."""
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"local rank {local_rank} has no GPU of its own "
                               f"({torch.cuda.device_count()} on this host)")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _barrier_device(device: torch.device) -> dict[str, Any]:
    """NCCL barriers on this rank's own GPU (not one guessed from the rank)."""
    return {"device_ids": [device.index]} if device.type == "cuda" else {}


def shared_origin_ns(device: torch.device = torch.device("cpu")) -> int:
    """A common time origin: rank 0's monotonic clock when all ranks share a
    host (CLOCK_MONOTONIC is host-wide), else each rank's own after a barrier."""
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    dist.barrier(**_barrier_device(device))
    origin = [time.perf_counter_ns()]
    if len(set(hosts)) == 1:
        dist.broadcast_object_list(origin, src=0)
    return int(origin[0])


def init_megatron(s: Scenario) -> None:
    from megatron.core import parallel_state

    megatron_compat.apply()
    p = s.parallel
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp if p.vpp > 1 else None)


def run_rank(s: Scenario, rank: int, local_rank: int, options: TrainOptions,
             coalesce: bool | None = None,
             on_record: Callable[[int, Event], None] | None = None,
             beacon: OpBeacon | None = None,
             programs: ProgramsFor = rank_programs, on_phase: Say = quiet,
             stop: StopSwitch | None = None) -> WorkerResult:
    """Run this rank's program; torch.distributed must already be initialised.
    Rank 0 tells ``on_phase`` when it builds its stages and when it trains;
    ``stop`` may end the program at an iteration boundary."""
    from megatron.core import parallel_state

    say = on_phase if rank == 0 else quiet
    device = device_for(local_rank)
    say("building stages")
    init_megatron(s)
    try:
        groups = GroupCache(topology_of(s))
        stages = MegatronStages(s, rank, device, options)
        session = attach_session(s, stages, rank, options.workdir)  # MegaScope, if observed
        program = programs(s, lambda r: stages if r == rank else NullStages())[rank]
        if stop is not None:
            program = stoppable(program, rank, stop)
        origin = shared_origin_ns(device)
        clock = CudaClock(origin, device) if device.type == "cuda" else HostClock(origin)
        tracer = Tracer(rank, now=clock.now_s, on_record=on_record)
        backend = dist.get_backend()
        coalesce = backend == "nccl" if coalesce is None else coalesce
        say(f"iteration 1/{s.iterations}")
        with kineto_profile(options.profile_dir, rank) as wrap:
            Interpreter(rank, groups, clock, tracer, injected_faults(s, rank),
                        stages.activation_buffer, coalesce, device, beacon,
                        session.on_receive if session is not None else None).run(wrap(program))
        if session is not None:
            session.close()
        save_shard(s, stages, rank, options.workdir)
        if beacon is not None:
            beacon.finish()
        dist.barrier(**_barrier_device(device))
    finally:
        parallel_state.destroy_model_parallel()
    return WorkerResult(rank, tracer.events, stages.log.losses, stages.log.grad_norms,
                        stages.log.capture, backend, coalesce)


def loss_per_iteration(results: Sequence[WorkerResult]) -> list[float]:
    """The mean microbatch loss of each iteration over every rank that has one."""
    losses: dict[int, list[float]] = {}
    for r in results:
        for it, values in r.losses.items():
            losses.setdefault(it, []).extend(values.values())
    return [fmean(losses[it]) for it in sorted(losses)]


def torch_info(results: Sequence[WorkerResult]) -> TorchInfo:
    first = min(results, key=lambda r: r.rank)
    return TorchInfo(first.dist_backend, first.coalesce,
                     "cuda" if torch.cuda.is_available() else "cpu")


def assemble(s: Scenario, results: Sequence[WorkerResult]) -> RunResult:
    """Every rank's events and logs -> one RunResult (backend "torch")."""
    first = min(results, key=lambda r: r.rank)
    training = TrainingSection(
        loss_per_iteration(results), torch_info(results),
        grad_norm_per_iteration=[first.grad_norms[it] for it in sorted(first.grad_norms)])
    return RunResult("torch", topology_of(s), {r.rank: r.events for r in results},
                     clocks_of(s), training=training)


def world_size_of(s: Scenario) -> int:
    return s.world_size


@dataclass(frozen=True)
class Job:
    """What the launcher starts for a scenario: ``processes(s)`` processes,
    each running ``run_rank`` on its programs (``programs``, a module-level
    function: it is pickled), their results joined by ``assemble``."""

    processes: Callable[[Scenario], int]
    run_rank: Callable[..., WorkerResult]
    assemble: Callable[[Scenario, Sequence[WorkerResult]], RunResult]
    programs: ProgramsFor


PIPELINE = Job(world_size_of, run_rank, assemble, rank_programs)


# ---------------------------------------------------------------- torchrun
def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="backends.torch.worker",
                                     description="one rank of a torch-backend run (torchrun)")
    parser.add_argument("scenario")
    parser.add_argument("--out", required=True, help="run directory written by rank 0")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from megatronapp.run.report import print_summary
    from megatronapp.run.write import staged_dir, write_run

    args = _parse(argv)
    quiet_megatron_warnings()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        s = load_scenario(args.scenario, args.set)
        if s.world_size != world:
            raise ScenarioError("parallel", f"tp*pp*dp = {s.world_size} but torchrun started "
                                f"{world} processes")
        if s.scope is not None or s.training.checkpoint:
            raise ScenarioError("scope" if s.scope is not None else "training.checkpoint",
                                "not supported under torchrun yet; use megatronapp run "
                                "--backend torch")
    except ScenarioError as err:
        if rank == 0:
            print(f"megatronapp: scenario error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        result = run_rank(s, rank, int(os.environ.get("LOCAL_RANK", 0)), TrainOptions())
        gathered: list[Any] = [None] * world if rank == 0 else []
        dist.gather_object(result, gathered if rank == 0 else None, dst=0)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with staged_dir(Path(args.out)) as tmp:
            summary = write_run(s, assemble(s, gathered), tmp)
        print_summary(summary, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
