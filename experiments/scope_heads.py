"""The attention heads of a trained checkpoint: where each head looks.

For windows of the checkpoint's training text, every head's attention
probabilities are averaged by key offset (0: the token itself, 1: the
previous token, ...), beside the first-token (sink) mass, the mass on
earlier occurrences of the query's own character, the mean largest weight
and the entropy.

    python -m experiments.scope_heads runs/scope_tiny [--windows 32]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from backends.torch.scope_generate import Probe, build_model, local_scenario, one_rank
from backends.torch.megatron_compat import causal_mask
from backends.torch.worker import quiet_megatron_warnings
from experiments import results
from megatronapp.scenario.checkpoint import read_checkpoint
from megatronapp.scenario.data import read_text
from megatronapp.scenario.scope_spec import Scope

OFFSETS = 4


def head_table(ckpt_dir: Path, windows: int, seed: int) -> list[dict[str, float]]:
    ckpt = read_checkpoint(ckpt_dir)
    if ckpt.vocab is None:
        raise SystemExit(f"{ckpt_dir}: trained on random tokens, no text to look at")
    seq = ckpt.model.seq_len
    ids = ckpt.vocab.encode(read_text(Path(ckpt.meta["data"]["path"])))
    starts = np.random.default_rng([seed, 41]).integers(0, len(ids) - seq, size=windows)
    with one_rank():
        model = build_model(local_scenario(ckpt, Scope(), seed), ckpt.state)
        probe = Probe(model)
        sums: dict[int, np.ndarray] = {}
        for start in starts:
            x = torch.from_numpy(ids[start:start + seq])[None]
            with torch.no_grad():
                model(x, torch.arange(seq)[None], causal_mask(seq))
            window = ids[start:start + seq]
            same = (window[None, :] == window[:, None]) & np.tri(seq, k=-1, dtype=bool)
            for layer, p in probe.attention().items():  # (heads, q, k)
                q = np.arange(seq)
                by_offset = [p[:, q[d:], q[d:] - d].mean(axis=1) for d in range(OFFSETS)]
                sink = p[:, 1:, 0].mean(axis=1)
                match = (p * same[None]).sum(-1)[:, 1:].mean(-1)
                top = p.max(-1).mean(-1)
                ent = -(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0)).sum(-1).mean(-1)
                row = np.stack([*by_offset, sink, match, top, ent], axis=1)
                sums[layer] = sums.get(layer, 0) + row
    table = []
    for layer in sorted(sums):
        for head, r in enumerate(sums[layer] / windows):
            table.append({"layer": layer, "head": head, **{f"offset{d}": r[d] for d in range(OFFSETS)},
                          "sink": r[OFFSETS], "same_char": r[OFFSETS + 1],
                          "max_weight": r[OFFSETS + 2], "entropy": r[OFFSETS + 3]})
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint directory or a run directory holding one")
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    results.results_dir_option(parser)
    args = parser.parse_args(argv)
    run = results.start("scope_heads", argv)
    quiet_megatron_warnings()
    path = Path(args.checkpoint)
    path = path / "checkpoint" if (path / "checkpoint").is_dir() else path
    table = head_table(path, args.windows, args.seed)
    head = ["layer", "head"] + ["self" if d == 0 else f"prev{d}" for d in range(OFFSETS)] + [
        "sink", "same char earlier", "largest weight", "entropy (nats)", "looks at"]
    print(f"attention mass by key offset, mean over {args.windows} windows of the training text")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in table:
        offs = [r[f"offset{d}"] for d in range(OFFSETS)]
        best = int(np.argmax(offs + [r["sink"]]))
        looks = ("sink" if best == OFFSETS else "itself" if best == 0 else
                 f"{best} back") + f" ({max(offs + [r['sink']]):.2f})"
        print(f"| {r['layer']} | {r['head']} | " + " | ".join(f"{v:.3f}" for v in offs)
              + f" | {r['sink']:.3f} | {r['same_char']:.3f} | {r['max_weight']:.3f} | "
              f"{r['entropy']:.2f} | {looks} |")
    heads = [{k: v if isinstance(v, int) else float(v) for k, v in r.items()} for r in table]
    recorded = run.record({"checkpoint": results.shown(path), "windows": args.windows,
                           "seed": args.seed, "heads": heads}, args.results_dir)
    print(f"wrote {recorded}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
