"""MegaScope's perturbations acting on real tensors, each recorded exactly.

Three places: parameters when the optimizer has written them back
(``ParamInjector``), activations at a site inside the forward pass
(``perturb_activation``, called from the site hooks), and tensors a pipeline
stage receives from another (``P2PInjector``, called from the interpreter's
point-to-point path). Randomness comes from the scenario seed and the
injection's coordinates only, so a perturbation is the same on every run and
in a recomputed forward, and the training's own random streams are untouched.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from megatronapp.scenario.scope_spec import (ActMask, ActNoise, ActOffset, HeadMask, P2PNoise, P2POffset,
                                    P2PZero, ParamBitflip, ParamNoise, ParamStuck, Quantize,
                                    param_targets)

BITS_AS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
           torch.float64: torch.int64}
FP8 = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}
Record = Callable[[dict[str, Any]], None]


def seed_of(*key: int) -> int:
    """A 63-bit seed from integer coordinates (scenario seed first)."""
    state = np.random.SeedSequence([abs(int(k)) for k in key]).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31 ^ int(state[1])) & 0x7FFF_FFFF_FFFF_FFFF


def generator_for(device: torch.device, *key: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed_of(*key))


def bit_number(bit: int | str, dtype: torch.dtype) -> int:
    width = torch.finfo(dtype).bits
    number = width - 1 if bit == "sign" else int(bit)
    if not 0 <= number < width:
        raise ValueError(f"bit {bit} does not exist in {dtype} ({width} bits)")
    return number


def _bits_hex(value: int, width: int) -> str:
    return f"0x{value & ((1 << width) - 1):0{width // 4}x}"


def flip_bits(flat: torch.Tensor, indices: Sequence[int], bit: int | str) -> list[dict[str, Any]]:
    """Flip one IEEE-754 bit of ``flat[i]`` (a 1-D view of the stored tensor)
    for each ``i``, in place; returns what each element was and became."""
    width = torch.finfo(flat.dtype).bits
    number = bit_number(bit, flat.dtype)
    ints = flat.view(BITS_AS[flat.dtype])
    mask = -(1 << number) if number == width - 1 else 1 << number  # the sign bit, as signed
    out = []
    for i in indices:
        before_bits, before = int(ints[i]), float(flat[i])
        ints[i] = ints[i] ^ mask
        out.append({"index": int(i), "bit": number, "before": before, "after": float(flat[i]),
                    "before_bits": _bits_hex(before_bits, width),
                    "after_bits": _bits_hex(int(ints[i]), width)})
    return out


def quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round to the fp8 grid (saturating) or a symmetric per-tensor int8 grid;
    straight-through: gradients pass as if it were the identity."""
    if fmt == "int8":
        scale = x.detach().abs().amax() / 127.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(x.detach() / safe).clamp(-127, 127) * safe
    else:
        dtype, top = FP8[fmt]
        q = x.detach().clamp(-top, top).to(dtype).to(x.dtype)
    return x + (q - x.detach())


# ------------------------------------------------------------- activations
@dataclass(frozen=True)
class ActContext:
    """Where an activation perturbation acts: coordinates for its random draw
    and how this rank's slice of the tensor maps to global channels / heads."""

    seed: int
    index: int  # the perturbation's position in scope.perturb
    step: int
    microbatch: int
    layer: int
    dp: int
    shard: int  # tp rank for split sites, 0 for replicated ones (same draw on every rank)
    channel_offset: int = 0
    head_offset: int = 0
    head_dim: int = 0


