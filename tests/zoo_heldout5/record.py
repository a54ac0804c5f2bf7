"""Record the fifth held-out set: every job of ``tests/zoo_heldout5`` run
healthy (three times, one with ``record_shapes``) and once under each
fault, by the held-out recorder (``tests/zoo_heldout/record.py``: the same
launcher, faults, profiler settings and manifest), a slowed rank at 1.3x,
1.5x and 2x.

    python -m tests.zoo_heldout5.record [--out tests/data/heldout5] [--resume]
"""
from __future__ import annotations

import sys
from pathlib import Path

from tests.zoo_heldout import record
from tests.zoo_heldout.record import RING_DOWN, Channel, Job, Plan

# one ring message: the autoencoder's 70,160 gradients, flattened, in float32
MESSAGE = 70_160 * 4
JOBS = (
    Job("ddp_mobilenet"), Job("ddp_vit_cosine"), Job("ddp_distillation"),
    Job("ring_allreduce_autoencoder", (Channel("to next", RING_DOWN, MESSAGE),)),
)
# a tenth of the fault runs record shapes: the set stays near 12 MB
PLAN = Plan(JOBS, Path("tests/zoo_heldout5"), healthy=3, slowdowns=(1.3, 1.5, 2.0),
            shuffle_seed="heldout5", shapes_share=0.1)


def main(argv: list[str] | None = None) -> int:
    return record.main(argv, PLAN, record.ROOT / "tests" / "data" / "heldout5", __doc__)


if __name__ == "__main__":
    sys.exit(main())
