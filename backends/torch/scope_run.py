"""What a torch run leaves besides its trace: a MegaScope capture and a checkpoint.

Each rank writes its own parts into the run's work directory (capture parts
under ``scope/parts/rank{r}``, its parameters under ``checkpoint/parts``);
once every rank is done, ``finalize`` merges them into ``scope/`` (one
capture, see ``megatronapp.scope.storage``) and ``checkpoint/`` (the full
model, see ``megatronapp.scenario.checkpoint``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from megatronapp.scenario.checkpoint import write_checkpoint
from megatronapp.scenario.config import Scenario, scenario_to_dict
from megatronapp.program.layout import topology_of
from megatronapp.io.outdirs import discard, own_folder
from megatronapp.scope.cost import model_shape
from megatronapp.scope.storage import merge_capture
from megatronapp.trace.sections import ScopeCapture

from .scope import RankPlace, ScopeSession, session_for
from .stages import MegatronStages, merge_tp_shards, partition_dim_of


def attach_session(s: Scenario, stages: MegatronStages, rank: int, workdir: str | None
                   ) -> ScopeSession | None:
    """Hook the rank's model chunks (no ``scope:`` or no work directory: None)."""
    if s.scope is None or workdir is None:
        return None
    coord = topology_of(s).coord(rank)
    place = RankPlace(rank, s.parallel.tp, coord.tp, coord.dp, stages.device)
    session = session_for(s.scope, model_shape(s), s.seed, place, Path(workdir) / "scope")
    for model in stages.models:
        session.attach(model, stages.named, partition_dim_of)
    session.start()
    stages.scope = session
    return session


def save_shard(s: Scenario, stages: MegatronStages, rank: int, workdir: str | None) -> None:
    """This rank's parameters (data-parallel replica 0 only), for the checkpoint."""
    if not s.training.checkpoint or workdir is None or stages.coord.dp != 0:
        return
    from safetensors.numpy import save_file

    parts = own_folder(Path(workdir) / "checkpoint" / "parts")
    save_file({n: p.detach().cpu().numpy() for n, p in stages.named},
              str(parts / f"rank{rank}.safetensors"))
    (parts / f"rank{rank}.json").write_text(json.dumps(
        {"tp_rank": stages.coord.tp, "partition_dim": {n: partition_dim_of(p)
                                                       for n, p in stages.named}}))


def _merge_checkpoint(s: Scenario, parts: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    shards: dict[str, dict[int, np.ndarray]] = {}
    dims: dict[str, int | None] = {}
    for meta_file in sorted(parts.glob("rank*.json")):
        meta = json.loads(meta_file.read_text())
        for name, array in load_file(str(meta_file.with_suffix(".safetensors"))).items():
            shards.setdefault(name, {})[meta["tp_rank"]] = array
            dims[name] = meta["partition_dim"][name]
    return {n: merge_tp_shards([by_tp[t] for t in sorted(by_tp)], dims[n])
            for n, by_tp in shards.items()}


def capture_manifest(s: Scenario, source: str) -> dict[str, Any]:
    scope = s.scope.model_dump(mode="json") if s.scope is not None else {}
    return {"source": source, "scenario": s.name, "seed": s.seed,
            "model": s.model.model_dump(mode="json"),
            "parallel": s.parallel.model_dump(mode="json"),
            "observe": scope.get("observe", []), "perturb": scope.get("perturb", [])}


def finalize(s: Scenario, workdir: Path, losses: Sequence[float]
             ) -> tuple[ScopeCapture | None, str | None]:
    """Merge the ranks' parts; what the run's summary says about them: the
    capture, and the checkpoint's folder."""
    capture, checkpoint = None, None
    if (workdir / "scope").is_dir():
        manifest = merge_capture(workdir / "scope", capture_manifest(s, "train"))
        capture = ScopeCapture(**{k: manifest[k] for k in ("rows", "raw_tensors", "injections",
                                                           "dropped_records", "incomplete_rows")},
                               capture_dir="scope")
    parts = workdir / "checkpoint" / "parts"
    if parts.is_dir():
        state = _merge_checkpoint(s, parts)
        discard(parts)  # marked as ours when the ranks wrote into it
        write_checkpoint(workdir / "checkpoint", state, s.model, s.data,
                         {"scenario": scenario_to_dict(s), "iterations": s.iterations,
                          "final_loss": losses[-1] if losses else None})
        checkpoint = "checkpoint"
    return capture, checkpoint
