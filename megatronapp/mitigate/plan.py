"""Re-planning a job without a node: a spare takes its place, else the job
shrinks its data parallelism and keeps its global batch through more
microbatches. Faults follow their GPUs (gone with the dropped node) and keep
their place in time (a restarted job's clock starts at zero): each kind says
how (``FaultSpec.moved``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatronapp.errors import UserError
from megatronapp.scenario.config import Parallel, Scenario, parse_scenario, scenario_to_dict

__all__ = ["Replan", "global_batch", "replan", "restart_plan", "shrunk_parallel",
           "work_ratio"]


@dataclass(frozen=True)
class Replan:
    scenario: Scenario
    node: int  # the node left out
    spare: bool  # a spare took its place (the layout is unchanged)


def global_batch(p: Parallel, micro_batch_size: int) -> int:
    return p.dp * p.microbatches * micro_batch_size


def shrunk_parallel(p: Parallel, gpus: int) -> Parallel | None:
    """The largest data parallelism that fits ``gpus`` and divides the global
    batch's microbatches (and keeps interleaved groups whole); None if none."""
    samples = p.dp * p.microbatches
    for dp in range(min(p.dp, gpus // (p.tp * p.cp * p.pp)), 0, -1):
        microbatches = samples // dp
        if samples % dp == 0 and (p.vpp == 1 or microbatches % p.group_size == 0):
            return p.model_copy(update={"dp": dp, "microbatches": microbatches})
    return None


def work_ratio(before: Parallel, after: Parallel) -> float:
    """How much longer an iteration of ``after`` takes than one of ``before``
    with the same microbatch cost: a pipeline's iteration is its microbatches
    plus the bubble, (pp - 1) / vpp of them (Narayanan et al. 2021, eq. 1)."""
    bubble_before = (before.pp - 1) / before.vpp
    bubble_after = (after.pp - 1) / after.vpp
    return (after.microbatches + bubble_after) / (before.microbatches + bubble_before)


def _moved(gpu: int, node: int, per_node: int, world: int) -> int | None:
    """Where GPU ``gpu`` sits once ``node`` is gone (None: gone or unused)."""
    if gpu // per_node == node:
        return None
    moved = gpu - per_node if gpu // per_node > node else gpu
    return moved if moved < world else None


def replan(s: Scenario, rank: int, elapsed_s: float) -> Replan:
    """``s`` restarted without the node of ``rank``, ``elapsed_s`` into the job."""
    per_node = s.cluster.gpus_per_node
    node = rank // per_node
    m = s.mitigation
    spares = m.spares if m is not None else 0
    if spares:
        parallel, world = s.parallel, s.world_size
        place = (lambda g: None if g // per_node == node else g)
    else:
        shrunk = shrunk_parallel(s.parallel, s.world_size - per_node)
        if shrunk is None:
            raise UserError(f"mitigation: no plan fits the {s.world_size - per_node} GPUs left "
                            f"without node {node} (tp {s.parallel.tp} x pp {s.parallel.pp})")
        parallel, world = shrunk, shrunk.world_size
        place = (lambda g: _moved(g, node, per_node, world))
    faults = tuple(f for f in (f.moved(place, elapsed_s) for f in s.faults) if f is not None)
    # the faults that followed their GPUs stay, whether or not they still act
    update: dict[str, Any] = {"parallel": parallel, "faults": faults, "allow_idle_faults": True,
                              "cluster": s.cluster.model_copy(update={"nodes": None})}
    if m is not None and spares:
        update["mitigation"] = m.model_copy(update={"spares": spares - 1})
    # validated anew: the re-planned job must be a scenario like any other
    return Replan(parse_scenario(scenario_to_dict(s.model_copy(update=update))), node, bool(spares))


def restart_plan(s: Scenario, rank: int, elapsed_s: float) -> Replan:
    """``s`` restarted after ``rank`` failed ``elapsed_s`` into the job: the same
    layout on repaired or replacement hardware, the failure that happened gone
    (each kind says what of it is left), the other faults in their place."""
    faults = tuple(f for f in (f.moved(lambda g: g, elapsed_s) for f in s.faults)
                   if f is not None)
    update: dict[str, Any] = {"faults": faults, "allow_idle_faults": True}
    plan = parse_scenario(scenario_to_dict(s.model_copy(update=update)))
    return Replan(plan, rank // s.cluster.gpus_per_node, True)
