"""Record the eleventh held-out set: every job of ``tests/zoo_heldout11``
run healthy (three times, one with ``record_shapes``) and once under each
fault, by the held-out recorder (``tests/zoo_heldout/record.py``: the same
launcher, faults, profiler settings and manifest), a slowed rank at 1.3x,
1.5x and 2x.

    python -m tests.zoo_heldout11.record [--out tests/data/heldout11] [--resume]
"""
from __future__ import annotations

import sys
from pathlib import Path

from tests.zoo_heldout import record
from tests.zoo_heldout.record import CHAIN_DOWN, WORLD, Channel, Job, Plan

# the four-stage pipeline (rank r is stage r): each stage hands a
# microbatch's activations to the next, which sends their gradients back;
# one message is a microbatch's (64 samples x width 256, float32)
MESSAGE = 64 * 256 * 4
JOBS = (
    Job("diloco_outer_nesterov"), Job("ulysses_sequence_parallel"),
    Job("manual_zero2_reduce_scatter"),
    # the first stage (rank 0) reads the features, the last (rank 3) the labels
    Job("batched_p2p_pipeline", (Channel("forward", CHAIN_DOWN, MESSAGE),
                                 Channel("backward", tuple((b, a) for a, b in CHAIN_DOWN),
                                         MESSAGE)),
        readers=(0, WORLD - 1)),
)
# a tenth of the fault runs record shapes, as in the sixth to tenth sets
PLAN = Plan(JOBS, Path("tests/zoo_heldout11"), healthy=3, slowdowns=(1.3, 1.5, 2.0),
            shuffle_seed="heldout11", shapes_share=0.1)


def main(argv: list[str] | None = None) -> int:
    return record.main(argv, PLAN, record.ROOT / "tests" / "data" / "heldout11", __doc__)


if __name__ == "__main__":
    sys.exit(main())
