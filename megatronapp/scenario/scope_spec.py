"""MegaScope's ``scope:`` scenario section: what to observe, how to reduce it,
what to perturb. Data only: the closed registries of sites, statistics and
perturbation kinds, and their pydantic models.

This module imports nothing else of the core, so ``config`` can embed the
section (the implementation in ``megatronapp.scope`` builds on both). Checks
that need the model (a layer beyond it, a parameter it does not have) are in
``check_against_model``, which ``config`` calls and turns into one-line
``ScenarioError``s.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _invalid(kind: str, message: str) -> PydanticCustomError:
    """A validation error whose message is exactly ``message``."""
    return PydanticCustomError(kind, "{message}", {"message": message})


# ------------------------------------------------------------------ sites
@dataclass(frozen=True)
class SiteInfo:
    """Where a site lives and how its tensor splits over tensor parallelism.

    ``split``: "replicated" (every TP rank holds the whole tensor: TP rank 0
    captures it), "heads" (each TP rank holds its own heads), "channels"
    (each TP rank holds a slice of the last dimension: partial reductions
    merged exactly). ``hook`` names the megatron-core module and hook kind.
    """

    split: str
    per_head: bool
    hook: str
    perturbable: bool = True


SITES: dict[str, SiteInfo] = {
    "resid_pre": SiteInfo("replicated", False, "decoder.layers[i] forward pre-hook: hidden_states"),
    "attn.q": SiteInfo("heads", True, "self_attention.core_attention pre-hook: query (after rotary)"),
    "attn.k": SiteInfo("heads", True, "self_attention.core_attention pre-hook: key (after rotary)"),
    "attn.v": SiteInfo("heads", True, "self_attention.core_attention pre-hook: value"),
    "attn.probs": SiteInfo("heads", True, "core_attention.scale_mask_softmax output"),
    "attn.out": SiteInfo("replicated", False, "self_attention output + bias"),
    "resid_mid": SiteInfo("replicated", False, "pre_mlp_layernorm input", perturbable=False),
    "mlp.pre": SiteInfo("channels", False, "mlp.linear_fc1 output + bias (before the activation)"),
    "mlp.post": SiteInfo("channels", False, "mlp.linear_fc2 input (after the activation)"),
    "mlp.out": SiteInfo("replicated", False, "mlp output + bias"),
    "resid_post": SiteInfo("replicated", False, "decoder.layers[i] output"),
    "logits": SiteInfo("channels", False, "output_layer output (vocabulary split over TP)"),
}
GRAD_PREFIX = "grad:"
PARAM_GRADS = "grad:params"  # every parameter gradient of the observed layers, at the step


def site_names() -> list[str]:
    return [*SITES, *(GRAD_PREFIX + s for s in SITES), PARAM_GRADS]


def base_site(site: str) -> str:
    """``grad:mlp.pre`` -> ``mlp.pre`` (the forward site it differentiates)."""
    return site[len(GRAD_PREFIX):] if site.startswith(GRAD_PREFIX) else site


def site_layer(site: str, layer: int, num_layers: int) -> int:
    """Logits sit after the last layer: layer number ``num_layers + 1``."""
    return num_layers + 1 if base_site(site) == "logits" else layer


# ------------------------------------------------------------- statistics
@dataclass(frozen=True)
class StatInfo:
    """One named statistic of the closed registry.

    ``arg``: the name of its one numeric parameter (None: takes none).
    ``indexed``: emits one value per index (top-k channel, histogram bucket,
    pixel block) rather than one scalar. ``attention``: defined on attention
    probabilities only (rows are query tokens, channels are key tokens).
    """

    arg: str | None = None
    default: float | None = None
    indexed: bool = False
    attention: bool = False
    integer_arg: bool = False


HIST_MIN_EXP, HIST_MAX_EXP = -16, 16  # log2 buckets of |x|: [2^k, 2^(k+1)), k in this range
HIST_BUCKETS = HIST_MAX_EXP - HIST_MIN_EXP + 2  # plus "below 2^min (zero included)" and "at or above 2^max"

STATS: dict[str, StatInfo] = {
    "min": StatInfo(), "max": StatInfo(), "absmax": StatInfo(), "mean": StatInfo(),
    "std": StatInfo(), "rms": StatInfo(), "l2": StatInfo(),
    "sparsity": StatInfo(arg="eps", default=0.0),
    "nan_count": StatInfo(), "inf_count": StatInfo(), "kurtosis": StatInfo(),
    "topk": StatInfo(arg="k", default=8, indexed=True, integer_arg=True),
    "hist": StatInfo(indexed=True),
    "pixels_mean": StatInfo(arg="block", default=16, indexed=True, integer_arg=True),
    "pixels_absmax": StatInfo(arg="block", default=16, indexed=True, integer_arg=True),
    "entropy": StatInfo(attention=True),
    "prev_token_mass": StatInfo(attention=True),
    "sink_mass": StatInfo(attention=True),
}

_STAT_RE = re.compile(r"^([a-z_0-9]+)(?:\(\s*([-+0-9.eE]+)\s*\))?$")


@dataclass(frozen=True)
class StatSpec:
    """A parsed statistic: ``sparsity(0.001)`` -> name sparsity, arg 0.001."""

    name: str
    arg: float | None

    @property
    def label(self) -> str:
        """Canonical text, the ``stat`` column of the capture."""
        if self.arg is None:
            return self.name
        info = STATS[self.name]
        return f"{self.name}({int(self.arg) if info.integer_arg else repr(float(self.arg))})"

    @property
    def info(self) -> StatInfo:
        return STATS[self.name]


def parse_stat(text: str) -> StatSpec:
    """``name`` or ``name(number)``; never evaluated, only matched."""
    m = _STAT_RE.match(text.strip())
    if m is None or m.group(1) not in STATS:
        raise _invalid("stat", f"unknown statistic {text!r} (choose from {', '.join(STATS)})")
    name, raw = m.group(1), m.group(2)
    info = STATS[name]
    if raw is not None and info.arg is None:
        raise _invalid("stat", f"statistic {name!r} takes no argument")
    value = info.default if raw is None else float(raw)
    if info.integer_arg and value is not None and (value != int(value) or value < 1):
        raise _invalid("stat", f"{name}: {info.arg} must be a positive integer")
    if name == "sparsity" and value is not None and value < 0:
        raise _invalid("stat", "sparsity: eps must be >= 0")
    return StatSpec(name, value)


# ----------------------------------------------------------- observations
Layers = Union[Literal["all"], tuple[Annotated[int, Field(ge=1)], ...]]
Tokens = Union[Literal["all", "pooled"], tuple[int, ...]]


class Observe(_Strict):
    """One observation point: a site at some layers, reduced to statistics."""

    site: str
    layers: Layers = "all"  # global, 1-based (megatron's layer_number)
    heads: tuple[Annotated[int, Field(ge=0)], ...] | None = None  # head sites only; None: all
    tokens: Tokens = "all"  # positions (negative from the end), all, or pooled into one row
    microbatches: tuple[Annotated[int, Field(ge=0)], ...] | None = None
    every_n_steps: Annotated[int, Field(ge=1)] = 1
    stats: tuple[str, ...] = ("mean", "std", "absmax")
    keep_raw: bool = False  # also keep the selected slice itself (safetensors)

    @field_validator("site")
    @classmethod
    def _known_site(cls, site: str) -> str:
        if site not in site_names():
            raise _invalid("site", f"unknown site {site!r} (choose from {', '.join(site_names())})")
        return site

    @field_validator("stats")
    @classmethod
    def _known_stats(cls, stats: tuple[str, ...]) -> tuple[str, ...]:
        if not stats:
            raise _invalid("stats", "at least one statistic")
        return tuple(parse_stat(s).label for s in stats)

    @property
    def stat_specs(self) -> tuple[StatSpec, ...]:
        return tuple(parse_stat(s) for s in self.stats)

    def layer_numbers(self, num_layers: int) -> tuple[int, ...]:
        return tuple(range(1, num_layers + 1)) if self.layers == "all" else tuple(self.layers)

    def sampled(self, step: int, microbatch: int) -> bool:
        return step % self.every_n_steps == 0 and (
            self.microbatches is None or microbatch in self.microbatches)


# ----------------------------------------------------------- perturbations
class _When(_Strict):
    step: Annotated[int, Field(ge=0)] | None = None  # None: every step
    microbatch: Annotated[int, Field(ge=0)] | None = None  # None: every microbatch

    def active(self, step: int, microbatch: int) -> bool:
        return ((self.step is None or self.step == step)
                and (self.microbatch is None or self.microbatch == microbatch))


class _Param(_Strict):
    """A parameter, corrupted when written back after the optimizer step that
    precedes iteration ``step`` (0: at load). ``target`` is a name inside a
    layer (``mlp.linear_fc1.weight``, with ``layers``) or a whole-model name
    (``output_layer.weight``). Elements: ``index`` (flat, in the full
    unsplit tensor) or ``count`` drawn from the scenario seed. ``dp``: only
    that data-parallel replica's copy (it then diverges from the others);
    None: every replica alike. ``persistent``: the corrupted value stays (stuck-at: forced again after
    every later write-back); otherwise the clean value is restored before the
    next optimizer step."""

    target: str
    layers: tuple[Annotated[int, Field(ge=1)], ...] | None = None
    index: Annotated[int, Field(ge=0)] | None = None
    count: Annotated[int, Field(ge=1)] = 1
    step: Annotated[int, Field(ge=0)] = 0
    persistent: bool = True
    dp: Annotated[int, Field(ge=0)] | None = None


class ParamBitflip(_Param):
    kind: Literal["param_bitflip"]
    bit: Union[Annotated[int, Field(ge=0)], Literal["sign"]]  # IEEE-754 bit of the stored dtype


class ParamStuck(_Param):
    kind: Literal["param_stuck"]
    value: float


class ParamNoise(_Param):
    kind: Literal["param_noise"]
    sigma: float = Field(gt=0)  # w <- w * (1 + sigma * N(0, 1)), every element
    count: Annotated[int, Field(ge=1)] | None = None  # type: ignore[assignment]


class _Act(_When):
    site: str
    layers: Layers = "all"

    @field_validator("site")
    @classmethod
    def _perturbable(cls, site: str) -> str:
        info = SITES.get(site)
        if info is None:
            raise _invalid("site", f"unknown site {site!r} (choose from {', '.join(SITES)})")
        if not info.perturbable:
            raise _invalid("site", f"{site} can be observed, not perturbed (megatron-core keeps "
                           "that residual inside the layer's forward); perturb attn.out instead")
        return site


class ActNoise(_Act):
    kind: Literal["act_noise"]
    sigma: float = Field(gt=0)
    relative: bool = True  # noise std = sigma * rms of the tensor (else sigma itself)


class ActMask(_Act):
    kind: Literal["act_mask"]
    channels: tuple[Annotated[int, Field(ge=0)], ...]  # zeroed (global channel numbers)


class ActOffset(_Act):
    kind: Literal["act_offset"]
    value: float


class Quantize(_Act):
    kind: Literal["quantize"]
    format: Literal["fp8_e4m3", "fp8_e5m2", "int8"]  # int8: symmetric, scale = absmax/127


class HeadMask(_When):
    kind: Literal["head_mask"]
    layers: Layers = "all"
    heads: tuple[Annotated[int, Field(ge=0)], ...]  # their attention outputs are zeroed


class _P2P(_When):
    """Corrupts what a pipeline stage receives (the sender's copy is intact):
    forward activations or backward gradients, at receiving virtual stage
    ``stage`` (None: every stage that receives)."""

    direction: Literal["forward", "backward"]
    stage: Annotated[int, Field(ge=0)] | None = None


class P2POffset(_P2P):
    kind: Literal["p2p_offset"]
    value: float


class P2PNoise(_P2P):
    kind: Literal["p2p_noise"]
    sigma: float = Field(gt=0)  # absolute standard deviation


class P2PBitflip(_P2P):
    kind: Literal["p2p_bitflip"]
    bit: Union[Annotated[int, Field(ge=0)], Literal["sign"]]
    count: Annotated[int, Field(ge=1)] = 1


class P2PZero(_P2P):
    kind: Literal["p2p_zero"]


Perturbation = Annotated[
    Union[ParamBitflip, ParamStuck, ParamNoise, ActNoise, ActMask, ActOffset, Quantize,
          HeadMask, P2POffset, P2PNoise, P2PBitflip, P2PZero], Field(discriminator="kind")]
PERTURBATION_KINDS = ("param_bitflip", "param_stuck", "param_noise", "act_noise", "act_mask",
                      "act_offset", "quantize", "head_mask", "p2p_offset", "p2p_noise",
                      "p2p_bitflip", "p2p_zero")
PARAM_KINDS = ("param_bitflip", "param_stuck", "param_noise")
P2P_KINDS = ("p2p_offset", "p2p_noise", "p2p_bitflip", "p2p_zero")


class CaptureCost(_Strict):
    """Constants of the simulator's capture cost model (``megatronapp.scope.cost``).
    Defaults describe a GPU; ``experiments/scope_overhead.py`` measures them on
    the torch backend."""

    hook_us: float = Field(default=8.0, ge=0)  # dispatch of one module hook that captures
    reduce_gbps: float = Field(default=1000.0, gt=0)  # device bytes/s read by each statistic (GB/s)
    d2h_gbps: float = Field(default=20.0, gt=0)  # device-to-host copy link (GB/s)
    host_us_per_row: float = Field(default=0.5, ge=0)  # host work per result row
    host_overlaps: bool = True  # host work on its own thread and cores (GPU); False: CPU ranks


class Scope(_Strict):
    observe: tuple[Observe, ...] = ()
    perturb: tuple[Perturbation, ...] = ()
    queue_size: Annotated[int, Field(ge=1)] = 256  # records per rank in flight; oldest dropped
    cost: CaptureCost = CaptureCost()


# ------------------------------------------------------ model-dependent checks
@dataclass(frozen=True)
class ModelShape:
    """What the checks need of ``model:`` and ``parallel:``."""

    layers: int
    heads: int
    hidden: int
    ffn: int
    vocab: int
    seq_len: int
    tp: int
    pp_vpp: int  # number of virtual pipeline stages
    param_bits: int = 32  # parameters are stored as float32


def _layer_param_shapes(m: ModelShape) -> dict[str, tuple[int, ...]]:
    h, f = m.hidden, m.ffn
    shapes: dict[str, tuple[int, ...]] = {"input_layernorm.weight": (h,), "input_layernorm.bias": (h,),
            "self_attention.linear_proj.weight": (h, h), "self_attention.linear_proj.bias": (h,),
            "self_attention.linear_qkv.weight": (3 * h, h), "self_attention.linear_qkv.bias": (3 * h,),
            "pre_mlp_layernorm.weight": (h,), "pre_mlp_layernorm.bias": (h,),
            "mlp.linear_fc1.weight": (f, h), "mlp.linear_fc1.bias": (f,),
            "mlp.linear_fc2.weight": (h, f), "mlp.linear_fc2.bias": (h,)}
    return shapes


LAYER_PARAMS = tuple(_layer_param_shapes(ModelShape(1, 1, 1, 1, 1, 1, 1, 1)))


def layer_param(layer: int, name: str) -> str:
    """Global parameter name of ``name`` in 1-based layer ``layer``."""
    return f"decoder.layers.{layer - 1}.{name}"


def parameter_shapes(m: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every parameter of the GPTModel the torch backend builds (local spec,
    untied embeddings, learned positions), by global name, unsplit."""
    shapes: dict[str, tuple[int, ...]] = {
              "embedding.word_embeddings.weight": (m.vocab, m.hidden),
              "embedding.position_embeddings.weight": (m.seq_len, m.hidden)}
    for layer in range(1, m.layers + 1):
        shapes.update({layer_param(layer, n): s for n, s in _layer_param_shapes(m).items()})
    shapes.update({"decoder.final_layernorm.weight": (m.hidden,),
                   "decoder.final_layernorm.bias": (m.hidden,),
                   "output_layer.weight": (m.vocab, m.hidden)})
    return shapes


def param_targets(p: ParamBitflip | ParamStuck | ParamNoise) -> list[str]:
    """The global parameter names a parameter perturbation hits."""
    if p.layers is None:
        return [p.target]
    return [layer_param(layer, p.target) for layer in p.layers]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_against_model(scope: Scope, m: ModelShape) -> tuple[str, str] | None:
    """The first (field, reason) that the model contradicts, or None."""
    for i, obs in enumerate(scope.observe):
        bad = _check_observe(obs, m)
        if bad:
            return f"scope.observe[{i}].{bad[0]}", bad[1]
    for i, p in enumerate(scope.perturb):
        bad = _check_perturbation(p, m)
        if bad:
            return f"scope.perturb[{i}].{bad[0]}", bad[1]
    return None


def _layers_in_range(layers: Layers, m: ModelShape) -> tuple[str, str] | None:
    if layers != "all":
        for layer in layers:
            if layer > m.layers:
                return "layers", f"layer {layer} is beyond the model's {m.layers} layers"
    return None


def _heads_in_range(heads: tuple[int, ...] | None, m: ModelShape) -> tuple[str, str] | None:
    for h in heads or ():
        if h >= m.heads:
            return "heads", f"head {h} out of range 0..{m.heads - 1}"
    return None


def channels_of(site: str, m: ModelShape) -> int:
    """Size of the reduced (last) dimension of a site on one TP rank."""
    site = base_site(site)
    if site in ("attn.q", "attn.k", "attn.v"):
        return m.hidden // m.heads
    if site == "attn.probs":
        return m.seq_len
    if site in ("mlp.pre", "mlp.post"):
        return m.ffn // m.tp
    if site == "logits":
        return m.vocab // m.tp
    return m.hidden


def _check_observe(obs: Observe, m: ModelShape) -> tuple[str, str] | None:
    bad = _layers_in_range(obs.layers, m) or _heads_in_range(obs.heads, m)
    if bad:
        return bad
    per_head = obs.site != PARAM_GRADS and SITES[base_site(obs.site)].per_head
    if obs.heads is not None and not per_head:
        return "heads", f"{obs.site} has no heads (only attn.q, attn.k, attn.v, attn.probs)"
    if isinstance(obs.tokens, tuple):
        for t in obs.tokens:
            if not -m.seq_len <= t < m.seq_len:
                return "tokens", f"token {t} out of range for seq_len {m.seq_len}"
    for spec in obs.stat_specs:
        reason = _check_stat(obs, spec, m)
        if reason:
            return "stats", reason
    return None


def _check_stat(obs: Observe, spec: StatSpec, m: ModelShape) -> str | None:
    info = spec.info
    site = base_site(obs.site)
    if info.attention and obs.site != "attn.probs":
        return f"{spec.name} is defined on attn.probs only, not {obs.site}"
    if obs.site == PARAM_GRADS and info.indexed:
        return f"{spec.name} is not available for {PARAM_GRADS} (scalar statistics only)"
    if obs.tokens == "pooled" and info.indexed and spec.name != "hist":
        return f"{spec.name} needs per-token rows (tokens: pooled keeps one row)"
    if spec.name.startswith("pixels") and obs.site != PARAM_GRADS:
        block = int(spec.arg or 1)
        if channels_of(site, m) % block:
            return (f"{spec.label}: block {block} does not divide the {channels_of(site, m)} "
                    f"channels of {site} on one TP rank")
    return None


def _check_perturbation(p: Perturbation, m: ModelShape) -> tuple[str, str] | None:
    if isinstance(p, (ParamBitflip, ParamStuck, ParamNoise)):
        bad = _layers_in_range(p.layers or (), m)
        if bad:
            return bad
        known = parameter_shapes(m)
        for name in param_targets(p):
            if name not in known:
                return "target", f"no parameter {name!r} in the model"
            numel = _numel(known[name])
            if p.index is not None and p.index >= numel:
                return "index", f"element {p.index} out of range: {name} has {numel}"
            if p.index is None and p.count is not None and p.count > numel:
                return "count", f"{p.count} elements asked, {name} has {numel}"
        if isinstance(p, ParamBitflip) and p.bit != "sign" and p.bit >= m.param_bits:
            return "bit", f"bit {p.bit} out of range for {m.param_bits}-bit parameters"
        return None
    if isinstance(p, HeadMask):
        return _layers_in_range(p.layers, m) or _heads_in_range(p.heads, m)
    if isinstance(p, (ActNoise, ActMask, ActOffset, Quantize)):
        bad = _layers_in_range(p.layers, m)
        if bad:
            return bad
        if isinstance(p, ActMask):
            full = channels_of(p.site, m) * (m.tp if SITES[p.site].split == "channels" else 1)
            for c in p.channels:
                if c >= full:
                    return "channels", f"channel {c} out of range 0..{full - 1} of {p.site}"
        return None
    if m.pp_vpp == 1:
        return "kind", f"{p.kind}: a pipeline of one stage sends nothing between stages"
    if isinstance(p, P2PBitflip) and p.bit != "sign" and p.bit >= 32:
        return "bit", f"bit {p.bit} out of range for 32-bit activations"
    if p.stage is not None:
        first_receiver = 1 if p.direction == "forward" else 0
        last_receiver = m.pp_vpp - 1 if p.direction == "forward" else m.pp_vpp - 2
        if not first_receiver <= p.stage <= last_receiver:
            return "stage", (f"no stage {p.stage} receives {p.direction} tensors "
                             f"(stages {first_receiver}..{last_receiver} do)")
    return None
