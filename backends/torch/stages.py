"""megatron-core GPTModel stages behind the ``StageModel`` protocol.

Each pipeline rank holds one GPTModel per model chunk (virtual stage
``chunk * pp + pp_rank``), built with pre_process on virtual stage 0 and
post_process on the last one; TP layers come from megatron-core and run their
own TP collectives. Our rank program drives the stages (megatron's schedules
hard-code CUDA). Loss = mean token cross-entropy per microbatch, scaled by
1/microbatches for backward, so that after the dp all-reduce and averaging the
gradients are those of the mean loss over the global batch.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Any, Mapping

import numpy as np
import torch

from megatronapp.scenario.config import Scenario
from megatronapp.scenario.data import TextData, random_tokens
from megatronapp.parallel.ops import Report
from megatronapp.scenario.seeds import torch_seed

from . import megatron_compat
from .resume import drop_shard, load_shard, save_shard, shard_path


@dataclass(frozen=True)
class TrainOptions:
    """How the stages train: optimizer, learning rate, what to capture."""

    optimizer: str = "adam"  # "adam" | "sgd"
    lr: float = 1e-3
    capture_first_step: bool = False  # keep weights/grads of iteration 0 (tests)
    initial_state: Mapping[str, np.ndarray] | None = None  # full-model weights to load
    profile_dir: str | None = None  # also write a torch.profiler trace per rank here
    workdir: str | None = None  # where ranks write MegaScope parts and checkpoint shards
    checkpoint_every: int | None = None  # save a mid-run checkpoint this often (resume.py)
    first_iteration: int = 0  # the job's iteration of this run's first: resumed from its checkpoint


@dataclass(frozen=True)
class StepCapture:
    """One rank's view of an optimizer step, by full-model parameter name."""

    before: dict[str, np.ndarray]
    grads: dict[str, np.ndarray]  # dp-averaged, as used by the step
    after: dict[str, np.ndarray]
    partition_dim: dict[str, int | None]  # TP split dimension, None if replicated
    grad_norm: float


@dataclass
class StepLog:
    losses: dict[int, dict[int, float]] = field(default_factory=dict)  # iteration -> mb -> loss
    grad_norms: dict[int, float] = field(default_factory=dict)
    capture: StepCapture | None = None


def transformer_config(s: Scenario) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    p, m = s.parallel, s.model
    return TransformerConfig(
        num_layers=m.layers, hidden_size=m.hidden, num_attention_heads=m.heads,
        num_query_groups=m.query_groups, ffn_hidden_size=m.ffn,
        gated_linear_unit=m.activation == "swiglu",
        activation_func=activation_of(m),
        sequence_parallel=s.sequence_parallel, **recompute_options(s),
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp if p.vpp > 1 else None,
        pipeline_dtype=torch.float32, params_dtype=torch.float32,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False)


def activation_of(m: Any) -> Any:
    """Megatron's activation: silu for swiglu, gelu (tanh-approximated with --openai-gelu)."""
    if m.activation == "swiglu":
        return torch.nn.functional.silu
    return openai_gelu if m.openai_gelu else torch.nn.functional.gelu


