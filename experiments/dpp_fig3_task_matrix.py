"""Fig. 3 of the MegatronApp paper: the 8x8 (microbatch, chunk) task matrix
traversed depth-first (DFC) and breadth-first (BFC).

    .venv/bin/python -m experiments.dpp_fig3_task_matrix [--out runs/dpp_fig3.png]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib.pyplot as plt

from experiments import results

from megatronapp.dpp.plots import draw_traversal
from megatronapp.dpp.policies import breadth_first_traversal, depth_first_traversal

SIZE = 8  # 8 chunks x 8 microbatches = 64 tasks, as in the paper


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/dpp_fig3.png")
    results.results_dir_option(parser)
    args = parser.parse_args(argv)
    out, run = Path(args.out), results.start("dpp_fig3_task_matrix", argv)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, (dfc, bfc) = plt.subplots(1, 2, figsize=(13, 6.5))
    draw_traversal(dfc, depth_first_traversal(SIZE, SIZE), SIZE, SIZE,
                   "DFC: one microbatch through successive chunks")
    draw_traversal(bfc, breadth_first_traversal(SIZE, SIZE), SIZE, SIZE,
                   "BFC: many microbatches through one chunk")
    fig.suptitle("64 forward tasks i-j (microbatch i on chunk j), #k = visit order")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    recorded = run.record({"size": SIZE, "figures": [results.shown(out)]}, args.results_dir)
    print(f"wrote {recorded}")


if __name__ == "__main__":
    main()
