"""Record the twenty-first held-out set: every job of ``tests/zoo_heldout21``
run healthy (three times, one with ``record_shapes``) and once under each
fault, by the held-out recorder (``tests/zoo_heldout/record.py``: the same
launcher, faults, profiler settings and manifest), a slowed rank at 1.3x,
1.5x and 2x, with 12 traced iterations a run (``ProfilerStep#2`` to
``#13``), as in the nineteenth and twentieth sets.

    python -m tests.zoo_heldout21.record [--out tests/data/heldout21] [--resume]
"""
from __future__ import annotations

import sys
from pathlib import Path

from tests.zoo_heldout import record
from tests.zoo_heldout.record import CHAIN_DOWN, Channel, Job, Plan

# the double binary trees' links: a child sends its half of the gradients
# (or its subtree's sum of them) up to its parent, a parent the whole sum
# down to its children; the first tree 0 -> 2 -> {1, 3}, the second its
# mirror 3 -> 1 -> {2, 0}; one message is half the MLP-Mixer's gradients
# (70,421 floats, float32)
TREE_MESSAGE = 70_421 * 4
TREES_UP = ((2, 0), (1, 2), (3, 2), (1, 3), (2, 1), (0, 1))
TREES_DOWN = ((0, 2), (2, 1), (2, 3), (3, 1), (1, 2), (1, 0))
# the conservative PINN's links: each rank's u and flux at the 1,024
# points of an interface, sent to the neighbour across it (float32)
INTERFACE_MESSAGE = 2 * 1024 * 4
JOBS = (
    Job("double_binary_tree_allreduce_mixer_send_recv",
        (Channel("reduce", TREES_UP, TREE_MESSAGE),
         Channel("broadcast", TREES_DOWN, TREE_MESSAGE))),
    Job("cpinn_burgers_domain_decomposition_interface_send_recv",
        (Channel("rightward", CHAIN_DOWN, INTERFACE_MESSAGE),
         Channel("leftward", tuple((b, a) for a, b in CHAIN_DOWN), INTERFACE_MESSAGE))),
    Job("maml_sine_regression_second_order_vmap_allreduce"),
    Job("svgd_bayesian_mlp_particles_allgather"),
)
# a tenth of the fault runs record shapes, as in the sixth to twentieth sets
PLAN = Plan(JOBS, Path("tests/zoo_heldout21"), healthy=3, slowdowns=(1.3, 1.5, 2.0),
            shuffle_seed="heldout21", shapes_share=0.1, steps=12)


def main(argv: list[str] | None = None) -> int:
    return record.main(argv, PLAN, record.ROOT / "tests" / "data" / "heldout21", __doc__)


if __name__ == "__main__":
    sys.exit(main())
