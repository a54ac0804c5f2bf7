"""Record the tenth held-out set: every job of ``tests/zoo_heldout10`` run
healthy (three times, one with ``record_shapes``) and once under each
fault, by the held-out recorder (``tests/zoo_heldout/record.py``: the same
launcher, faults, profiler settings and manifest), a slowed rank at 1.3x,
1.5x and 2x.

    python -m tests.zoo_heldout10.record [--out tests/data/heldout10] [--resume]
"""
from __future__ import annotations

import sys
from pathlib import Path

from tests.zoo_heldout import record
from tests.zoo_heldout.record import Channel, Job, Plan

# the two pipelines of the 2 x 2 mesh (rank = 2 x replica + stage): stage 0
# hands each microbatch's activations to stage 1 of its replica, which sends
# their gradients back; one message is a microbatch's (64 samples x width
# 256, float32)
MESSAGE = 64 * 256 * 4
FORWARD = ((0, 1), (2, 3))
JOBS = (
    Job("pipelining_gpipe_dp2", (Channel("forward", FORWARD, MESSAGE),
                                 Channel("backward", tuple((b, a) for a, b in FORWARD),
                                         MESSAGE)),
        # both replicas of a stage slowed: no healthy rank would do its work
        exclusive=(frozenset({0, 2}), frozenset({1, 3}))),
    Job("tp_dp_2d_mesh"),
    # rank 0 reads every batch and scatters the shards
    Job("scatter_fed_ddp", readers=(0,)),
    Job("ddp_checkpointed_encoder_static"),
)
# a tenth of the fault runs record shapes, as in the sixth to ninth sets
PLAN = Plan(JOBS, Path("tests/zoo_heldout10"), healthy=3, slowdowns=(1.3, 1.5, 2.0),
            shuffle_seed="heldout10", shapes_share=0.1)


def main(argv: list[str] | None = None) -> int:
    return record.main(argv, PLAN, record.ROOT / "tests" / "data" / "heldout10", __doc__)


if __name__ == "__main__":
    sys.exit(main())
