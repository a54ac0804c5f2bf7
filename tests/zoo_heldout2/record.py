"""Record the second held-out set: every job of ``tests/zoo_heldout2``
run healthy (three times, one with ``record_shapes``) and once under each
fault, by the held-out recorder (``tests/zoo_heldout/record.py``: the same
launcher, faults, profiler settings and manifest), with a slowed rank at
1.3x besides 1.5x and 2x.

    python -m tests.zoo_heldout2.record [--out tests/data/heldout2] [--resume]
"""
from __future__ import annotations

import sys
from pathlib import Path

from tests.zoo_heldout import record
from tests.zoo_heldout.record import RING_DOWN, RING_UP, Channel, Job, Plan

MESSAGE = 64 * 512 * 4  # one microbatch's activations (or gradients): 64 x 512 floats
JOBS = (
    Job("ddp_lstm_lm"), Job("ddp_resnet_bn"), Job("ddp_vae"), Job("ddp_embedding_bag"),
    Job("interleaved_pipeline", (Channel("forward", RING_DOWN, MESSAGE),
                                 Channel("backward", RING_UP, MESSAGE))),
)
# a fifth of the fault runs record shapes (not a third): the set stays within 15 MB
PLAN = Plan(JOBS, Path("tests/zoo_heldout2"), healthy=3, slowdowns=(1.3, 1.5, 2.0),
            shuffle_seed="heldout2", shapes_share=0.2)


def main(argv: list[str] | None = None) -> int:
    return record.main(argv, PLAN, record.ROOT / "tests" / "data" / "heldout2", __doc__)


if __name__ == "__main__":
    sys.exit(main())
