"""Pipeline schedules as traversal orders over the (chunk, microbatch) task matrix.

A schedule is data: for each pipeline rank, the ordered list of tasks it runs
in one iteration. The rank program (``programs.py``) walks whatever order it is
given, so a dynamic scheduler only has to produce a different order (or pick
tasks on the fly through the same ``Task`` vocabulary).

Virtual stage numbering follows Megatron: chunk ``c`` on pipeline rank ``r``
holds virtual stage ``c * P + r``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

# Every schedule a scenario may name ("adaptive" picks tasks at run time: dpp/).
SCHEDULES = ("gpipe", "1f1b", "interleaved", "dfc", "bfc", "adaptive")
Phase = Literal["F", "B"]


@dataclass(frozen=True, slots=True, order=True)
class Task:
    phase: Phase
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.phase}{self.microbatch}.{self.chunk}"

    @classmethod
    def parse(cls, text: str) -> "Task":
        phase, rest = text[0], text[1:]
        mb, _, chunk = rest.partition(".")
        if phase not in "FB" or not mb.isdigit():
            raise ValueError(f"not a task: {text!r}")
        return cls(phase, int(mb), int(chunk or 0))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class PipeShape:
    """Pipeline size P, chunks per rank V, microbatches M."""

    pp: int
    vpp: int
    microbatches: int

    def virtual_stage(self, pp_rank: int, chunk: int) -> int:
        return chunk * self.pp + pp_rank

    def locate(self, virtual_stage: int) -> tuple[int, int]:
        """(pp_rank, chunk) holding a virtual stage."""
        return virtual_stage % self.pp, virtual_stage // self.pp

    @property
    def num_virtual_stages(self) -> int:
        return self.pp * self.vpp

    def is_first(self, pp_rank: int, chunk: int) -> bool:
        return self.virtual_stage(pp_rank, chunk) == 0

    def is_last(self, pp_rank: int, chunk: int) -> bool:
        return self.virtual_stage(pp_rank, chunk) == self.num_virtual_stages - 1


Order = list[Task]


def gpipe_order(pp_rank: int, shape: PipeShape) -> Order:
    m = shape.microbatches
    return [Task("F", i) for i in range(m)] + [Task("B", i) for i in range(m)]


def one_f_one_b_order(pp_rank: int, shape: PipeShape) -> Order:
    m = shape.microbatches
    warmup = min(shape.pp - pp_rank - 1, m)
    order = [Task("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Task("F", warmup + i), Task("B", i)]
    order += [Task("B", i) for i in range(m - warmup, m)]
    return order


def schedule_table(microbatches: int, chunks: int, group_size: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) visit order: groups of ``group_size`` microbatches go
    through every chunk before the next group starts (Megatron's table)."""
    table: list[tuple[int, int]] = []
    for first in range(0, microbatches, group_size):
        group = range(first, min(first + group_size, microbatches))
        table += [(mb, c) for c in range(chunks) for mb in group]
    return table


def interleaved_order(pp_rank: int, shape: PipeShape, group_size: int | None = None) -> Order:
    """Megatron's interleaved 1F1B: warm-up forwards, 1F1B steady state, cool-down.

    ``group_size`` = pp gives depth-first traversal (Megatron's default);
    ``group_size`` = microbatches gives breadth-first traversal.
    """
    p, v, m = shape.pp, shape.vpp, shape.microbatches
    g = group_size or p
    table = schedule_table(m, v, g)
    total = m * v
    warmup = min((p - pp_rank - 1) * 2 + (v - 1) * g, total)

    def fwd(k: int) -> Task:
        mb, c = table[k]
        return Task("F", mb, c)

    def bwd(k: int) -> Task:
        mb, c = table[k]
        return Task("B", mb, v - 1 - c)

    order = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [fwd(k + warmup), bwd(k)]
    order += [bwd(k) for k in range(total - warmup, total)]
    return order


ORDERS: dict[str, Callable[..., Order]] = {
    "gpipe": gpipe_order,
    "1f1b": one_f_one_b_order,
    "interleaved": interleaved_order,
    "dfc": lambda r, s, g=None: interleaved_order(r, s, s.pp),
    "bfc": lambda r, s, g=None: interleaved_order(r, s, s.microbatches),
}


def static_order(schedule: str, pp_rank: int, shape: PipeShape, group_size: int | None = None) -> Order:
    if schedule not in ORDERS:
        raise ValueError(f"{schedule!r} is not a static schedule")
    if schedule in ("gpipe", "1f1b"):
        return ORDERS[schedule](pp_rank, shape)
    return ORDERS[schedule](pp_rank, shape, group_size)


def format_orders(orders: dict[int, Order]) -> str:
    """One line per pipeline rank, tasks printed like ``F3.1``."""
    return "\n".join(f"{r}: " + " ".join(map(str, o)) for r, o in sorted(orders.items()))


def check_order(order: Order, shape: PipeShape) -> None:
    """Each (phase, microbatch, chunk) exactly once; each B after its F."""
    seen: set[Task] = set()
    for t in order:
        if t in seen:
            raise ValueError(f"task {t} appears twice")
        if t.phase == "B" and Task("F", t.microbatch, t.chunk) not in seen:
            raise ValueError(f"task {t} runs before its forward")
        seen.add(t)
    phases: tuple[Phase, ...] = ("F", "B")
    expected = {Task(ph, mb, c) for ph in phases for mb in range(shape.microbatches)
                for c in range(shape.vpp)}
    if seen != expected:
        raise ValueError(f"order misses tasks {sorted(expected - seen)[:5]}")