def openai_gelu(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


def recompute_options(s: Scenario) -> dict[str, Any]:
    """Megatron-core's recomputation settings for ``training.recompute``."""
    if s.training.recompute == "full":
        return {"recompute_granularity": "full",
                "recompute_method": s.training.recompute_method or "uniform",
                "recompute_num_layers": s.training.recompute_num_layers or 1}
    if s.training.recompute == "selective":
        return {"recompute_granularity": "selective"}
    return {}


def global_name(local: str, virtual_stage: int, layers_per_chunk: int) -> str:
    """``decoder.layers.{i}...`` of a chunk -> the name in a one-stage model."""
    parts = local.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(virtual_stage * layers_per_chunk + int(parts[2]))
    return ".".join(parts)


def partition_dim_of(param: torch.nn.Parameter) -> int | None:
    if not getattr(param, "tensor_model_parallel", False):
        return None
    dim: int = getattr(param, "partition_dim")  # set by megatron-core's TP layers
    return dim


def merge_tp_shards(shards: list[np.ndarray], partition_dim: int | None) -> np.ndarray:
    """Full tensor from the TP ranks' shards (in tp-rank order)."""
    return shards[0] if partition_dim is None else np.concatenate(shards, axis=partition_dim)


class MegatronStages:
    """One pipeline rank's model chunks, optimizer and per-microbatch state."""

    does_tp_comm = True
    # Tying across pipeline stages needs Megatron's embedding group and its
    # gradient all-reduce; these stages always keep the two apart.
    ties_embeddings = False

    def __init__(self, s: Scenario, rank: int, device: torch.device,
                 options: TrainOptions = TrainOptions()):
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        from megatronapp.program.layout import pipe_shape, topology_of

        self.s, self.device, self.options = s, device, options
        self.topo, self.shape = topology_of(s), pipe_shape(s)
        self.coord = self.topo.coord(rank)
        torch.manual_seed(torch_seed(s.seed))
        megatron_compat.seed_model_parallel_rng(torch_seed(s.seed), self.coord.tp)
        config = transformer_config(s)
        self.layers_per_chunk = s.model.layers // self.shape.num_virtual_stages
        self.models = [GPTModel(config, get_gpt_layer_local_spec(), vocab_size=s.model.vocab,
                                max_sequence_length=s.model.seq_len,
                                pre_process=self._is_first(c), post_process=self._is_last(c),
                                share_embeddings_and_output_weights=False, vp_stage=c).to(device)
                       for c in range(self.shape.vpp)]
        self.named = [(global_name(n, self.shape.virtual_stage(self.coord.pp, c),
                                   self.layers_per_chunk), p)
                      for c, model in enumerate(self.models) for n, p in model.named_parameters()]
        if options.initial_state is not None:
            self._load(options.initial_state)
        params = [p for _, p in self.named]
        for p in params:  # every parameter takes part in the flat dp buffer
            p.grad = torch.zeros_like(p)
        self.optimizer = (torch.optim.SGD(params, lr=options.lr) if options.optimizer == "sgd"
                          else torch.optim.Adam(params, lr=options.lr))
        if options.first_iteration:
            self._resume(options.first_iteration)
        self.mask = megatron_compat.causal_mask(s.model.seq_len, device)
        self.positions = torch.arange(s.model.seq_len, device=device).expand(
            s.model.micro_batch_size, -1)
        self.text = TextData.load(s.data, s.model.vocab) if s.data.kind == "text" else None
        self.log = StepLog()
        self.iteration = 0
        self._saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self._flat: torch.Tensor | None = None
        self._norm_sq: torch.Tensor | None = None
        self._losses: dict[int, torch.Tensor] = {}  # this iteration's, by microbatch
        self.scope: Any = None  # a MegaScope session (``scope.attach_session``) or None

    def _task(self, phase: str, microbatch: int) -> Any:
        """Tell MegaScope which task runs (a forward hook inside a backward task
        is recomputation)."""
        return (self.scope.task(phase, self.iteration, microbatch) if self.scope is not None
                else nullcontext())

    def capture_handoff(self) -> None:
        if self.scope is not None:
            self.scope.capture_handoff()

    # -------------------------------------------------------------- layout
    def _is_first(self, chunk: int) -> bool:
        return self.shape.is_first(self.coord.pp, chunk)

    def _is_last(self, chunk: int) -> bool:
        return self.shape.is_last(self.coord.pp, chunk)

    def activation_buffer(self) -> torch.Tensor:
        """An empty boundary activation (or its gradient): (seq, batch, hidden)."""
        m = self.s.model
        return torch.empty(m.seq_len, m.micro_batch_size, m.hidden, device=self.device)

    def _load(self, state: Mapping[str, np.ndarray]) -> None:
        tp, tp_rank = self.topo.tp, self.coord.tp
        with torch.no_grad():
            for name, param in self.named:
                full = torch.as_tensor(np.asarray(state[name]))
                dim = partition_dim_of(param)
                param.copy_(full if dim is None else full.chunk(tp, dim=dim)[tp_rank])

    # -------------------------------------------------------- checkpoints
    def _shard(self, iteration: int) -> Path:
        """Checkpoints live in the run directory (``run_scenario`` insists on one)."""
        return shard_path(self.options.workdir or ".", iteration, self.coord.pp, self.coord.tp)

    def _resume(self, iteration: int) -> None:
        """Weights, optimizer state and random state as saved after ``iteration`` iterations."""
        state = load_shard(self._shard(iteration), iteration)
        with torch.no_grad():
            for name, param in self.named:
                param.copy_(state["weights"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])

    def _save_checkpoint(self) -> None:
        """After every ``checkpoint_every``-th iteration of the job: the first
        replica's ranks save their stage (the others hold the same state)."""
        every, done = self.options.checkpoint_every, self.job_iteration + 1
        if every is None or done % every or self.coord.dp != 0:
            return
        save_shard(self._shard(done), {
            "iteration": done, "weights": {n: p.detach().cpu() for n, p in self.named},
            "optimizer": self.optimizer.state_dict(), "rng": torch.get_rng_state()})
        if done > every:
            drop_shard(self._shard(done - every))

    @property
    def job_iteration(self) -> int:
        """This iteration's number in the whole job (a resumed run starts past 0)."""
        return self.options.first_iteration + self.iteration

    # ----------------------------------------------------------- protocol
    def start_iteration(self, iteration: int) -> None:
        self.iteration = iteration
        self.optimizer.zero_grad(set_to_none=False)
        self._flat, self._norm_sq = None, None

    def _tokens(self, microbatch: int) -> torch.Tensor:
        """(batch, seq_len + 1) ids of one global sample: inputs and shifted labels."""
        m = self.s.model
        sample = self.coord.dp * self.shape.microbatches + microbatch
        key = (self.s.seed, self.job_iteration, sample, m.micro_batch_size, m.seq_len + 1)
        ids = self.text.window(*key) if self.text else random_tokens(*key, m.vocab)
        return torch.from_numpy(ids).to(self.device)

    def forward(self, chunk: int, microbatch: int, x: Any) -> torch.Tensor:
        model, tokens = self.models[chunk], self._tokens(microbatch)
        inp = None
        if not self._is_first(chunk):
            inp = x.detach().requires_grad_()
            model.set_input_tensor(inp)
        labels = tokens[:, 1:] if self._is_last(chunk) else None
        with self._task("forward", microbatch):
            out = model(tokens[:, :-1], self.positions, self.mask, labels=labels)
        if self._is_last(chunk):
            loss = out.float().mean()
            self._losses[microbatch] = loss.detach()  # read at the step: no sync per microbatch
            out = loss / self.shape.microbatches
        self._saved[(chunk, microbatch)] = (inp, out)
        return out.detach()

    def backward(self, chunk: int, microbatch: int, grad: Any) -> torch.Tensor | None:
        inp, out = self._saved.pop((chunk, microbatch))
        with self._task("backward", microbatch):
            torch.autograd.backward(out, grad_tensors=None if self._is_last(chunk) else grad)
        return None if inp is None else inp.grad

    def grad_buffer(self) -> torch.Tensor:
        """This rank's gradients, flat, for the dp all-reduce (summed in place)."""
        self._flat = torch.cat([p.grad.reshape(-1) for _, p in self.named])
        return self._flat

    def param_buffer(self) -> torch.Tensor:
        """This rank's weights, flat, for a distributed optimizer's all-gather."""
        return torch.cat([p.detach().reshape(-1) for _, p in self.named])

    def load_param_buffer(self, flat: torch.Tensor | None) -> None:
        if flat is None:
            return
        offset = 0
        with torch.no_grad():
            for _, p in self.named:
                n = p.numel()
                p.copy_(flat[offset:offset + n].view_as(p))
                offset += n

    def _settle_grads(self) -> None:
        """Average an all-reduced flat buffer back into ``param.grad``."""
        if self._flat is None:
            return
        flat, self._flat = self._flat / self.topo.dp, None
        offset = 0
        for _, p in self.named:
            n = p.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n

    def grad_norm_sq(self) -> torch.Tensor:
        """Squared grad norm of this rank's share (TP-replicated params once)."""
        self._settle_grads()
        total = torch.zeros(1, device=self.device, dtype=torch.float64)
        for _, p in self.named:
            if partition_dim_of(p) is not None or self.coord.tp == 0:
                total += p.grad.double().pow(2).sum()
        self._norm_sq = total
        return total

    def optimizer_step(self) -> Report:
        """Step; reports the gradient norm and, on the last stage, the mean loss."""
        norm_sq = self._norm_sq if self._norm_sq is not None else self.grad_norm_sq()
        grad_norm = math.sqrt(float(norm_sq.item()))
        self.log.grad_norms[self.iteration] = grad_norm
        self._log_losses()
        losses = self.log.losses.get(self.iteration)
        report = {"grad_norm": grad_norm, **({"loss": fmean(losses.values())} if losses else {})}
        capture = self.options.capture_first_step and self.iteration == 0
        before = self._snapshot(lambda p: p) if capture else {}
        grads = self._snapshot(lambda p: p.grad) if capture else {}
        if self.scope is not None:
            self.scope.before_step(self.iteration)
        self.optimizer.step()
        if self.scope is not None:
            self.scope.after_step(self.iteration)
        self._save_checkpoint()
        if capture:
            self.log.capture = StepCapture(
                before, grads, self._snapshot(lambda p: p),
                {n: partition_dim_of(p) for n, p in self.named}, grad_norm)
        return Report(report)

    def _log_losses(self) -> None:
        """This iteration's microbatch losses, read back in one transfer."""
        if self._losses:
            values = torch.stack(list(self._losses.values())).tolist()
            self.log.losses[self.iteration] = dict(zip(self._losses, values))
            self._losses = {}

    def _snapshot(self, pick: Any) -> dict[str, np.ndarray]:
        return {n: pick(p).detach().cpu().numpy().copy() for n, p in self.named}
