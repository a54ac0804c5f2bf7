"""The torch.distributed backend: real processes, megatron-core GPT stages.

``TorchBackend.run`` (``run_scenario``) spawns one process per rank (gloo on CPU, NCCL with CUDA),
each interpreting its rank program from ``megatronapp.run.jobs.rank_programs``
with megatron-core stages, and gathers every rank's events into a RunResult.
A scenario with an ``fbd`` section trains decoupled through the same launcher
and interpreter: one process per MegaFBD worker (``fbd_worker.FBD``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatronapp.costs.run_size import RunSize
from megatronapp.program.backend import (PROFILE, REAL, SCOPE_MODEL, STALL_TIMEOUT, RunHooks,
                                         RunOptions, ScopeModel)
from megatronapp.scenario.config import Scenario, ScenarioError
from megatronapp.scenario.pipeline_split import is_default as even_split
from megatronapp.errors import UserError
from megatronapp.trace.events import RunResult


@dataclass(frozen=True)
class TorchBackend:
    """Real ranks; ``RunOptions``: ``stall_timeout_s`` (fail when no rank makes
    progress for this long), ``profile_dir`` (also write a torch.profiler trace
    per rank there), ``out_dir`` (the run directory: a ``scope:`` capture goes to
    ``scope/``, a ``training.checkpoint`` to ``checkpoint/``, mid-run checkpoints
    to ``checkpoints/``), ``checkpoint_every``, ``resume_iteration`` and ``stop``
    (the closed loop, see resume.py and stopping.py). ``hooks.events``
    sees every event; ``hooks.on_phase`` is told what the run is doing
    (spawning, building stages)."""

    name: str = "torch"
    capabilities: frozenset[str] = frozenset({REAL, STALL_TIMEOUT, PROFILE, SCOPE_MODEL})

    def run(self, scenario: Scenario, options: RunOptions, hooks: RunHooks) -> RunResult:
        return run_scenario(scenario, options, hooks)

    def size(self, scenario: Scenario) -> RunSize | None:
        return None  # real processes: counted as ranks, not priced per event

    def scope_model(self) -> ScopeModel:
        """MegaScope's checkpoint commands (generate, lens, patch) on real megatron-core."""
        from .scope_model import TorchScopeModel

        return TorchScopeModel()


def run_scenario(s: Scenario, options: RunOptions = RunOptions(),
                 hooks: RunHooks = RunHooks()) -> RunResult:
    """Run a scenario for real (see ``TorchBackend``); sends coalesce on NCCL only."""
    check_supported(s)
    from .launch import STALL_TIMEOUT_S, spawn_run
    from .stages import TrainOptions

    job, on_record = None, hooks.events
    if s.fbd is not None:
        from megatronapp.fbd.run import fbd_layout
        from sim import check_fbd_scenario, progress_hook

        from .fbd_worker import FBD

        check_fbd_scenario(s)
        job, on_record = FBD, progress_hook(fbd_layout(s), on_record)
    out_dir = options.out_dir
    mid_run = options.checkpoint_every is not None or options.resume_iteration > 0
    if out_dir is None and (s.scope is not None or s.training.checkpoint or mid_run):
        raise UserError("scope / training.checkpoint / mitigation: the torch backend writes "
                        "them into a run directory (megatronapp run)")
    profile_dir = str(options.profile_dir) if options.profile_dir is not None else None
    train_options = TrainOptions(optimizer=s.training.optimizer, lr=s.training.lr,
                                 profile_dir=profile_dir,
                                 workdir=str(out_dir) if out_dir is not None else None,
                                 checkpoint_every=options.checkpoint_every,
                                 first_iteration=options.resume_iteration)
    stall_s = STALL_TIMEOUT_S if options.stall_timeout_s is None else options.stall_timeout_s
    result, _ = spawn_run(s, train_options, None, on_record, stall_timeout_s=stall_s,
                          on_phase=hooks.on_phase, job=job, stop=options.stop)
    if out_dir is not None:
        from .scope_run import finalize

        losses = result.training.loss_per_iteration if result.training is not None else []
        result.scope, result.checkpoint = finalize(s, Path(out_dir), losses)
    return result


def check_supported(s: Scenario) -> None:
    """Options the simulator models that these stages do not run (one line, exit 2)."""
    import torch

    for key in ("overlap_grad_reduce", "overlap_param_gather"):
        if getattr(s.training, key):
            raise ScenarioError(f"training.{key}", "the torch backend reduces gradients after "
                                "the last backward; simulate overlap with --backend sim")
    if s.model.position_embedding_params == 0:
        raise ScenarioError("model.position_embedding_type", "the torch backend's stages learn "
                            "absolute positions; simulate rope or none with --backend sim")
    if s.parallel.tp_comm_overlap:
        raise ScenarioError("parallel.tp_comm_overlap", "the torch backend's stages run their "
                            "collectives after the GEMMs; simulate the overlap with --backend sim")
    if s.async_tp_backward and s.parallel.tp > 1:
        raise ScenarioError("parallel.async_tp_backward", "the torch backend's stages reduce "
                            "input gradients before the weight gradients; simulate the overlap "
                            "with --backend sim")
    if s.parallel.cp > 1:
        raise ScenarioError("parallel.context_parallel_size", "the torch backend's stages run "
                            "without context parallelism; simulate it with --backend sim")
    if not s.stores_scores:
        raise ScenarioError("model.attention_backend", "the torch backend's stages run "
                            "megatron-core's unfused attention; simulate flash or fused "
                            "attention with --backend sim")
    if not even_split(s.parallel):
        raise ScenarioError("parallel", "the torch backend's stages split the layers evenly; "
                            "simulate an uneven pipeline split with --backend sim")
    if s.sequence_parallel and not torch.cuda.is_available():
        raise ScenarioError("parallel.sequence_parallel", "needs NCCL (gloo has no "
                            "reduce-scatter for megatron-core's sequence-parallel layers)")
