"""MegaScope's analyses on a checkpoint split over pipeline stages and
tensor-parallel ranks: one process per rank (the training launcher's), each
building its own stage of the checkpoint's model.

Every rank runs the same analysis function on a ``StagedModel`` (the
``LoadedModel`` interface): a forward pass goes stage to stage through
point-to-point sends, each stage reading (or patching) the sites of its own
layers and TP ranks their own heads or channels; what each rank read is then
shared with every rank (``all_gather_object``), so the analysis goes on with
whole tensors and every rank takes the same decisions. A patch of the
residual stream entering a stage's first layer acts on the tensor the stage
receives, where MegaScope's point-to-point perturbations act.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from megatronapp.errors import UserError
from megatronapp.parallel.topology import Coord, Topology
from megatronapp.scenario.checkpoint import read_checkpoint
from megatronapp.scenario.config import Scenario, ScenarioError, parse_scenario
from megatronapp.scenario.scope_spec import SITES

from .scope import ACCESS
from .scope_cache import POSITION_AXIS, LoadedModel, Patch, checkpoint_dir, position_index
from .scope_generate import one_rank

T = TypeVar("T")
Analysis = Callable[[LoadedModel], T]
_HEAD_AXIS = {"sbnh": 2, "bnsk": 1}  # of a site's tensor, by layout


def analysis_scenario(target: str | Path, pp: int, tp: int) -> Scenario:
    """The checkpoint's model split ``pp`` × ``tp`` (checked like a scenario's
    ``parallel:``, named by the options that set it)."""
    ckpt = read_checkpoint(checkpoint_dir(target))
    try:
        return parse_scenario({"seed": 0, "model": ckpt.model.model_dump(mode="json"),
                               "data": {"kind": "random"},
                               "parallel": {"tp": tp, "pp": pp, "dp": 1, "microbatches": 1}})
    except ScenarioError as err:
        raise UserError(f"--pp/--tp: {err}") from None


def run_analysis(target: str | Path, analysis: Analysis[T], pp: int = 1, tp: int = 1) -> T:
    """``analysis`` on the checkpoint's model: in this process for one stage
    and one TP rank, else on ``pp * tp`` spawned ranks (rank 0's answer)."""
    if pp < 1 or tp < 1:
        raise UserError(f"--pp/--tp: must be >= 1, got pp {pp}, tp {tp}")
    if pp == tp == 1:
        with one_rank():
            return analysis(LoadedModel.load(target))
    from .launch import spawn_run
    from .worker import Job, world_size_of

    s = analysis_scenario(target, pp, tp)
    job = Job(world_size_of, functools.partial(_analysis_rank, str(target), analysis),
              _first, _no_programs)
    _, results = spawn_run(s, job=job)
    answer: Any = results[0]
    if isinstance(answer, _Refused):
        raise UserError(answer.message)
    return answer


@dataclass(frozen=True)
class _Refused:
    """A UserError raised inside the ranks, said once by the launcher."""

    message: str


def _first(s: Scenario, results: Sequence[Any]) -> Any:
    return results[0]


def _no_programs(s: Scenario, stages: Any) -> dict[int, Any]:
    return {}  # the analysis drives the stages itself


def _analysis_rank(target: str, analysis: Analysis[Any], s: Scenario, rank: int,
                   local_rank: int, *_args: Any, **_kwargs: Any) -> Any:
    """One rank: its stage of the checkpoint, the analysis, rank 0's answer."""
    from megatron.core import parallel_state

    from .worker import device_for, init_megatron

    init_megatron(s)
    try:
        model = StagedModel.build(target, s, rank, device_for(local_rank))
        try:
            answer = analysis(model)
        except UserError as err:
            answer = _Refused(str(err))
        dist.barrier()
    finally:
        parallel_state.destroy_model_parallel()
    return answer if rank == 0 else None


@dataclass
class StagedModel(LoadedModel):
    """This rank's stage (and TP slice) of a checkpoint's model; every call
    is collective: all ranks make it with the same arguments."""

    topo: Topology = Topology()
    coord: Coord = Coord(0, 0, 0)
    device: torch.device = torch.device("cpu")

    @classmethod
    def build(cls, target: str | Path, s: Scenario, rank: int,
              device: torch.device) -> "StagedModel":
        from .stages import MegatronStages, TrainOptions

        ckpt = read_checkpoint(checkpoint_dir(target))
        stages = MegatronStages(s, rank, device, TrainOptions(initial_state=ckpt.state))
        return cls(ckpt, stages.models[0].eval(), stages.topo, stages.coord, device)

    @property
    def first(self) -> bool:
        return self.coord.pp == 0

    @property
    def last(self) -> bool:
        return self.coord.pp == self.topo.pp - 1

    def _neighbour(self, delta: int) -> int:
        return self.topo.rank(0, self.coord.pp + delta, self.coord.tp)

    def forward(self, ids: list[int], sites: Sequence[str] = (), patch: Patch | None = None
                ) -> tuple[np.ndarray, dict[tuple[str, int], torch.Tensor]]:
        from .megatron_compat import causal_mask

        patch = self._local_patch(patch)
        if not self.first:
            received = torch.empty(len(ids), 1, self.ckpt.model.hidden, device=self.device)
            dist.recv(received, src=self._neighbour(-1))
            patch = self._on_receive(received, patch)
            self.model.set_input_tensor(received)
        seen: dict[tuple[str, int], torch.Tensor] = {}
        with self._hooks(sites, seen, patch), torch.no_grad():
            out = self.model(torch.tensor([ids], device=self.device),
                             torch.arange(len(ids), device=self.device)[None],
                             causal_mask(len(ids), self.device))
        if not self.last:
            dist.send(out.contiguous(), dst=self._neighbour(1))
        logits = self._vocab_whole(out[0] if self.last else None)
        whole = {k: v for split in ("replicated", "heads", "channels")
                 for k, v in self.shared({k: v for k, v in seen.items()
                                          if SITES[k[0]].split == split}, split).items()}
        return logits, whole

    def _on_receive(self, received: torch.Tensor, patch: Patch | None) -> Patch | None:
        """A patch of the residual stream entering this stage's first layer
        is put into the tensor received from the previous stage."""
        first_layer = int(self.model.decoder.layers[0].layer_number)
        if patch is None or (patch.site, patch.layer) != ("resid_pre", first_layer):
            return patch
        received[position_index(received, "sbh", patch.position)] = patch.value
        return None

    def _local_patch(self, patch: Patch | None) -> Patch | None:
        """The patch's value cut to this TP rank's heads or channels."""
        if patch is None or self.topo.tp == 1 or SITES[patch.site].split == "replicated":
            return patch
        layout = ACCESS[patch.site].layout
        axis = patch.value.dim() - 1  # channels
        if SITES[patch.site].split == "heads":  # the value has lost its position axis
            axis = _HEAD_AXIS[layout] - (POSITION_AXIS[layout] < _HEAD_AXIS[layout])
        part = patch.value.chunk(self.topo.tp, dim=axis)[self.coord.tp]
        return Patch(patch.site, patch.layer, patch.position, part)

    def shared(self, local: dict[Any, torch.Tensor], split: str,
               head_axis: int = 0) -> dict[Any, torch.Tensor]:
        """Every rank's ``local`` tensors, whole on every rank: TP slices
        joined in TP order (``split`` "heads" along each tensor's head axis,
        ``head_axis`` or its layout's; "channels" along the last), replicated
        tensors from TP rank 0."""
        held: list[Any] = [None] * self.topo.world_size
        dist.all_gather_object(held, (self.coord.tp, {k: v.cpu() for k, v in local.items()}))
        parts: dict[Any, list[tuple[int, torch.Tensor]]] = {}
        for tp_rank, tensors in held:
            for key, value in tensors.items():
                parts.setdefault(key, []).append((tp_rank, value))
        return {key: _joined(key, sorted(p, key=lambda x: x[0]), split, head_axis)
                for key, p in parts.items()}

    def _vocab_whole(self, local: torch.Tensor | None) -> np.ndarray:
        """Logits (tokens, vocab) from the last stage's TP ranks (each holds a
        slice of the vocabulary), on every rank."""
        shared = self.shared({"logits": local} if local is not None else {}, "channels")
        return shared["logits"].double().numpy()

    def final_logits(self, resid: torch.Tensor) -> np.ndarray:
        local = None
        if self.last:
            with torch.no_grad():
                x = self.model.decoder.final_layernorm(resid[:, None, :].float().to(self.device))
                local = self.model.output_layer(x)[0][:, 0]
        return self._vocab_whole(local)


def _joined(key: Any, parts: list[tuple[int, torch.Tensor]], split: str,
            head_axis: int) -> torch.Tensor:
    if split == "replicated" or len(parts) == 1:
        return parts[0][1]
    if split == "heads":
        axis = _HEAD_AXIS[ACCESS[key[0]].layout] if isinstance(key, tuple) else head_axis
        return torch.cat([t for _, t in parts], dim=axis)
    return torch.cat([t for _, t in parts], dim=-1)
