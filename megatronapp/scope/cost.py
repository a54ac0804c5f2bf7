"""What capture costs: the simulator's model, priced from the same ``scope:`` spec.

Per observed site and layer, on one rank, a capture costs

- one hook dispatch (``hook_us``);
- reading the selected elements once to convert them and once per
  statistic, at ``reduce_gbps`` (on-device reduction);
- copying the reduced partials (and raw slices) to the host over a per-rank
  copy link at ``d2h_gbps``, which overlaps the next compute and delays the
  rank only by what exceeds it (a saturated link);
- host work per result row (``host_us_per_row``): on its own thread and cores
  it overlaps like the copy (``host_overlaps``), on CPU ranks it competes with
  the compute and is paid in full.

The rank program yields one ``scope_capture`` compute after each forward or
backward that captures, priced by ``CapturePlan.cost_s``: the simulator waits
that long, the torch backend hands the step's records to its writer there.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..scenario.config import Scenario
from ..costs.per_op import stage_costs
from ..trace.sections import ScopeOverhead
from ..scenario.scope_spec import (PARAM_GRADS, SITES, CaptureCost, ModelShape, Observe, base_site,
                          channels_of, LAYER_PARAMS)

FLOAT_BYTES = 4
PARTIAL_BYTES = 8


@dataclass(frozen=True)
class Work:
    """What captures amount to on one rank."""

    hooks: int = 0
    read_bytes: int = 0  # read by the reductions (conversion + one pass per statistic)
    rows: int = 0  # result rows times statistics
    host_bytes: int = 0  # partials and raw slices copied to the host

    def __add__(self, o: "Work") -> "Work":
        return Work(self.hooks + o.hooks, self.read_bytes + o.read_bytes, self.rows + o.rows,
                    self.host_bytes + o.host_bytes)

    def critical_s(self, c: CaptureCost) -> float:
        """On the training thread: hook dispatch and the device reductions
        (plus the host work when it shares the compute's cores)."""
        host = 0.0 if c.host_overlaps else self.host_s(c)
        return self.hooks * c.hook_us * 1e-6 + self.read_bytes / (c.reduce_gbps * 1e9) + host

    def async_s(self, c: CaptureCost) -> float:
        """Off the training thread: the copy link, and the host thread if it has its own cores."""
        return self.host_bytes / (c.d2h_gbps * 1e9) + (self.host_s(c) if c.host_overlaps else 0.0)

    def host_s(self, c: CaptureCost) -> float:
        return self.rows * c.host_us_per_row * 1e-6


def model_shape(s: Scenario) -> ModelShape:
    p, m = s.parallel, s.model
    return ModelShape(layers=m.layers, heads=m.heads, hidden=m.hidden, ffn=m.ffn, vocab=m.vocab,
                      seq_len=m.seq_len, tp=p.tp, pp_vpp=p.pp * p.vpp)


def _tokens(obs: Observe, seq: int) -> int:
    if obs.tokens in ("all", "pooled"):
        return seq
    return len({t % seq for t in obs.tokens})  # type: ignore[union-attr]


def local_heads(obs: Observe, tp_rank: int, m: ModelShape) -> list[int]:
    """Global heads of the observation that this TP rank holds."""
    per = m.heads // m.tp
    mine = range(tp_rank * per, (tp_rank + 1) * per)
    return [h for h in mine if obs.heads is None or h in obs.heads]


def site_work(obs: Observe, tp_rank: int, m: ModelShape, batch: int) -> Work:
    """One (site, layer) capture on one rank (nothing for a rank that skips it)."""
    site = base_site(obs.site)
    info = SITES[site]
    if info.split == "replicated" and tp_rank != 0:
        return Work()
    tokens = _tokens(obs, m.seq_len)
    heads = len(local_heads(obs, tp_rank, m)) if info.per_head else 1
    if heads == 0:
        return Work()
    channels = channels_of(site, m)
    elements = batch * tokens * heads * channels
    rows = heads if obs.tokens == "pooled" else batch * tokens * heads
    full = channels * (m.tp if info.split == "channels" else 1)
    from .stats import widths  # imports torch: only when a capture is priced

    partial_cols = sum(widths(obs.stat_specs, full))
    raw = elements * FLOAT_BYTES if obs.keep_raw else 0
    return Work(1, elements * FLOAT_BYTES * (1 + len(obs.stats)), rows * len(obs.stats),
                rows * partial_cols * PARTIAL_BYTES + raw)


def param_grad_work(obs: Observe, tp_rank: int, m: ModelShape) -> Work:
    """Parameter gradients of one layer, reduced at the optimizer step."""
    h, f, tp = m.hidden, m.ffn, m.tp
    sizes = {"input_layernorm": (h, False), "self_attention.linear_proj.weight": (h * h, True),
             "self_attention.linear_proj.bias": (h, False),
             "self_attention.linear_qkv.weight": (3 * h * h, True),
             "self_attention.linear_qkv.bias": (3 * h, True), "pre_mlp_layernorm": (h, False),
             "mlp.linear_fc1.weight": (f * h, True), "mlp.linear_fc1.bias": (f, True),
             "mlp.linear_fc2.weight": (h * f, True), "mlp.linear_fc2.bias": (h, False)}
    work = Work()
    for name in LAYER_PARAMS:
        size, split = next(v for k, v in sizes.items() if name.startswith(k))
        if split or tp_rank == 0:
            elements = size // tp if split else size
            work += Work(0, elements * FLOAT_BYTES * (1 + len(obs.stats)), len(obs.stats),
                         len(obs.stats) * 5 * PARTIAL_BYTES)
    return work


@dataclass(frozen=True)
class CapturePlan:
    """Which virtual stages capture what, and the simulator's price of it.

    A capture costs its critical part where it happens; its asynchronous part
    (copies, host work on its own thread) overlaps the rank's compute of the
    iteration and is paid, spread over the rank's captures, only for what
    exceeds that compute (a saturated link or writer)."""

    observe: tuple[Observe, ...]
    shape: ModelShape
    pp: int
    vpp: int
    microbatches: int
    batch: int
    cost: CaptureCost
    forward_s: float  # one microbatch through one chunk
    backward_s: float
    _cache: dict[tuple[Any, ...], float] = field(default_factory=dict, compare=False, hash=False,
                                                 repr=False)

    @property
    def layers_per_stage(self) -> int:
        return self.shape.layers // (self.pp * self.vpp)

    def _stage_layers(self, vs: int) -> range:
        n = self.layers_per_stage
        return range(vs * n + 1, (vs + 1) * n + 1)

    def _captured_layers(self, obs: Observe, vs: int) -> list[int]:
        if base_site(obs.site) == "logits":
            return [0] if vs == self.pp * self.vpp - 1 else []
        mine = self._stage_layers(vs)
        return [layer for layer in obs.layer_numbers(self.shape.layers) if layer in mine]

    def work(self, step: int, microbatch: int, vs: int, phase: str, tp_rank: int) -> Work | None:
        """Capture work of one forward ("F") or backward ("B") task; None: none."""
        total, hit = Work(), False
        for obs in self.observe:
            if obs.site == PARAM_GRADS or not obs.sampled(step, microbatch):
                continue
            if obs.site.startswith("grad:") != (phase == "B"):
                continue
            for _ in self._captured_layers(obs, vs):
                one = site_work(obs, tp_rank, self.shape, self.batch)
                hit = hit or one.hooks > 0  # a TP rank that skips the site captures nothing
                total += one
        return total if hit else None

    def param_work(self, step: int, stages: list[int], tp_rank: int) -> Work | None:
        """Parameter-gradient capture at the optimizer step of a rank holding ``stages``."""
        total, hit = Work(), False
        for obs in self.observe:
            if obs.site != PARAM_GRADS or step % obs.every_n_steps:
                continue
            for vs in stages:
                for _ in self._captured_layers(obs, vs):
                    hit = True
                    total += param_grad_work(obs, tp_rank, self.shape)
        return total if hit else None

    def _rank_stages(self, vs: int) -> list[int]:
        return [vs % self.pp + c * self.pp for c in range(self.vpp)]

    def _excess_per_capture(self, step: int, vs: int, tp_rank: int) -> float:
        """Asynchronous work of the rank's iteration beyond its compute, per capture."""
        stages = self._rank_stages(vs)
        key = (tuple(step % o.every_n_steps for o in self.observe), stages[0], tp_rank)
        if key not in self._cache:
            tasks = [self.work(step, mb, v, ph, tp_rank) for v in stages
                     for mb in range(self.microbatches) for ph in "FB"]
            tasks.append(self.param_work(step, stages, tp_rank))
            done = [w for w in tasks if w is not None]
            compute = self.microbatches * self.vpp * (self.forward_s + self.backward_s)
            spare = sum(w.async_s(self.cost) for w in done) - compute
            self._cache[key] = max(0.0, spare) / max(1, len(done))
        return self._cache[key]

    def cost_s(self, step: int, microbatch: int, vs: int, phase: str, tp_rank: int
               ) -> float | None:
        """The ``scope_capture`` op after a task (None: the task captured nothing)."""
        work = self.work(step, microbatch, vs, phase, tp_rank)
        if work is None:
            return None
        return work.critical_s(self.cost) + self._excess_per_capture(step, vs, tp_rank)

    def step_cost_s(self, step: int, stages: list[int], tp_rank: int) -> float | None:
        work = self.param_work(step, stages, tp_rank)
        if work is None:
            return None
        return work.critical_s(self.cost) + self._excess_per_capture(step, stages[0], tp_rank)


def capture_plan(s: Scenario) -> CapturePlan | None:
    """The plan of a scenario with observations (None without a ``scope:``)."""
    if s.scope is None or not s.scope.observe:
        return None
    costs = stage_costs(s)
    p = s.parallel
    return CapturePlan(s.scope.observe, model_shape(s), p.pp, p.vpp, p.microbatches,
                       s.model.micro_batch_size, s.scope.cost, costs.forward_chunk_s,
                       costs.backward_chunk_s)



def predicted_overhead(s: Scenario, run: Callable[[Scenario], Any],
                       ran: Any = None) -> ScopeOverhead:
    """The simulator's answer to "what would capturing cost on this job":
    mean iteration time with the capture over without it, both simulated
    without background jitter (so the difference is the capture alone).
    ``ran``: the scenario's own simulated run, reused when it had no jitter
    (the simulator is deterministic: running it again would repeat it)."""
    from ..trace.summary import iteration_times

    jitter = s.cluster.jitter
    quiet = s.cluster.model_copy(update={"jitter": jitter.model_copy(
        update={"compute_sigma": 0.0, "link_sigma": 0.0})})
    noiseless = jitter.compute_sigma == 0 and jitter.link_sigma == 0
    with_capture = ran if ran is not None and noiseless else run(
        s.model_copy(update={"cluster": quiet}))
    without = run(s.model_copy(update={"cluster": quiet, "scope": None}))
    t1, t0 = (float(np.mean(iteration_times(r.events))) for r in (with_capture, without))
    captures = [e for evs in with_capture.events.values() for e in evs if e.name == "scope_capture"]
    return ScopeOverhead(predicted_capture_overhead=t1 / t0 - 1.0, iteration_s=t1,
                         iteration_s_without_capture=t0, capture_events=len(captures),
                         capture_busy_s=float(sum(e.dur_s for e in captures)))
