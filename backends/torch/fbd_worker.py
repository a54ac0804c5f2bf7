"""A MegaFBD worker's process, and a decoupled run as a launcher job.

MegaFBD on torch is the ordinary launcher (``launch.spawn_run`` with
``job=FBD``) starting one process per worker: ``2N`` processes for ``N``
virtual ranks. megatron-core keeps its parallel state in process globals, so
a process holds exactly one model; ``initialize_model_parallel(tp, pp)`` over
the ``2N`` processes sees a data-parallel degree of ``2·dp``, and
``FbdLayout.process_rank`` numbers the workers so that each of megatron's TP
and PP groups holds workers of one instance only: the GPTModel's own TP
collectives are those of its instance. The worker program (forward or
backward, ``megatronapp.fbd.workers``) runs on the one interpreter with
coordinated transfers (``fbd_runtime``); the DP gradient all-reduce
(backward workers) and the weight hand-over are the program's own
operations, through the coordinator.

Faults act on physical devices, priced by the simulator's models as in a
plain torch run: a throttled or slower-class device stretches the computes
of every worker process on it; a slow link or collective delays the control
thread that runs the transfer.
"""
from __future__ import annotations

import dataclasses
import resource
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from megatronapp.scenario.config import Scenario
from megatronapp.fbd.coordinator import GroupTable
from megatronapp.fbd.ranks import coordinated_groups
from megatronapp.fbd.run import (DeviceInfo, FbdRunResult, fbd_layout, fbd_programs, fbd_section,
                                 fbd_settings, gpt_stage_flops, worker_clocks, worker_labels)
from megatronapp.fbd.workers import NullDecoupledStage
from megatronapp.parallel.ops import RankProgram
from megatronapp.io.progress import Say, quiet
from megatronapp.trace.events import Event, Tracer
from megatronapp.trace.sections import TrainingSection
from sim import device_clocks, fbd_device_faults, fbd_slots

from .fbd_runtime import ControlThread, CoordinatedInterpreter
from .fbd_stage import DecoupledGptStage
from .interpreter import CudaClock, HostClock
from .stages import TrainOptions
from .watchdog import OpBeacon
from .worker import (Job, WorkerResult, device_for, init_megatron, loss_per_iteration,
                     shared_origin_ns, torch_info)


# scenario, virtual rank -> its DecoupledStage => worker id -> program
FbdProgramsFor = Callable[[Scenario, Callable[[int], Any]], dict[int, RankProgram]]


@dataclass(frozen=True)
class FbdWorkerResult(WorkerResult):
    """A worker's result (``rank`` is its worker id) and what its process saw."""

    rounds: int = 0  # coordinator rounds of its control thread
    align_s: float = 0.0  # wall time in them
    executions: int = 0  # launched operations its control thread ran
    execute_s: float = 0.0  # wall time running them
    peak_rss_bytes: int = 0


def fbd_processes(s: Scenario) -> int:
    return fbd_layout(s).num_workers


def run_fbd_worker(s: Scenario, rank: int, local_rank: int, options: TrainOptions,
                   coalesce: bool | None = None,
                   on_record: Callable[[int, Event], None] | None = None,
                   beacon: OpBeacon | None = None,
                   programs: FbdProgramsFor = fbd_programs,
                   on_phase: Say = quiet) -> FbdWorkerResult:
    """Run the worker of process ``rank``; torch.distributed must be initialised
    over every worker process (``coalesce`` does not apply: the control
    thread sends one transfer at a time). The first backward worker tells
    ``on_phase`` when it builds its stage and when it trains."""
    from megatron.core import parallel_state

    layout = fbd_layout(s)
    worker = layout.worker_of_process(rank)
    vrank = layout.worker(worker).vrank
    say = on_phase if worker == layout.virtual_ranks else quiet
    device = device_for(local_rank)
    say("building stages")
    init_megatron(s)
    try:
        faults = fbd_device_faults(s, layout.device_of(layout.worker(worker)))
        table = GroupTable(coordinated_groups(layout), layout.num_workers)
        control = ControlThread(layout, worker, table, fbd_settings(s).round_nap_s, faults)
        stage = DecoupledGptStage(s, vrank, device, options)
        program = programs(s, lambda v: stage if v == vrank else NullDecoupledStage())[worker]
        origin = shared_origin_ns(device)
        clock = CudaClock(origin, device) if device.type == "cuda" else HostClock(origin)
        tracer = Tracer(worker, now=clock.now_s, on_record=on_record)
        control.start()
        say(f"iteration 1/{s.iterations}")
        # transfers and collectives are priced on the control thread
        CoordinatedInterpreter(worker, control, clock, tracer,
                               dataclasses.replace(faults, links=False),
                               stage.activation_buffer, device, beacon).run(program)
        if beacon is not None:
            beacon.finish()
        control.finish()
        dist.barrier()
    finally:
        parallel_state.destroy_model_parallel()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return FbdWorkerResult(worker, tracer.events, stage.log.losses, stage.log.grad_norms,
                           stage.log.capture, dist.get_backend(), False, control.rounds,
                           control.align_s, control.executions, control.execute_s, peak_rss)


def assemble_fbd(s: Scenario, results: Sequence[WorkerResult]) -> FbdRunResult:
    """Every worker's events and logs -> one decoupled run (backend "torch")."""
    layout = fbd_layout(s)
    slots = fbd_slots(s, layout)
    by_worker: dict[int, Any] = {r.rank: r for r in results}
    rss = {d: float(sum(by_worker[w].peak_rss_bytes for w in workers))
           for d, workers in layout.workers_by_device.items()}
    devices = [DeviceInfo(sl.name, sl.memory_bytes, rss[d]) for d, sl in enumerate(slots)]
    events = {w: r.events for w, r in sorted(by_worker.items())}
    workers = list(by_worker.values())
    rounds, executions = sum(r.rounds for r in workers), sum(r.executions for r in workers)
    section = fbd_section(
        s, layout, devices, events, "gpt", gpt_stage_flops(s),
        coordinator_rounds=max(r.rounds for r in workers),
        # what a round and a launched transfer took here (calibration)
        coordinator_round_s=sum(r.align_s for r in workers) / max(rounds, 1),
        coordinator_execute_s=sum(r.execute_s for r in workers) / max(executions, 1),
        memory="measured peak RSS of the device's worker processes")
    training = TrainingSection(loss_per_iteration(results), torch_info(results))
    clocks = worker_clocks(layout, device_clocks(s, layout.num_devices))
    return FbdRunResult("torch", layout.topo, events, clocks, fbd=section, training=training,
                        labels=worker_labels(layout, [sl.name for sl in slots]))


FBD = Job(fbd_processes, run_fbd_worker, assemble_fbd, fbd_programs)
