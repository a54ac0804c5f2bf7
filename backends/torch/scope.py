"""MegaScope on the torch backend: PyTorch hooks on megatron-core's own modules.

``ScopeSession`` attaches forward (pre-)hooks to each decoder layer's modules
(never editing the model), and per observed site and layer it

1. applies the activation perturbations that are due (the perturbed tensor is
   what flows on, and what is observed);
2. in a forward task, reduces the selected slice to the requested statistics
   on the device (``megatronapp.scope.stats``) and keeps it as a pending
   record, plus a detached copy when ``keep_raw`` asks;
3. registers a gradient hook on the tensor that flows, for ``grad:<site>``.

The stages tell the session which task runs (``task``): a forward hook
firing inside a backward task is activation recomputation, which neither
captures nor records again (its perturbation is re-applied identically, its
draw being keyed by coordinates). ``capture_handoff`` passes a task's
records to the writer (``scope_writer``). Layers are numbered globally
(megatron's ``layer_number``); tensor-parallel ranks capture their own heads
or channel slices, TP rank 0 the replicated tensors.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from megatronapp.scope import stats
from megatronapp.scope.cost import local_heads
from megatronapp.scope.storage import PartWriter, RecordKey, Rows
from megatronapp.scenario.scope_spec import (GRAD_PREFIX, P2P_KINDS, PARAM_GRADS, PARAM_KINDS, SITES,
                                    HeadMask, ModelShape, Observe, Scope, base_site,
                                    channels_of, site_layer)

from .scope_perturb import ActContext, HeldParam, P2PInjector, ParamInjector, perturb_activation
from .scope_writer import AsyncWriter, DeviceBatch, DeviceRaw, DeviceRecord, SyncWriter

Tensor = torch.Tensor


# ------------------------------------------------------------ site access
@dataclass(frozen=True)
class SiteAccess:
    """How a site is reached from its decoder layer (or the model, for logits):
    the module, the hook kind, the tensor's layout, and how to read the value
    (plus the tensor that carries its gradient) and put a perturbed one back."""

    module: Callable[[Any], Any]
    pre: bool
    layout: str  # "sbh" [s, b, C] | "sbnh" [s, b, heads, head_dim] | "bnsk" [b, heads, q, k]
    get: Callable[[tuple, dict, Any], tuple[Tensor, Tensor]]
    put: Callable[[tuple, dict, Any, Tensor], Any]


def _positional(i: int) -> tuple[Callable, Callable]:
    return (lambda a, kw, out: (a[i], a[i]),
            lambda a, kw, out, new: ((*a[:i], new, *a[i + 1:]), kw))


def _layer_input() -> tuple[Callable, Callable]:
    def get(a: tuple, kw: dict, out: Any) -> tuple[Tensor, Tensor]:
        x = kw["hidden_states"] if "hidden_states" in kw else a[0]
        return x, x

    def put(a: tuple, kw: dict, out: Any, new: Tensor) -> Any:
        if "hidden_states" in kw:
            return a, {**kw, "hidden_states": new}
        return (new, *a[1:]), kw
    return get, put


def _with_bias() -> tuple[Callable, Callable]:
    """(output, bias) pairs: the site is output + bias; a perturbed value goes
    back as (value, None) (megatron adds a bias only when there is one)."""
    def get(a: tuple, kw: dict, out: Any) -> tuple[Tensor, Tensor]:
        value = out[0] if out[1] is None else out[0] + out[1]
        return value, out[0]
    return get, lambda a, kw, out, new: (new, None)


def _first_output() -> tuple[Callable, Callable]:
    return (lambda a, kw, out: (out[0], out[0]),
            lambda a, kw, out, new: (new, *out[1:]))


def _whole_output() -> tuple[Callable, Callable]:
    return lambda a, kw, out: (out, out), lambda a, kw, out, new: new


ACCESS: dict[str, SiteAccess] = {
    "resid_pre": SiteAccess(lambda l: l, True, "sbh", *_layer_input()),
    "attn.q": SiteAccess(lambda l: l.self_attention.core_attention, True, "sbnh", *_positional(0)),
    "attn.k": SiteAccess(lambda l: l.self_attention.core_attention, True, "sbnh", *_positional(1)),
    "attn.v": SiteAccess(lambda l: l.self_attention.core_attention, True, "sbnh", *_positional(2)),
    "attn.probs": SiteAccess(lambda l: l.self_attention.core_attention.scale_mask_softmax, False,
                             "bnsk", *_whole_output()),
    "attn.out": SiteAccess(lambda l: l.self_attention, False, "sbh", *_with_bias()),
    "resid_mid": SiteAccess(lambda l: l.pre_mlp_layernorm, True, "sbh", *_positional(0)),
    "mlp.pre": SiteAccess(lambda l: l.mlp.linear_fc1, False, "sbh", *_with_bias()),
    "mlp.post": SiteAccess(lambda l: l.mlp.linear_fc2, True, "sbh", *_positional(0)),
    "mlp.out": SiteAccess(lambda l: l.mlp, False, "sbh", *_with_bias()),
    "resid_post": SiteAccess(lambda l: l, False, "sbh", *_first_output()),
    "logits": SiteAccess(lambda m: m.output_layer, False, "sbh", *_first_output()),
}
HEAD_MASK = SiteAccess(lambda l: l.self_attention.core_attention, False, "sb(nh)",
                       *_whole_output())
if set(ACCESS) != set(SITES):  # the schema's sites and the hooks are one list
    raise RuntimeError(f"site registry mismatch: {sorted(set(ACCESS) ^ set(SITES))}")


def attention_materialised(layer: Any) -> bool:
    """attn.probs exists only where the attention implementation computes it
    (megatron's DotProductAttention does; fused kernels never do)."""
    core = layer.self_attention.core_attention
    return hasattr(core, "scale_mask_softmax")


# ----------------------------------------------------------------- places
@dataclass(frozen=True)
class RankPlace:
    rank: int
    tp: int
    tp_rank: int
    dp_rank: int
    device: torch.device


@dataclass
class TaskState:
    """The task the stages are running: a forward hook captures in "forward"."""

    phase: str = "idle"  # forward | backward | idle
    step: int = 0
    microbatch: int = 0


@dataclass(frozen=True)
class Selected:
    """A slice reduced row by row, and what its rows and dimensions mean."""

    rows2d: Tensor
    rows: Rows
    raw: Tensor
    dims: tuple[str, ...]
    tokens: list[int]
    heads: list[int] | None
    query_pos: Tensor | None


class ScopeSession:
    """One rank's observations and perturbations (see the module docstring)."""

    def __init__(self, scope: Scope, shape: ModelShape, seed: int, place: RankPlace,
                 sink: AsyncWriter | SyncWriter):
        self.scope, self.shape, self.seed, self.place, self.sink = scope, shape, seed, place, sink
        self.state = TaskState()
        self.injections: list[dict[str, Any]] = []
        self._pending = DeviceBatch()
        self._handles: list[Any] = []
        self._index_cache: dict[tuple[Any, ...], Tensor] = {}
        self._row_cache: dict[tuple[Any, ...], tuple[Rows, Tensor | None]] = {}
        self._observers: dict[tuple[str, int], list[Observe]] = {}
        for obs in scope.observe:
            if obs.site != PARAM_GRADS:
                for layer in self._layers(obs.site, obs.layers):
                    self._observers.setdefault((obs.site, layer), []).append(obs)
        self.params: ParamInjector | None = None
        self.p2p = P2PInjector([(i, p) for i, p in enumerate(scope.perturb) if p.kind in P2P_KINDS],
                               seed, place.rank, self._record)
        self.unmaterialised: list[str] = []
        self.recomputed_hooks = 0  # site hooks that fired inside a backward task

    # ------------------------------------------------------------ control
    @contextmanager
    def task(self, phase: str, step: int, microbatch: int) -> Iterator[None]:
        self.state = TaskState(phase, step, microbatch)
        try:
            yield
        finally:
            self.state = TaskState("idle", step, microbatch)

    def capture_handoff(self) -> None:
        """Hand this task's records to the writer (the ``scope_capture`` op)."""
        if self._pending.records or self._pending.raws:
            batch, self._pending = self._pending, DeviceBatch()
            self.sink.submit(batch)

    def close(self) -> None:
        self.capture_handoff()
        for h in self._handles:
            h.remove()
        self.sink.close(self.injections, sorted(set(self.unmaterialised)),
                        recomputed_hooks=self.recomputed_hooks)

    def _record(self, injection: dict[str, Any]) -> None:
        self.injections.append({**injection, "order": len(self.injections)})

    # ------------------------------------------------------------- attach
    def attach(self, model: Any, named: list[tuple[str, torch.nn.Parameter]],
               partition_dim: Callable[[torch.nn.Parameter], int | None]) -> None:
        """Hook every observed or perturbed site of ``model``'s layers; register
        its parameters for parameter perturbations (applied now for step 0)."""
        sites = self._hooked_sites()
        for layer in model.decoder.layers:
            number = int(layer.layer_number)
            for site in sites - {"logits"}:
                if site == "attn.probs" and not attention_materialised(layer):
                    self.unmaterialised.append(f"layer {number}: the attention implementation "
                                               "does not materialise its probabilities")
                    continue
                self._hook(ACCESS[site], layer, site, number)
            if self._head_masks(number):
                self._hook(HEAD_MASK, layer, "head_mask", number)
        if getattr(model, "post_process", False) and "logits" in sites:
            self._hook(ACCESS["logits"], model, "logits", self.shape.layers)
        self._attach_params(named, partition_dim)

    def _hooked_sites(self) -> set[str]:
        sites = {base_site(s) for s, _ in self._observers}
        sites |= {p.site for p in self.scope.perturb if hasattr(p, "site")}
        return sites

    def _attach_params(self, named: list[tuple[str, torch.nn.Parameter]],
                       partition_dim: Callable[[torch.nn.Parameter], int | None]) -> None:
        held = {n: HeldParam(p, partition_dim(p), self.place.tp, self.place.tp_rank)
                for n, p in named}
        self.named_params = held
        chosen = [(i, p) for i, p in enumerate(self.scope.perturb) if p.kind in PARAM_KINDS]
        if chosen:
            if self.params is None:
                self.params = ParamInjector(chosen, {}, self.seed, self.place.rank,
                                            self.place.dp_rank, self._record)
            self.params.params.update(held)

    def start(self) -> None:
        """Parameters are loaded: perturbations due at step 0 act now."""
        if self.params is not None:
            self.params.write_back(0)

    def _layers(self, site: str, layers: Any) -> tuple[int, ...]:
        """Layers a site is hooked at; logits, after the last layer, ignore ``layers``."""
        if base_site(site) == "logits":
            return (self.shape.layers,)
        return tuple(range(1, self.shape.layers + 1)) if layers == "all" else tuple(layers)

    def _head_masks(self, layer: int) -> list[tuple[int, HeadMask]]:
        return [(i, p) for i, p in enumerate(self.scope.perturb) if isinstance(p, HeadMask)
                and layer in self._layers("head_mask", p.layers)]

    def _perturbations(self, site: str, layer: int) -> list[tuple[int, Any]]:
        if site == "head_mask":
            return self._head_masks(layer)
        return [(i, p) for i, p in enumerate(self.scope.perturb) if getattr(p, "site", None) == site
                and layer in self._layers(site, getattr(p, "layers", "all"))]

    def _hook(self, access: SiteAccess, module_of: Any, site: str, layer: int) -> None:
        module = access.module(module_of)
        perturbs = self._perturbations(site, layer)
        fwd = self._observers.get((site, layer), [])
        grad = self._observers.get((GRAD_PREFIX + site, layer), [])
        if not (perturbs or fwd or grad):
            return

        def run(args: tuple, kwargs: dict, output: Any) -> Any:
            return self._at_site(access, site, layer, perturbs, fwd, grad, args, kwargs, output)

        if access.pre:
            handle = module.register_forward_pre_hook(
                lambda _m, a, kw: run(a, kw, None), with_kwargs=True)
        else:
            handle = module.register_forward_hook(lambda _m, a, out: run(a, {}, out))
        self._handles.append(handle)

    # --------------------------------------------------------------- hook
    def _at_site(self, access: SiteAccess, site: str, layer: int, perturbs: list, fwd: list,
                 grad: list, args: tuple, kwargs: dict, output: Any) -> Any:
        st = self.state
        value, flowing = access.get(args, kwargs, output)
        result = None
        due = [(i, p) for i, p in perturbs if p.active(st.step, st.microbatch)]
        for i, p in due:
            value, detail = perturb_activation(value, p, self._act_context(i, site, layer, value))
            if st.phase == "forward":  # a recomputation re-applies, it does not inject again
                self._record({"kind": p.kind, "perturbation": i, "rank": self.place.rank,
                              "step": st.step, "microbatch": st.microbatch, "layer": layer,
                              "site": site, **detail})
        if due:
            result = access.put(args, kwargs, output, value)
            flowing = value
        if st.phase == "backward":
            self.recomputed_hooks += 1
        if st.phase == "forward":  # not a recomputation, nor a pass outside any task
            for obs in fwd:
                self._observe(obs, site, layer, access.layout, value.detach())
        if grad and flowing.requires_grad:
            step, mb = st.step, st.microbatch
            for obs in grad:
                if obs.sampled(step, mb):
                    flowing.register_hook(self._grad_hook(obs, site, layer, access.layout,
                                                          step, mb))
        return result

    def _grad_hook(self, obs: Observe, site: str, layer: int, layout: str, step: int,
                   microbatch: int) -> Callable[[Tensor], None]:
        def on_grad(g: Tensor) -> None:
            self._observe(obs, site, layer, layout, g.detach(), step, microbatch)
        return on_grad

    def _act_context(self, i: int, site: str, layer: int, x: Tensor) -> ActContext:
        split = SITES[site].split if site in SITES else "heads"
        shard = self.place.tp_rank if split != "replicated" else 0
        per_head = self.shape.heads // self.shape.tp
        head_dim = self.shape.hidden // self.shape.heads
        return ActContext(self.seed, i, self.state.step, self.state.microbatch, layer,
                          self.place.dp_rank, shard,
                          channel_offset=self.place.tp_rank * x.shape[-1] if split == "channels"
                          else 0, head_offset=self.place.tp_rank * per_head, head_dim=head_dim)

    # -------------------------------------------------------------- capture
    def _observe(self, obs: Observe, site: str, layer: int, layout: str, x: Tensor,
                 step: int | None = None, microbatch: int | None = None) -> None:
        step = self.state.step if step is None else step
        microbatch = self.state.microbatch if microbatch is None else microbatch
        if not obs.sampled(step, microbatch):
            return
        info = SITES[site]
        tp, tp_rank = self.place.tp, self.place.tp_rank
        if info.split == "replicated" and tp_rank != 0:
            return
        sel = self._select(obs, x, layout)
        if sel is None:
            return
        channels = x.shape[-1]
        split_channels = info.split == "channels" and tp > 1
        full = channels * tp if split_channels else channels
        offset = tp_rank * channels if split_channels else 0
        key = RecordKey(step, self.place.dp_rank, microbatch,
                        site_layer(site, layer, self.shape.layers), obs.site)
        part = stats.partials(sel.rows2d, obs.stat_specs, stats.Slice(offset, full, sel.query_pos))
        shard, nshards = (tp_rank, tp) if split_channels else (0, 1)
        self._pending.records.append(DeviceRecord(
            key, sel.rows, obs.stats, tuple(stats.widths(obs.stat_specs, full)), part,
            shard, nshards))
        if obs.keep_raw:
            raw_shard, raw_n = shard, nshards
            if info.split == "heads" and tp > 1:
                holders = [r for r in range(tp) if local_heads(obs, r, self.shape)]
                raw_shard, raw_n = holders.index(tp_rank), len(holders)
            self._pending.raws.append(DeviceRaw(
                key, sel.raw.detach().clone(), sel.dims, sel.tokens, sel.heads,
                "heads" if info.split == "heads" else ("channels" if split_channels
                                                       else "replicated"), raw_shard, raw_n))

    def _positions(self, obs: Observe, length: int) -> list[int]:
        if obs.tokens in ("all", "pooled"):
            return list(range(length))
        return sorted({t % length for t in obs.tokens if -length <= t < length})  # type: ignore

    def _index(self, values: list[int], device: torch.device) -> Tensor:
        key = (tuple(values), device)
        if key not in self._index_cache:  # made once: no host-to-device copy per capture
            self._index_cache[key] = torch.tensor(values, dtype=torch.long, device=device)
        return self._index_cache[key]

    def _select(self, obs: Observe, x: Tensor, layout: str) -> Selected | None:
        """The observation's tokens (and heads) of ``x``, as rows × channels,
        rows in the tensor's own order (a view, no copy, where it is contiguous)."""
        token_dim = {"sbh": 0, "sbnh": 0, "bnsk": 2}[layout]
        length = x.shape[token_dim]
        tokens = self._positions(obs, length)
        if not tokens:
            return None
        if len(tokens) != length:
            x = x.index_select(token_dim, self._index(tokens, x.device))
        pooled = obs.tokens == "pooled"
        if layout == "sbh":
            s, b = x.shape[:2]
            rows, _ = self._rows(layout, b, 1, tokens, None, pooled, x.device)
            flat = x.reshape(1, -1) if pooled else x.reshape(s * b, -1)
            return Selected(flat, rows, x.transpose(0, 1), ("sample", "token", "channel"),
                            tokens, None, None)
        heads = local_heads(obs, self.place.tp_rank, self.shape)
        if not heads:
            return None
        first = self.place.tp_rank * (self.shape.heads // self.shape.tp)
        local = [h - first for h in heads]
        head_dim = {"sbnh": 2, "bnsk": 1}[layout]
        if len(local) != x.shape[head_dim]:
            x = x.index_select(head_dim, self._index(local, x.device))
        if layout == "sbnh":  # [s', b, n', d]
            b, n = x.shape[1], x.shape[2]
            raw = x.permute(1, 2, 0, 3)
            by_head = x.permute(2, 0, 1, 3)
            dims = ("sample", "head", "token", "channel")
        else:  # [b, n', s', k]
            b, n = x.shape[0], x.shape[1]
            raw = x
            by_head = x.transpose(0, 1)
            dims = ("sample", "head", "query", "key")
        rows, query = self._rows(layout, b, n, tokens, heads, pooled, x.device)
        flat = by_head.reshape(n, -1) if pooled else x.reshape(len(rows), -1)
        return Selected(flat, rows, raw, dims, tokens, heads, query)

    def _rows(self, layout: str, b: int, n: int, tokens: list[int], heads: list[int] | None,
              pooled: bool, device: torch.device) -> tuple[Rows, Tensor | None]:
        """Row keys (and attention's query positions) of a selection, in the
        tensor's order: [s, b] rows, [s, b, n] for Q/K/V, [b, n, q] for the
        attention probabilities. Shapes repeat step after step: each is built once."""
        key = (layout, b, n, tuple(tokens), tuple(heads or ()), pooled, device)
        if key not in self._row_cache:
            s, t = len(tokens), np.asarray(tokens)
            if pooled:
                rows = (Rows(*(np.full(1, -1),) * 3) if heads is None
                        else Rows(np.full(n, -1), np.asarray(heads), np.full(n, -1)))
            elif heads is None:
                rows = Rows(np.tile(np.arange(b), s), np.full(s * b, -1), np.repeat(t, b))
            elif layout == "sbnh":
                rows = Rows(np.tile(np.repeat(np.arange(b), n), s), np.tile(heads, s * b),
                            np.repeat(t, b * n))
            else:
                rows = Rows(np.repeat(np.arange(b), n * s), np.tile(np.repeat(heads, s), b),
                            np.tile(t, b * n))
            query = (_on_device(torch.from_numpy(np.ascontiguousarray(rows.token, np.int64)),
                                device) if layout == "bnsk" and not pooled else None)
            self._row_cache[key] = (rows, query)
        return self._row_cache[key]

    # ----------------------------------------------------------- the step
    def before_step(self, step: int) -> None:
        """Before the optimizer step: capture parameter gradients; transient
        parameter corruptions end (the optimizer updates the clean values)."""
        for obs in self.scope.observe:
            if obs.site == PARAM_GRADS and step % obs.every_n_steps == 0:
                self._param_grads(obs, step)
        if self.params is not None:
            self.params.before_update(step)

    def after_step(self, step: int) -> None:
        """Parameters for iteration ``step + 1`` have been written back."""
        if self.params is not None:
            self.params.write_back(step + 1)

    def _param_grads(self, obs: Observe, step: int) -> None:
        layers = set(obs.layer_numbers(self.shape.layers))
        for name, held in self.named_params.items():
            parts = name.split(".")
            if parts[:2] != ["decoder", "layers"] or int(parts[2]) + 1 not in layers:
                continue
            split = held.partition_dim is not None and self.place.tp > 1
            if not split and self.place.tp_rank != 0:
                continue
            grad = held.param.grad
            if grad is None:
                continue
            key = RecordKey(step, self.place.dp_rank, -1, int(parts[2]) + 1,
                            f"{PARAM_GRADS}/{'.'.join(parts[3:])}")
            part = stats.partials(grad.detach().reshape(1, -1), obs.stat_specs, stats.Slice())
            one = np.full(1, -1)
            self._pending.records.append(DeviceRecord(
                key, Rows(one, one, one), obs.stats, tuple(stats.widths(obs.stat_specs, 1)), part,
                self.place.tp_rank if split else 0, self.place.tp if split else 1))

    def on_receive(self, tag: Any, meta: Any, peer: int, tensor: Tensor) -> None:
        self.p2p.on_receive(tag, meta, peer, tensor)


def part_writer(root: Path, rank: int) -> PartWriter:
    return PartWriter(Path(root), rank)


def session_for(scope: Scope, shape: ModelShape, seed: int, place: RankPlace,
                root: Path | None, live: bool = True) -> ScopeSession:
    """A session writing ``root/parts/rank{r}``: through a background thread
    (training) or at once (``live=False``: generation)."""
    writer = part_writer(root, place.rank) if root is not None else None
    if live and writer is not None:
        return ScopeSession(scope, shape, seed, place, AsyncWriter(writer, scope.queue_size))
    return ScopeSession(scope, shape, seed, place, SyncWriter(writer))


__all__ = ["ScopeSession", "RankPlace", "session_for", "ACCESS", "channels_of"]


def _on_device(host: Tensor, device: torch.device) -> Tensor:
    """``host`` on ``device`` without a host sync: a copy from pageable memory
    waits for the GPU, one from pinned memory is queued on the stream."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