def perturb_activation(x: torch.Tensor, p: Any, c: ActContext) -> tuple[torch.Tensor, dict]:
    """The perturbed tensor (autograd-friendly) and what was done."""
    if isinstance(p, ActNoise):
        g = generator_for(x.device, c.seed, 23, c.index, c.step, c.microbatch, c.layer, c.dp,
                          c.shard)
        noise = torch.randn(x.shape, generator=g, device=x.device, dtype=x.dtype)
        std = p.sigma * (x.detach().pow(2).mean().sqrt() if p.relative else 1.0)
        return x + noise * std, {"sigma": p.sigma, "relative": p.relative}
    if isinstance(p, ActOffset):
        return x + p.value, {"value": p.value}
    if isinstance(p, Quantize):
        return quantize(x, p.format), {"format": p.format}
    if isinstance(p, ActMask):
        local = [ch - c.channel_offset for ch in p.channels
                 if 0 <= ch - c.channel_offset < x.shape[-1]]
        keep = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
        keep[local] = 0
        return x * keep, {"channels": list(p.channels)}
    if isinstance(p, HeadMask):  # x: core attention output [s, b, local_heads * head_dim]
        keep = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
        for h in p.heads:
            head = h - c.head_offset
            if 0 <= head * c.head_dim < x.shape[-1]:
                keep[head * c.head_dim:(head + 1) * c.head_dim] = 0
        return x * keep, {"heads": list(p.heads)}
    raise TypeError(f"not an activation perturbation: {p!r}")


# -------------------------------------------------------------- parameters
@dataclass
class HeldParam:
    """One parameter (or TP slice of it) held by this rank."""

    param: torch.nn.Parameter
    partition_dim: int | None
    tp: int
    tp_rank: int

    @property
    def full_shape(self) -> tuple[int, ...]:
        shape = list(self.param.shape)
        if self.partition_dim is not None:
            shape[self.partition_dim] *= self.tp
        return tuple(shape)

    def local_indices(self, full: Sequence[int]) -> list[tuple[int, int]]:
        """(full flat index, local flat index) of the elements this rank holds."""
        shape, local_shape = self.full_shape, tuple(self.param.shape)
        out = []
        for i in full:
            multi = list(np.unravel_index(int(i), shape))
            if self.partition_dim is not None:
                d = self.partition_dim
                if multi[d] // local_shape[d] != self.tp_rank:
                    continue
                multi[d] %= local_shape[d]
            out.append((int(i), int(np.ravel_multi_index(multi, local_shape))))
        return out


@dataclass
class ParamInjector:
    """Parameter perturbations at write-back (see ``scope_spec._Param``)."""

    perturbations: list[tuple[int, Any]]  # (index in scope.perturb, a param_* perturbation)
    params: dict[str, HeldParam]
    seed: int
    rank: int
    dp_rank: int
    record: Record
    _saved: dict[int, list[tuple[torch.Tensor, torch.Tensor, Any]]] = field(default_factory=dict)

    def write_back(self, next_step: int) -> None:
        """Called when parameters for iteration ``next_step`` have been written."""
        for i, p in self.perturbations:
            if p.dp is not None and p.dp != self.dp_rank:
                continue
            if p.step == next_step or (isinstance(p, ParamStuck) and p.persistent
                                       and p.step < next_step):
                self._apply(i, p, next_step)

    def before_update(self, step: int) -> None:
        """Before iteration ``step``'s optimizer step: transient corruptions end."""
        for flat, values, index in reversed(self._saved.pop(step, [])):
            with torch.no_grad():
                flat[index] = values

    def _elements(self, i: int, p: Any, j: int, numel: int) -> list[int]:
        if p.index is not None:
            return [p.index]
        rng = np.random.default_rng([self.seed, 17, i, j])
        return sorted(int(e) for e in rng.choice(numel, size=p.count, replace=False))

    def _select(self, i: int, p: Any, j: int, held: HeldParam
                ) -> tuple[list[tuple[int, int]] | None, torch.Tensor]:
        """(full/local index pairs, or None for every element; local indices)."""
        flat = held.param.data.view(-1)
        if isinstance(p, ParamNoise) and p.index is None and p.count is None:
            return None, torch.arange(flat.numel(), device=flat.device)
        pairs = held.local_indices(self._elements(i, p, j, int(np.prod(held.full_shape))))
        return pairs, torch.tensor([loc for _, loc in pairs], dtype=torch.long,
                                   device=flat.device)

    def _apply(self, i: int, p: Any, step: int) -> None:
        for j, name in enumerate(param_targets(p)):
            held = self.params.get(name)
            if held is None:
                continue  # another pipeline stage holds it
            pairs, local = self._select(i, p, j, held)
            if local.numel() == 0:
                continue  # the other TP slice holds these elements
            flat = held.param.data.view(-1)
            if not p.persistent:
                self._saved.setdefault(step, []).append((flat, flat[local].clone(), local))
            with torch.no_grad():
                shard = held.tp_rank if held.partition_dim is not None else 0
                detail = self._corrupt((i, step, j, shard), p, flat, pairs or [], local)
            self.record({"kind": p.kind, "perturbation": i, "rank": self.rank, "step": step,
                         "param": name, "persistent": p.persistent, **detail})

    def _corrupt(self, where: tuple[int, ...], p: Any, flat: torch.Tensor,
                 pairs: list[tuple[int, int]], local: torch.Tensor) -> dict[str, Any]:
        """``where``: (perturbation, step, target, TP slice) keys the noise draw,
        so TP replicas of a parameter draw alike and slices differently."""
        if isinstance(p, ParamBitflip):
            flips = flip_bits(flat, [loc for _, loc in pairs], p.bit)
            for f, (full, _) in zip(flips, pairs):
                f["index"] = full  # report the index in the whole tensor
            return {"elements": flips}
        if isinstance(p, ParamStuck):
            before = flat[local].tolist()
            flat[local] = p.value
            return {"elements": [{"index": full, "before": b, "after": float(flat[loc])}
                                 for (full, loc), b in zip(pairs, before)]}
        g = generator_for(flat.device, self.seed, 19, *where)
        old = flat[local].clone()
        flat[local] = old * (1 + p.sigma * torch.randn(old.shape, generator=g,
                                                       device=old.device, dtype=old.dtype))
        change = float((flat[local] - old).norm() / old.norm().clamp_min(1e-30))
        return {"sigma": p.sigma, "elements": int(local.numel()), "relative_change": change}


