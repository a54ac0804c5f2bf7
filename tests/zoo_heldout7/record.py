"""Record the seventh held-out set: every job of ``tests/zoo_heldout7``
run healthy (three times, one with ``record_shapes``) and once under each
fault, by the held-out recorder (``tests/zoo_heldout/record.py``: the same
launcher, faults, profiler settings and manifest), a slowed rank at 1.3x,
1.5x and 2x.

    python -m tests.zoo_heldout7.record [--out tests/data/heldout7] [--resume]
"""
from __future__ import annotations

import sys
from pathlib import Path

from tests.zoo_heldout import record
from tests.zoo_heldout.record import WORLD, Channel, Job, Plan

# the V of the zero-bubble pipeline: between neighbouring ranks both ways,
# each way activations of one stage and gradients of another; one message
# is a microbatch's (96 samples x width 512, float32)
MESSAGE = 96 * 512 * 4
DOWN = tuple((r, r + 1) for r in range(WORLD - 1))
UP = tuple((b, a) for a, b in DOWN)
JOBS = (
    Job("tensor_parallel_mlp"), Job("hsdp_checkpointed_convnext"), Job("ddp_join_textcnn"),
    Job("zero_bubble_pipeline", (Channel("down", DOWN, MESSAGE), Channel("up", UP, MESSAGE)),
        readers=(0,)),
)
# a tenth of the fault runs record shapes, as in the sixth set
PLAN = Plan(JOBS, Path("tests/zoo_heldout7"), healthy=3, slowdowns=(1.3, 1.5, 2.0),
            shuffle_seed="heldout7", shapes_share=0.1)


def main(argv: list[str] | None = None) -> int:
    return record.main(argv, PLAN, record.ROOT / "tests" / "data" / "heldout7", __doc__)


if __name__ == "__main__":
    sys.exit(main())
