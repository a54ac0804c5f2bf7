"""Record the sixth held-out set: every job of ``tests/zoo_heldout6`` run
healthy (three times, one with ``record_shapes``) and once under each
fault, by the held-out recorder (``tests/zoo_heldout/record.py``: the same
launcher, faults, profiler settings and manifest), a slowed rank at 1.3x,
1.5x and 2x.

    python -m tests.zoo_heldout6.record [--out tests/data/heldout6] [--resume]
"""
from __future__ import annotations

import sys
from pathlib import Path

from tests.zoo_heldout import record
from tests.zoo_heldout.record import RING_DOWN, RING_UP, Channel, Job, Plan

# one ring message: a chunk's keys and values (2 x 4 documents x 64 tokens x
# width 128), in float32; their gradients travel back in messages as large
MESSAGE = 2 * 4 * 64 * 128 * 4
JOBS = (
    Job("ddp_wav2letter_ctc"), Job("ddp_powersgd_vgg"), Job("post_local_sgd_tcn"),
    Job("context_parallel_tagger", (Channel("forward", RING_DOWN, MESSAGE),
                                    Channel("backward", RING_UP, MESSAGE))),
)
# a tenth of the fault runs record shapes: the set stays near 12 MB
PLAN = Plan(JOBS, Path("tests/zoo_heldout6"), healthy=3, slowdowns=(1.3, 1.5, 2.0),
            shuffle_seed="heldout6", shapes_share=0.1)


def main(argv: list[str] | None = None) -> int:
    return record.main(argv, PLAN, record.ROOT / "tests" / "data" / "heldout6", __doc__)


if __name__ == "__main__":
    sys.exit(main())
