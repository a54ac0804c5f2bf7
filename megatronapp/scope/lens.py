"""The logit lens and activation patching: their results and math (no torch).

Logit lens: every layer's residual stream (entering each layer, and leaving
the last) goes through the final norm and the unembedding, as if the model
stopped there; per row and position the top-k next tokens, and the rank of
the token that really comes next (0: the lens's first choice).

Activation patching: a site's value at one layer and one position (or one
head) of the clean run is put into the corrupted run. The default metric is
the logit difference ``logit[clean answer] - logit[corrupted answer]`` at the
last position (averaged over a batch), normalised as TransformerLens's
tutorials do: ``(patched - corrupted) / (clean - corrupted)``, so 1 restores
the clean behaviour and 0 changes nothing; any other metric of the logits can
be given. Layers are block indices, counted from 0.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError
from ..io.outdirs import staged_outputs
from ..io.suggest import did_you_mean
from .generate import TopK, softmax, top_k
from .names import BLOCK_HOOKS, SHORT, TP_SPLIT

PATCH_SITES = ("resid_pre", "attn.out", "mlp.out")  # TransformerLens' "every block" patching
HEAD_SITES = ("attn.z",)  # per head: each head's output, at every position
PER = ("position", "head")


def patch_sites(text: str | None, per: str = "position") -> list[str]:
    """``--sites`` (comma-separated MegaScope or TransformerLens short names),
    checked before any model is loaded."""
    if per not in PER:
        raise UserError(f"--per: {per!r} is not one of {', '.join(PER)}")
    if text is None:
        return list(PATCH_SITES if per == "position" else HEAD_SITES)
    sites = [SHORT.get(s.strip(), s.strip()) for s in text.split(",")]
    choices = [c for c in BLOCK_HOOKS
               if per == "position" or TP_SPLIT.get(c, ("", 0))[0] == "heads"]
    for site in sites:
        if site not in choices:
            raise UserError(f"--sites: {site!r} cannot be patched per {per}"
                            f"{did_you_mean(site, choices)} (choose from {', '.join(choices)})")
    return sites


def next_token_ranks(logits: np.ndarray, ids: list[int]) -> np.ndarray:
    """(tokens, vocab) logits -> the rank of ``ids[p + 1]`` at each position p
    but the last (how many tokens score strictly higher)."""
    target = np.asarray(ids[1:])
    scores = logits[np.arange(len(target)), target]
    return (logits[:-1] > scores[:, None]).sum(axis=1)


@dataclass(frozen=True)
class LensResult:
    prompt: str
    tokens: list[str]
    rows: list[str]  # "resid_pre 0", ..., "resid_post L-1": where each row reads the stream
    top: list[list[list[TopK]]]  # row -> position -> the k most probable next tokens
    ranks: np.ndarray  # (rows, tokens - 1): rank of the next token

    @classmethod
    def of(cls, prompt: str, tokens: list[str], ids: list[int],
           logits: dict[str, np.ndarray], k: int, decode: Any) -> "LensResult":
        rows = list(logits)
        top = [[top_k(softmax(pos), k, decode) for pos in logits[r]] for r in rows]
        ranks = np.stack([next_token_ranks(logits[r], ids) for r in rows])
        return cls(prompt, tokens, rows, top, ranks)

    def mean_ranks(self) -> list[float]:
        """Per row, the next token's rank averaged over positions."""
        return [float(r.mean()) if r.size else float("nan") for r in self.ranks]

    def to_json(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "tokens": self.tokens, "rows": self.rows,
                "mean_rank": self.mean_ranks(), "rank": self.ranks.tolist(),
                "top": [[[t.__dict__ for t in pos] for pos in row] for row in self.top]}

    def lines(self) -> list[str]:
        """A table: one line per position, the lens's first choice per row,
        and the mean rank of the next token per row."""
        width = max(len(r) for r in self.rows) + 2
        head = "pos  token  next  " + "".join(r.ljust(width) for r in self.rows)
        out = [head]
        for p, token in enumerate(self.tokens):
            nxt = repr(self.tokens[p + 1]) if p + 1 < len(self.tokens) else ""
            cells = []
            for i, row in enumerate(self.top):
                rank = f" #{self.ranks[i, p]}" if p < self.ranks.shape[1] else ""
                cells.append(f"{row[p][0].token!r}{rank}".ljust(width))
            out.append(f"{p:3d}  {token!r:>5}  {nxt:>4}  " + "".join(cells))
        out.append("mean rank of the next token: " + "  ".join(
            f"{r} {m:.2f}" for r, m in zip(self.rows, self.mean_ranks())))
        return out


