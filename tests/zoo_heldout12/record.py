"""Record the twelfth held-out set: every job of ``tests/zoo_heldout12``
run healthy (three times, one with ``record_shapes``) and once under each
fault, by the held-out recorder (``tests/zoo_heldout/record.py``: the same
launcher, faults, profiler settings and manifest), a slowed rank at 1.3x,
1.5x and 2x.

    python -m tests.zoo_heldout12.record [--out tests/data/heldout12] [--resume]
"""
from __future__ import annotations

import sys
from pathlib import Path

from tests.zoo_heldout import record
from tests.zoo_heldout.record import Channel, Job, Plan

# the two pipelines of two stages (rank = 2 x replica + stage): stage 0
# sends each microbatch's activations to stage 1 of its replica with
# dist.send, which sends their gradients back; one message is a
# microbatch's (64 samples x width 256, float32)
MESSAGE = 64 * 256 * 4
STAGE_PAIRS = ((0, 1), (2, 3))
JOBS = (
    Job("ddp_gradient_accumulation_clip_amp"), Job("all_to_all_embedding_shuffle"),
    Job("broadcast_from_leader_ema"),
    Job("pipeline_1f1b_send_recv_two_stage_dp2",
        (Channel("forward", STAGE_PAIRS, MESSAGE),
         Channel("backward", tuple((b, a) for a, b in STAGE_PAIRS), MESSAGE)),
        # both replicas of a stage slowed: no healthy rank would do its work
        exclusive=(frozenset({0, 2}), frozenset({1, 3}))),
)
# a tenth of the fault runs record shapes, as in the sixth to eleventh sets
PLAN = Plan(JOBS, Path("tests/zoo_heldout12"), healthy=3, slowdowns=(1.3, 1.5, 2.0),
            shuffle_seed="heldout12", shapes_share=0.1)


def main(argv: list[str] | None = None) -> int:
    return record.main(argv, PLAN, record.ROOT / "tests" / "data" / "heldout12", __doc__)


if __name__ == "__main__":
    sys.exit(main())
