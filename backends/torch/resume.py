"""Mid-run checkpoints of a torch job, and resuming from one.

Every ``checkpoint_every`` iterations the first data-parallel replica's ranks
each save their stage (weights by full-model name, optimizer state, the CPU
random state) as ``RUN_DIR/checkpoints/iter_NNNNNNN/pp{P}_tp{T}.pt``: the
replicas hold identical weights and optimizer state, so one copy per
(pipeline, tensor) coordinate is the whole job, and a job with any dp (same
tp and pp) loads it. The data continues where it was because a sample is
chosen by the job's iteration number (``TrainOptions.first_iteration``).

A shard is written to a temporary name and renamed: a reader never sees half
of one. Loading reads tensors only (``weights_only``): nothing in the file runs.
"""
from __future__ import annotations

import os
from contextlib import suppress
from pathlib import Path
from typing import Any

import torch

from megatronapp.io import gate
from megatronapp.errors import UserError
from megatronapp.io.outdirs import discard, rename_fresh

CHECKPOINTS = "checkpoints"


def shard_path(workdir: str | Path, iteration: int, pp: int, tp: int) -> Path:
    """The shard of stage (``pp``, ``tp``) after ``iteration`` iterations."""
    return Path(workdir) / CHECKPOINTS / f"iter_{iteration:07d}" / f"pp{pp}_tp{tp}.pt"


def save_shard(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` whole or not at all (temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    torch.save(state, partial)
    rename_fresh(partial, path)  # each iteration's shard has a name of its own


def drop_shard(path: Path) -> None:
    """Remove an older shard (a restart needs only the latest); the last stage
    to drop its shard removes the iteration's folder. Through the writer's
    ``discard``: only inside the run's own (marked) folder."""
    discard(path)
    with suppress(OSError):  # another stage dropped the folder first
        if not any(path.parent.iterdir()):  # another stage's shard is still there
            discard(path.parent)


def load_shard(path: Path, iteration: int) -> dict[str, Any]:
    """A shard saved after ``iteration`` iterations; one line if it is missing or not one."""
    if not path.is_file():
        raise UserError(f"checkpoint: {path} not found (no checkpoint after iteration "
                        f"{iteration} for this stage)")
    try:
        state: dict[str, Any] = torch.load(gate.checked(path, "checkpoint"), map_location="cpu",
                                           weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError) as err:  # an InputError too
        raise UserError(f"checkpoint: {path}: not a checkpoint shard ({err})") from None
    if not isinstance(state, dict) or state.get("iteration") != iteration:
        raise UserError(f"checkpoint: {path}: does not hold the state after iteration {iteration}")
    return state