@dataclass(frozen=True)
class PatchResult:
    """The metric of the corrupted run with one piece of the clean run put in,
    per site, layer and position (``per="position"``) or head (``per="head"``:
    the head at every position)."""

    clean: str
    corrupt: str
    tokens: list[str]  # the corrupted prompt's
    answers: tuple[str, str]  # clean, corrupted ("" when a custom metric decides)
    sites: list[str]
    layers: list[int]
    restored: np.ndarray  # (sites, layers, positions or heads): the metric
    per: str = "position"
    metric: str = "restored logit difference (1: clean, 0: corrupted)"

    def columns(self) -> list[str]:
        if self.per == "head":
            return [f"head {h}" for h in range(self.restored.shape[2])]
        return [repr(t) for t in self.tokens]

    def to_json(self) -> dict[str, Any]:
        return {"clean": self.clean, "corrupt": self.corrupt, "tokens": self.tokens,
                "answers": list(self.answers), "sites": self.sites, "layers": self.layers,
                "restored": self.restored.tolist(), "per": self.per, "metric": self.metric}

    def lines(self) -> list[str]:
        said = (f"clean {self.clean!r} -> {self.answers[0]!r}, corrupted {self.corrupt!r} -> "
                f"{self.answers[1]!r}" if any(self.answers)
                else f"clean {self.clean!r}, corrupted {self.corrupt!r}")
        out = [f"{said}; {self.metric}",
               "site       layer  " + " ".join(f"{c:>6}" for c in self.columns())]
        for s, site in enumerate(self.sites):
            for n, layer in enumerate(self.layers):
                out.append(f"{site:<10} {layer:5d}  "
                           + " ".join(f"{v:6.2f}" for v in self.restored[s, n]))
        return out

    def plot(self, path: Path) -> None:
        """One heat map per site: layers down, positions (or heads) across."""
        from matplotlib.figure import Figure  # no pyplot: no global figure registry

        from ..trace.timeline import save

        columns = self.columns()
        fig = Figure(figsize=(max(6.0, 0.35 * len(columns) + 2),
                              1.2 + 1.0 * len(self.sites) * len(self.layers) ** 0.5))
        axes = fig.subplots(len(self.sites), 1, squeeze=False)
        for ax, site, grid in zip(axes[:, 0], self.sites, self.restored):
            im = ax.imshow(grid, cmap="RdBu", vmin=-1, vmax=1, aspect="auto")
            ax.set_title(f"{site}: {self.metric}")
            ax.set_ylabel("layer (block index)")
            ax.set_yticks(range(len(self.layers)), [str(n) for n in self.layers])
            ax.set_xticks(range(len(columns)), columns, fontsize=7)
            ax.set_xlabel("head" if self.per == "head" else "position (corrupted prompt)")
            fig.colorbar(im, ax=ax, label="metric")
        fig.tight_layout()
        save(fig, path)


def through_final_norm(components: np.ndarray, final: np.ndarray, weight: np.ndarray,
                       eps: float, direction: np.ndarray) -> np.ndarray:
    """Each component (..., hidden) of the final residual stream ``final``
    (hidden,) onto ``direction`` (an unembedding difference) as the final
    LayerNorm passes it: centred, divided by the whole stream's scale (held
    fixed, as TransformerLens does), times the norm's weight. Summed over the
    components of the stream, plus the norm's bias onto ``direction``, this is
    the logit difference itself."""
    scale = np.sqrt(final.var() + eps)
    centred = components - components.mean(axis=-1, keepdims=True)
    return np.asarray(centred / scale @ (weight * direction))


@dataclass(frozen=True)
class DlaResult:
    """Direct logit attribution at the prompt's last position: what each
    head (and each other part of the residual stream) adds to ``logit[answer]
    - logit[baseline]`` through the final norm and the unembedding."""

    prompt: str
    tokens: list[str]
    answers: tuple[str, str]  # the answer, the baseline
    layers: list[int]
    heads: np.ndarray  # (layers, heads)
    parts: dict[str, Any]  # embed, attn_bias [layer], mlp [layer], norm_bias: the rest
    logit_diff: float  # the model's own

    def to_json(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "tokens": self.tokens, "answers": list(self.answers),
                "layers": self.layers, "heads": self.heads.tolist(),
                **{k: v.tolist() if isinstance(v, np.ndarray) else v
                   for k, v in self.parts.items()}, "logit_diff": self.logit_diff}

    def lines(self) -> list[str]:
        a, b = self.answers
        out = [f"{self.prompt!r}: logit[{a!r}] - logit[{b!r}] = {self.logit_diff:.4f}; "
               "each head's direct share",
               "layer  " + " ".join(f"{'head ' + str(h):>8}" for h in range(self.heads.shape[1]))]
        out += [f"{n:5d}  " + " ".join(f"{v:8.4f}" for v in row)
                for n, row in zip(self.layers, self.heads)]
        rest = self.parts
        out.append(f"embedding {rest['embed']:.4f}, attention biases "
                   f"{float(np.sum(rest['attn_bias'])):.4f}, MLPs {float(np.sum(rest['mlp'])):.4f},"
                   f" final norm's bias {rest['norm_bias']:.4f}")
        return out


def restored(patched: np.ndarray, clean: float, corrupt: float) -> np.ndarray:
    """TransformerLens' normalisation of a logit difference."""
    if np.isclose(clean, corrupt):
        raise UserError("--corrupt: the clean and corrupted prompts give the same logit "
                        "difference; nothing to restore (pick prompts, or answers, that differ)")
    return (patched - corrupt) / (clean - corrupt)


def result_name(kind: str, *texts: str) -> str:
    """A file name per input (the same prompts name the same result)."""
    digest = hashlib.sha256("\0".join(texts).encode()).hexdigest()[:12]
    return f"{kind}-{digest}"


def save(capture_dir: Path, name: str, record: dict[str, Any], force: bool,
         plot: Any = None) -> list[Path]:
    """``name``.json (and ``name``.png drawn by ``plot``) beside the capture,
    all or nothing, never over a file megatronapp did not write."""
    with staged_outputs(capture_dir, "RUN_DIR", force) as folder:
        (folder / f"{name}.json").write_text(json.dumps(record, indent=1))
        if plot is not None:
            plot(folder / f"{name}.png")
    return [capture_dir / f"{name}.json", *([capture_dir / f"{name}.png"] if plot else [])]