# ------------------------------------------------------------ point to point
@dataclass
class P2PInjector:
    """Corrupts what a stage receives (forward activations or backward gradients)."""

    perturbations: list[tuple[int, Any]]  # (index in scope.perturb, a p2p_* perturbation)
    seed: int
    rank: int
    record: Record

    def on_receive(self, tag: Any, meta: Any, peer: int, tensor: torch.Tensor) -> None:
        """``tag`` = (phase "F"/"B", microbatch, receiving virtual stage)."""
        if not (isinstance(tag, tuple) and len(tag) == 3 and tag[0] in ("F", "B")):
            return
        phase, microbatch, stage = tag
        direction = "forward" if phase == "F" else "backward"
        step = int(meta.get("iteration", 0))
        for i, p in self.perturbations:
            if (p.direction == direction and p.active(step, microbatch)
                    and p.stage in (None, stage)):
                detail = self._corrupt(i, p, step, microbatch, stage, tensor)
                self.record({"kind": p.kind, "perturbation": i, "rank": self.rank, "step": step,
                             "microbatch": microbatch, "stage": stage, "direction": direction,
                             "peer": peer, **detail})

    def _corrupt(self, i: int, p: Any, step: int, microbatch: int, stage: int,
                 tensor: torch.Tensor) -> dict[str, Any]:
        with torch.no_grad():
            if isinstance(p, P2POffset):
                tensor.add_(p.value)
                return {"value": p.value}
            if isinstance(p, P2PZero):
                tensor.zero_()
                return {}
            g = generator_for(tensor.device, self.seed, 29, i, step, microbatch, stage)
            if isinstance(p, P2PNoise):
                tensor.add_(torch.randn(tensor.shape, generator=g, device=tensor.device,
                                        dtype=tensor.dtype), alpha=p.sigma)
                return {"sigma": p.sigma}
            flat = tensor.view(-1)
            picks = torch.randperm(flat.numel(), generator=g, device=flat.device)[:p.count]
            return {"elements": flip_bits(flat, sorted(picks.tolist()), p.bit)}
