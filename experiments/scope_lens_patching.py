"""The standard analyses on the tiny trained model: the logit lens's rank of the
next character, layer by layer; activation patching on prompt pairs that
differ in one character (the heat map in docs/img/); each head's direct
logit attribution.

    megatronapp run scenarios/scope_tiny.yaml --backend torch --out runs/scope_tiny
    python -m experiments.scope_lens_patching runs/scope_tiny [--pp 2] [--tp 2]

Writes docs/img/scope-patching-heatmap.png and experiments/data/scope_lens_patching.json.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from backends.torch.scope_hooked import HookedModel, load
from backends.torch.scope_lens import (activation_patching,
                                       direct_logit_attribution, logit_lens)
from experiments import results
from megatronapp.errors import UserError
from megatronapp.scope.lens import PatchResult

ROOT = Path(__file__).resolve().parents[1]
PROSE = ["If the value of the expression is true", "The return statement leaves the function",
         "This is the default behaviour of the list"]
# one character apart; the first pairs whose answers differ are patched
PAIRS = [("is an", "is on"), ("the value", "the valve"), ("a list", "a last"),
         ("in the list", "in the lisp"), ("x = 1", "x + 1"), ("is true", "is trie")]


def lens_rows(model: HookedModel) -> list[dict[str, Any]]:
    rows = []
    for prompt in PROSE:
        lens = logit_lens(model, prompt, 3)
        rows.append({"prompt": prompt, "rows": lens.rows, "mean_rank": lens.mean_ranks()})
        print(f"{prompt!r}: mean rank of the next character "
              + " -> ".join(f"{r} {m:.2f}" for r, m in zip(lens.rows, lens.mean_ranks())))
    return rows


def patched(model: HookedModel, pairs: int) -> list[PatchResult]:
    found = []
    for clean, corrupt in PAIRS:
        try:
            found.append(activation_patching(model, clean, corrupt))
        except UserError as err:  # both prompts lead to the same answer
            print(f"{clean!r} / {corrupt!r}: {err}")
            continue
        print("\n".join(found[-1].lines()))
        if len(found) == pairs:
            break
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a run directory of scenarios/scope_tiny.yaml")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    parser.add_argument("--pairs", type=int, default=2, help="prompt pairs to patch (default 2)")
    parser.add_argument("--image",
                        default=str(ROOT / "docs" / "img" / "scope-patching-heatmap.png"))
    parser.add_argument("--data", default=str(ROOT / "experiments" / "data" /
                                              "scope_lens_patching.json"))
    results.results_dir_option(parser)
    args = parser.parse_args(argv)
    experiment = results.start("scope_lens_patching", argv)
    with load(args.run, args.pp, args.tp) as model:
        lens = lens_rows(model)
        patches = patched(model, args.pairs)
        if not patches:
            raise SystemExit("no prompt pair with different answers")
        dla = direct_logit_attribution(model, PROSE[0])
    patches[0].plot(Path(args.image))
    print("\n".join(dla.lines()))
    data = {"run": args.run, "pp": args.pp, "tp": args.tp, "lens": lens,
            "patching": [p.to_json() for p in patches], "dla": dla.to_json()}
    Path(args.data).write_text(json.dumps(data, indent=1))
    print(f"wrote {args.image}, {args.data}")
    recorded = experiment.record({**data, "image": results.shown(args.image)}, args.results_dir)
    print(f"wrote {recorded}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
