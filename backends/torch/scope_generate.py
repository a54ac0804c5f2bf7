"""``megatronapp scope generate``: decode token by token with capture, in one process.

The checkpoint's full model is rebuilt as one megatron-core GPTModel stage
(tp = pp = 1, a one-rank gloo group in this process). Each step runs a full
forward over the current window (the last ``seq_len`` tokens; no KV cache):
the clean model's session captures the observed sites, a second copy runs
with the perturbations on the *same* prefix, and probes read every layer's
residual stream and attention probabilities for the PCA view, the attention
maps, KL and ‖Δh‖/‖h‖. The captures go to ``OUT/clean`` and ``OUT/perturbed``
(standard capture directories), the steps to ``OUT/generation.jsonl``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist

from megatronapp.scenario.checkpoint import Checkpoint
from megatronapp.scenario.config import Scenario, parse_scenario
from megatronapp.scenario.data import CharVocab, read_text
from megatronapp.errors import UserError
from megatronapp.scope.cost import model_shape
from megatronapp.scope.generate import (GenerationStep, PcaBasis, StepView, kl_divergence, pick,
                                        relative_change, softmax, top_k)
from megatronapp.scope.storage import merge_capture, record_tables
from megatronapp.scenario.scope_spec import PARAM_KINDS, Scope

from . import megatron_compat
from .launch import one_process_group
from .scope import RankPlace, ScopeSession, session_for
from .stages import partition_dim_of, transformer_config

REFERENCE_WINDOWS = 8  # windows of the training text in the PCA basis, beside the prompt


@contextlib.contextmanager
def one_rank() -> Iterator[None]:
    """A one-process gloo group and megatron's parallel state (tp = pp = 1)."""
    from megatron.core import parallel_state

    with contextlib.nullcontext() if dist.is_initialized() else one_process_group():
        megatron_compat.apply()
        reuse = parallel_state.model_parallel_is_initialized()  # a caller's one-rank state
        if not reuse:
            parallel_state.initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            if not reuse:
                parallel_state.destroy_model_parallel()


def local_scenario(ckpt: Checkpoint, scope: Scope, seed: int) -> Scenario:
    """The checkpoint's model on one rank, with the ``scope:`` section checked
    against it like any scenario (a pipeline perturbation is refused)."""
    s = parse_scenario({"seed": seed, "model": ckpt.model.model_dump(mode="json"),
                        "data": {"kind": "random"}, "scope": scope.model_dump(mode="json")})
    for i, p in enumerate(scope.perturb):
        if p.kind in PARAM_KINDS and p.step != 0:
            raise UserError(f"--perturb: perturbation {i}: generation has no optimizer step; "
                            f"a parameter perturbation acts at step 0 (got step {p.step})")
    return s


def _fresh_model(s: Scenario) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(s.seed)
    megatron_compat.seed_model_parallel_rng(s.seed, 0)
    return GPTModel(transformer_config(s), get_gpt_layer_local_spec(), vocab_size=s.model.vocab,
                    max_sequence_length=s.model.seq_len, pre_process=True, post_process=True,
                    share_embeddings_and_output_weights=False)


def initial_state(s: Scenario) -> dict[str, np.ndarray]:
    """The freshly initialised weights of the scenario's model (seeded)."""
    return {n: p.detach().numpy().copy() for n, p in _fresh_model(s).named_parameters()}


def build_model(s: Scenario, state: dict[str, np.ndarray]) -> Any:
    """One whole-model stage holding ``state`` (evaluation mode)."""
    model = _fresh_model(s)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(np.asarray(state[name])))
    return model.eval()


class Probe:
    """Every layer's output and attention probabilities of the last forward
    (hooked after the session's hooks, so it sees perturbed values)."""

    def __init__(self, model: Any):
        self.hidden: dict[int, torch.Tensor] = {}
        self.probs: dict[int, torch.Tensor] = {}
        for layer in model.decoder.layers:
            n = int(layer.layer_number)
            layer.register_forward_hook(lambda _m, _a, out, n=n: self._keep(self.hidden, n, out[0]))
            layer.self_attention.core_attention.scale_mask_softmax.register_forward_hook(
                lambda _m, _a, out, n=n: self._keep(self.probs, n, out))

    @staticmethod
    def _keep(into: dict[int, torch.Tensor], layer: int, t: torch.Tensor) -> None:
        into[layer] = t.detach()

    def states(self) -> dict[int, np.ndarray]:
        """layer -> (tokens, hidden) of sample 0."""
        return {n: h[:, 0].double().numpy() for n, h in sorted(self.hidden.items())}

    def attention(self) -> dict[int, np.ndarray]:
        return {n: p[0].double().numpy() for n, p in sorted(self.probs.items())}


@dataclass
class Runner:
    """One model, its session and probe."""

    model: Any
    session: ScopeSession
    probe: Probe

    def logits(self, ids: list[int], step: int) -> np.ndarray:
        from .megatron_compat import causal_mask

        x = torch.tensor([ids], dtype=torch.long)
        pos = torch.arange(len(ids))[None]
        with torch.no_grad(), self.session.task("forward", step, 0):
            out = self.model(x, pos, causal_mask(len(ids)))
        self.session.capture_handoff()
        return out[0, -1].double().numpy()

    def stats_rows(self) -> list[dict[str, Any]]:
        done, _ = record_tables(self.session.sink.last)  # type: ignore[union-attr]
        return [r for t in done for r in t.drop_columns(["step", "dp", "microbatch"]).to_pylist()]


