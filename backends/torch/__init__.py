"""The torch.distributed backend: real processes, megatron-core GPT stages.

``run_scenario`` spawns one process per rank (gloo on CPU, NCCL with CUDA),
each interpreting its rank program from ``megatronapp.jobs.rank_programs``
with megatron-core stages, and gathers every rank's events into a RunResult.
A scenario with an ``fbd`` section trains decoupled through the same launcher
and interpreter: one process per MegaFBD worker (``fbd_worker.FBD``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from megatronapp.config import Scenario, ScenarioError
from megatronapp.errors import UserError
from megatronapp.tracer import Event, RunResult


def run_scenario(s: Scenario, on_record: Callable[[int, Event], None] | None = None,
                 **kw: Any) -> RunResult:
    """Run a scenario for real. ``kw``: ``optimizer`` ("adam" | "sgd"), ``lr``,
    ``coalesce`` (hold sends for the next receive; default: on NCCL only),
    ``stall_timeout_s`` (fail when no rank makes progress for this long),
    ``on_phase`` (told what the run is doing: spawning, building stages),
    ``profile_dir`` (also write a torch.profiler trace per rank there),
    ``out_dir`` (the run directory: a ``scope:`` capture goes to ``scope/``,
    a ``training.checkpoint`` to ``checkpoint/``)."""
    check_supported(s)
    from megatronapp.progress import quiet

    from .launch import STALL_TIMEOUT_S, spawn_run
    from .stages import TrainOptions

    job = None
    if s.fbd is not None:
        from backends.sim_fbd import check_fbd_scenario, progress_hook
        from megatronapp.fbd.run import fbd_layout

        from .fbd_worker import FBD

        check_fbd_scenario(s)
        job, on_record = FBD, progress_hook(fbd_layout(s), on_record)
    out_dir = kw.get("out_dir")
    if out_dir is None and (s.scope is not None or s.training.checkpoint):
        raise UserError("scope / training.checkpoint: the torch backend writes them into a run "
                        "directory (megatronapp run)")
    options = TrainOptions(optimizer=kw.get("optimizer", s.training.optimizer),
                           lr=kw.get("lr", s.training.lr), profile_dir=kw.get("profile_dir"),
                           workdir=str(out_dir) if out_dir is not None else None)
    result, _ = spawn_run(s, options, kw.get("coalesce"), on_record,
                          stall_timeout_s=kw.get("stall_timeout_s", STALL_TIMEOUT_S),
                          on_phase=kw.get("on_phase", quiet), job=job)
    if out_dir is not None:
        from .scope_run import finalize

        result.extra.update(finalize(s, Path(out_dir), result.extra["loss_per_iteration"]))
    return result


def check_supported(s: Scenario) -> None:
    """Options the simulator models that these stages do not run (one line, exit 2)."""
    import torch

    for key in ("overlap_grad_reduce", "overlap_param_gather"):
        if getattr(s.training, key):
            raise ScenarioError(f"training.{key}", "the torch backend reduces gradients after "
                                "the last backward; simulate overlap with --backend sim")
    if s.sequence_parallel and not torch.cuda.is_available():
        raise ScenarioError("parallel.sequence_parallel", "needs NCCL (gloo has no "
                            "reduce-scatter for megatron-core's sequence-parallel layers)")
