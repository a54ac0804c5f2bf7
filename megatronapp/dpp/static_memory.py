"""Whether a static schedule's activations fit its GPUs, checked before the run:
peak memory per pipeline stage and, when it does not fit, the Megatron options
that would make it fit (MegaDPP's memory model applied to static orders)."""
from __future__ import annotations

from ..costs.memory import RankMemory, rank_memory
from ..costs.per_op import stage_costs
from ..program.layout import topology_of
from ..program.ranks import static_orders
from ..scenario.config import Scenario
from .memory import BUFFERS, GB, MemoryExceeded, order_peak_slots


def stage_memory(s: Scenario) -> dict[int, RankMemory]:
    """pp rank -> peak memory of one of its ranks under a static schedule."""
    # A static schedule keeps one message of each kind in flight; received
    # inputs kept for backward are counted in the activations.
    buffers = BUFFERS * stage_costs(s).activation_bytes
    return {pp: rank_memory(s, pp, order_peak_slots(order), buffers)
            for pp, order in static_orders(s).items()}


def static_peaks(s: Scenario) -> dict[int, float]:
    return {pp: m.total for pp, m in stage_memory(s).items()}


def check_memory(s: Scenario) -> None:
    """A static schedule whose activations would not fit fails before it runs,
    naming the Megatron options that would make it fit."""
    topo = topology_of(s)
    capacity = int(s.cluster.gpu.memory_gb * GB)
    first_rank = {topo.coord(r).pp: r for r in reversed(range(topo.world_size))}
    for pp, peak in sorted(static_peaks(s).items()):
        if peak > capacity:
            raise MemoryExceeded(s.schedule, first_rank[pp], pp, int(peak), capacity,
                                 memory_hint(s))


# Options that cut memory, in the order Megatron users usually reach for them.
MEMORY_OPTIONS: tuple[tuple[str, str, object], ...] = (
    ("parallel", "sequence_parallel", True),
    ("training", "recompute", "selective"),
    ("training", "distributed_optimizer", True),
    ("training", "recompute", "full"),
)


def _with_option(s: Scenario, section: str, key: str, value: object) -> Scenario | None:
    """``s`` with one option set, or None when it is already set or does nothing."""
    part = getattr(s, section)
    if getattr(part, key) == value or (key == "recompute" and part.recompute == "full"):
        return None
    if (key == "sequence_parallel" and s.parallel.tp == 1) or (
            key == "distributed_optimizer" and s.parallel.dp == 1):
        return None
    return s.model_copy(update={section: part.model_copy(update={key: value})})


def _fits(s: Scenario) -> float | None:
    peak = max(static_peaks(s).values())
    return peak if peak <= s.cluster.gpu.memory_gb * 1e9 else None


def memory_hint(s: Scenario) -> str:
    """Which option alone (else which options together) would make ``s`` fit."""
    alone = []
    for section, key, value in MEMORY_OPTIONS:
        variant = _with_option(s, section, key, value)
        peak = _fits(variant) if variant is not None else None
        if peak is not None:
            alone.append(f"{section}.{key}: {str(value).lower()} ({peak / 1e9:.2f} GB)")
    if alone:
        return "it fits with " + " or with ".join(alone)
    combined, names = s, []
    for section, key, value in MEMORY_OPTIONS:
        variant = _with_option(combined, section, key, value)
        if variant is None:
            continue
        combined = variant
        names.append(f"{section}.{key}: {str(value).lower()}")
        peak = _fits(combined)
        if peak is not None:
            return f"it fits with {' and '.join(names)} ({peak / 1e9:.2f} GB)"
    return "no Megatron memory option makes it fit; add pipeline or tensor parallelism"
