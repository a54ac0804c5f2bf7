"""Fig. 3 of the MegatronApp paper: the 8x8 (microbatch, chunk) task matrix
traversed depth-first (DFC) and breadth-first (BFC).

    .venv/bin/python paper_figs/dpp_fig3_task_matrix.py [--out paper_figs/out/dpp_fig3.png]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib.pyplot as plt

from megatronapp.dpp.plots import draw_traversal
from megatronapp.dpp.policies import breadth_first_traversal, depth_first_traversal

SIZE = 8  # 8 chunks x 8 microbatches = 64 tasks, as in the paper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="paper_figs/out/dpp_fig3.png")
    out = Path(parser.parse_args().out)
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


if __name__ == "__main__":
    main()