def _runner(s: Scenario, state: dict[str, np.ndarray], scope: Scope, root: Path | None,
            name: str) -> Runner:
    model = build_model(s, state)
    place = RankPlace(0, 1, 0, 0, torch.device("cpu"))
    session = session_for(scope, model_shape(s), s.seed, place,
                          root / name if root is not None else None, live=False)
    session.attach(model, list(model.named_parameters()), partition_dim_of)
    session.start()
    return Runner(model, session, Probe(model))


def pca_basis(ckpt: Checkpoint, runner: Runner, prompt_ids: list[int], seed: int) -> PcaBasis:
    """Fit on every layer's states over the prompt and windows of the training
    text (when the checkpoint's text is readable and the same)."""
    seq = ckpt.model.seq_len
    windows = [prompt_ids[-seq:]]
    data = ckpt.meta.get("data", {})
    if ckpt.vocab is not None and data.get("path") and Path(data["path"]).is_file():
        ids = ckpt.vocab.encode(read_text(Path(data["path"])))
        rng = np.random.default_rng([seed, 31])
        for start in rng.integers(0, max(1, len(ids) - seq), size=REFERENCE_WINDOWS):
            windows.append([int(i) for i in ids[start:start + seq]])
    states = []
    for w in windows:
        with torch.no_grad():
            from .megatron_compat import causal_mask

            runner.model(torch.tensor([w]), torch.arange(len(w))[None], causal_mask(len(w)))
        states += list(runner.probe.states().values())
    return PcaBasis.fit(np.concatenate(states))


def _view(runner: Runner, logits: np.ndarray, vocab: CharVocab, k: int, temperature: float,
          rng: np.random.Generator, basis: PcaBasis) -> tuple[StepView, np.ndarray]:
    probs = softmax(logits)
    chosen = pick(probs, temperature, rng)
    states = runner.probe.states()
    view = StepView(chosen, vocab.decode([chosen]), float(probs[chosen]),
                    top_k(probs, k, vocab.decode), runner.probe.attention(),
                    {n: basis.project(h) for n, h in states.items()}, runner.stats_rows())
    return view, probs


def generate(ckpt: Checkpoint, prompt: str, tokens: int, scope: Scope, *, seed: int = 0,
             k: int = 5, temperature: float = 0.0, out: Path | None = None
             ) -> Iterator[GenerationStep]:
    """Decode ``tokens`` tokens after ``prompt``; yields one record per step.
    Must run inside ``one_rank()``."""
    if ckpt.vocab is None:
        raise UserError(f"CHECKPOINT: {ckpt.path}: no character vocabulary (trained on random "
                        "tokens)")
    ids = [int(i) for i in ckpt.vocab.encode(prompt)]
    if not ids:
        raise UserError("--prompt: empty")
    s = local_scenario(ckpt, scope, seed)
    clean = _runner(s, ckpt.state, scope.model_copy(update={"perturb": ()}), out, "clean")
    perturbed = (_runner(s, ckpt.state, scope, out, "perturbed") if scope.perturb else None)
    basis = pca_basis(ckpt, clean, ids, seed)
    rng = np.random.default_rng([seed, 37])
    finished = False
    try:
        for step in range(tokens):
            window = ids[-ckpt.model.seq_len:]
            view, p = _view(clean, clean.logits(window, step), ckpt.vocab, k, temperature, rng,
                            basis)
            record = GenerationStep(step, len(ids), window, view)
            if perturbed is not None:
                pview, q = _view(perturbed, perturbed.logits(window, step), ckpt.vocab, k,
                                 temperature, np.random.default_rng([seed, 37, step]), basis)
                h, hp = clean.probe.states(), perturbed.probe.states()
                record = GenerationStep(step, len(ids), window, view, pview, kl_divergence(p, q),
                                        {n: relative_change(h[n][-1], hp[n][-1]) for n in h})
            ids.append(view.token_id)
            yield record
        finished = True
    finally:
        for r in (clean, perturbed):
            if r is not None:
                r.session.close()
    # merged only once every step is done: a stopped generation's output is
    # thrown away, and merging it would make the stop as slow as the run was long
    if out is not None and finished:
        _merge(out, s, ckpt, prompt, basis, perturbed is not None)


def _merge(out: Path, s: Scenario, ckpt: Checkpoint, prompt: str, basis: PcaBasis,
           with_perturbed: bool) -> None:
    from safetensors.numpy import save_file

    scope = s.scope.model_dump(mode="json") if s.scope is not None else {}
    common = {"source": "generate", "scenario": "generate", "seed": s.seed,
              "model": s.model.model_dump(mode="json"), "checkpoint": str(ckpt.path),
              "prompt": prompt, "observe": scope.get("observe", [])}
    merge_capture(out / "clean", {**common, "perturb": []})
    if with_perturbed:
        merge_capture(out / "perturbed", {**common, "perturb": scope.get("perturb", [])})
    save_file({"mean": basis.mean, "axes": basis.axes, "explained": basis.explained},
              str(out / "pca.safetensors"))
