"""Record the ninth held-out set: every job of ``tests/zoo_heldout9`` run
healthy (three times, one with ``record_shapes``) and once under each
fault, by the held-out recorder (``tests/zoo_heldout/record.py``: the same
launcher, faults, profiler settings and manifest), a slowed rank at 1.3x,
1.5x and 2x.

    python -m tests.zoo_heldout9.record [--out tests/data/heldout9] [--resume]
"""
from __future__ import annotations

import sys
from pathlib import Path

from tests.zoo_heldout import record
from tests.zoo_heldout.record import RING_DOWN, RING_UP, WORLD, Channel, Job, Plan

# the loop of the interleaved zero-bubble pipeline: activations go forward
# round the ring (rank 3 hands stage 3's output to rank 0's stage 4),
# gradients back; one message is a microbatch's (64 samples x width 256,
# float32)
MESSAGE = 64 * 256 * 4
JOBS = (
    Job("fsdp2_dcp_checkpoint"), Job("ddp_multitask_unused"), Job("rl_rollout_gather"),
    # the first stage (rank 0) reads the features, the last (rank 3) the labels
    Job("interleaved_zero_bubble_pipeline", (Channel("forward", RING_DOWN, MESSAGE),
                                             Channel("backward", RING_UP, MESSAGE)),
        readers=(0, WORLD - 1)),
)
# a tenth of the fault runs record shapes, as in the sixth to eighth sets
PLAN = Plan(JOBS, Path("tests/zoo_heldout9"), healthy=3, slowdowns=(1.3, 1.5, 2.0),
            shuffle_seed="heldout9", shapes_share=0.1)


def main(argv: list[str] | None = None) -> int:
    return record.main(argv, PLAN, record.ROOT / "tests" / "data" / "heldout9", __doc__)


if __name__ == "__main__":
    sys.exit(main())
