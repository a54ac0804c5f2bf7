"""Record the sixteenth held-out set: every job of ``tests/zoo_heldout16``
run healthy (three times, one with ``record_shapes``) and once under each
fault, by the held-out recorder (``tests/zoo_heldout/record.py``: the same
launcher, faults, profiler settings and manifest), a slowed rank at 1.3x,
1.5x and 2x.

    python -m tests.zoo_heldout16.record [--out tests/data/heldout16] [--resume]
"""
from __future__ import annotations

import sys
from pathlib import Path

from tests.zoo_heldout import record
from tests.zoo_heldout.record import Channel, Job, Plan

# the pipeline on ranks 1 -> 2 -> 3 fed by rank 0: the stages send each
# microbatch's activations on with dist.send, and their gradients back;
# the loader sends each microbatch's encoded features to the first stage
# (rank 1); one message of these is a microbatch's (128 samples x width
# 256, float32)
PIPELINE_MESSAGE = 128 * 256 * 4
CHAIN = ((1, 2), (2, 3))
# the loader sends each batch's labels to the last stage (rank 3): 512 int64
LABELS_MESSAGE = 512 * 8
JOBS = (
    Job("pipeline_three_stage_loader_rank_send_recv",
        (Channel("forward", CHAIN, PIPELINE_MESSAGE),
         Channel("backward", tuple((b, a) for a, b in CHAIN), PIPELINE_MESSAGE),
         Channel("feed", ((0, 1),), PIPELINE_MESSAGE),
         Channel("labels", ((0, 3),), LABELS_MESSAGE)),
        readers=(0,)),  # the loader rank alone reads data
    Job("ddp_sync_batchnorm_by_hand"),
    Job("sparse_moe_reduce_then_broadcast"),
    Job("kfac_factor_allreduce_inverse_broadcast"),
)
# a tenth of the fault runs record shapes, as in the sixth to fifteenth sets
PLAN = Plan(JOBS, Path("tests/zoo_heldout16"), healthy=3, slowdowns=(1.3, 1.5, 2.0),
            shuffle_seed="heldout16", shapes_share=0.1)


def main(argv: list[str] | None = None) -> int:
    return record.main(argv, PLAN, record.ROOT / "tests" / "data" / "heldout16", __doc__)


if __name__ == "__main__":
    sys.exit(main())
