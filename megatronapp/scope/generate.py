"""Generation with capture: the per-step record a view streams, and its math.

``GenerationStep`` is what one decoding step yields: the chosen token with
its probability and the top-k alternatives, the attention probabilities of
the observed layers, the step's reduced statistics (long rows, as in a
capture), the hidden states of every layer projected on one fixed PCA basis
and, when a perturbation runs beside the clean model on the same prefix, the
perturbed model's view, the KL divergence KL(clean || perturbed) of the two
next-token distributions and, per layer, ‖h_perturbed − h_clean‖ / ‖h_clean‖
of the last token's residual stream. Nothing here needs torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

EPS = 1e-30


@dataclass(frozen=True)
class TopK:
    token_id: int
    token: str
    prob: float


@dataclass(frozen=True)
class PcaBasis:
    """Mean and two principal axes of hidden states (every layer, a reference
    text plus the prompt): one basis, so coordinates compare across layers
    and steps."""

    mean: np.ndarray  # (hidden,)
    axes: np.ndarray  # (2, hidden), orthonormal rows
    explained: np.ndarray  # (2,) share of variance of each axis

    @classmethod
    def fit(cls, states: np.ndarray) -> "PcaBasis":
        x = np.asarray(states, dtype=np.float64).reshape(-1, states.shape[-1])
        mean = x.mean(axis=0)
        _, s, vt = np.linalg.svd(x - mean, full_matrices=False)
        var = s ** 2
        axes = vt[:2]
        axes = axes * np.where(axes.sum(axis=1, keepdims=True) < 0, -1.0, 1.0)  # a fixed sign
        return cls(mean, axes, var[:2] / max(float(var.sum()), EPS))

    def project(self, states: np.ndarray) -> np.ndarray:
        """(..., hidden) -> (..., 2)."""
        return (np.asarray(states, dtype=np.float64) - self.mean) @ self.axes.T


@dataclass(frozen=True)
class StepView:
    """One model's view of a decoding step."""

    token_id: int  # the next token this model picks (greedy, or sampled)
    token: str
    prob: float
    topk: list[TopK]
    attention: dict[int, np.ndarray]  # layer -> (heads, query, key) over the current window
    pca: dict[int, np.ndarray]  # layer -> (tokens, 2): every token of the window
    stats: list[dict[str, Any]]  # long rows: layer, site, head, token, stat, index, value

    def header(self) -> dict[str, Any]:
        return {"token_id": self.token_id, "token": self.token, "prob": self.prob,
                "topk": [t.__dict__ for t in self.topk]}


@dataclass(frozen=True)
class GenerationStep:
    step: int
    position: int  # index of the predicted token in the whole text
    window: list[int]  # token ids the model saw (the last seq_len of the text)
    clean: StepView
    perturbed: StepView | None = None
    kl: float | None = None
    delta_h: dict[int, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able record (arrays as nested lists): one line of generation.jsonl."""
        def view(v: StepView) -> dict[str, Any]:
            return {**v.header(), "pca": {str(k): a.round(6).tolist() for k, a in v.pca.items()}}

        out: dict[str, Any] = {"step": self.step, "position": self.position,
                               "clean": view(self.clean)}
        if self.perturbed is not None:
            out.update(perturbed=view(self.perturbed), kl=self.kl,
                       delta_h={str(k): v for k, v in self.delta_h.items()})
        return out

    def arrays(self) -> dict[str, np.ndarray]:
        """Every array of the step by name (for binary frames or safetensors)."""
        out = {}
        for name, v in (("clean", self.clean), ("perturbed", self.perturbed)):
            if v is None:
                continue
            for layer, a in v.attention.items():
                out[f"{name}/attention/layer{layer}"] = a
            for layer, a in v.pca.items():
                out[f"{name}/pca/layer{layer}"] = a
        return out


def softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max()
    e = np.exp(z)
    return e / e.sum()


def kl_divergence(p: np.ndarray, q: np.ndarray) -> float:
    """KL(p || q) in nats; q's zeros where p > 0 count as a floor of 1e-30."""
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    mask = p > 0
    return float(np.sum(p[mask] * (np.log(p[mask]) - np.log(np.maximum(q[mask], EPS)))))


def relative_change(clean: np.ndarray, perturbed: np.ndarray) -> float:
    """‖perturbed − clean‖ / ‖clean‖."""
    clean = np.asarray(clean, dtype=np.float64)
    return float(np.linalg.norm(np.asarray(perturbed, np.float64) - clean)) / max(
        float(np.linalg.norm(clean)), EPS)


def top_k(probs: np.ndarray, k: int, decode: Any) -> list[TopK]:
    """The k most probable ids (ties: lower id first)."""
    order = np.lexsort((np.arange(len(probs)), -probs))[:k]
    return [TopK(int(i), decode([int(i)]), float(probs[i])) for i in order]


def pick(probs: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    """Greedy at temperature 0, else a draw from probs^(1/T)."""
    if temperature <= 0:
        return int(np.lexsort((np.arange(len(probs)), -probs))[0])
    w = np.power(np.maximum(probs, EPS), 1.0 / temperature)
    return int(rng.choice(len(w), p=w / w.sum()))


def pixel_block(channels: int, pixels: int = 16) -> int:
    """A block size giving about ``pixels`` pooled values across ``channels``."""
    block = max(1, channels // pixels)
    while channels % block:
        block -= 1
    return block


def default_observe(hidden: int, heads: int, ffn: int) -> list[dict[str, Any]]:
    """What ``scope generate`` observes unless told otherwise: pooled pixels of
    Q, K, V, the MLP and the residual stream, and the attention statistics."""
    head_dim = hidden // heads
    value_sites = {"attn.q": head_dim, "attn.k": head_dim, "attn.v": head_dim,
                   "mlp.post": ffn, "mlp.out": hidden, "resid_post": hidden}
    observe = [{"site": site, "stats": ["mean", "std", "absmax",
                                        f"pixels_absmax({pixel_block(c)})"]}
               for site, c in value_sites.items()]
    observe.append({"site": "attn.probs", "stats": ["entropy", "prev_token_mass", "sink_mass"]})
    return observe
