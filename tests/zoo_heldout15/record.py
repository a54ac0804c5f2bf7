"""Record the fifteenth held-out set: every job of ``tests/zoo_heldout15``
run healthy (three times, one with ``record_shapes``) and once under each
fault, by the held-out recorder (``tests/zoo_heldout/record.py``: the same
launcher, faults, profiler settings and manifest), a slowed rank at 1.3x,
1.5x and 2x.

    python -m tests.zoo_heldout15.record [--out tests/data/heldout15] [--resume]
"""
from __future__ import annotations

import sys
from pathlib import Path

from tests.zoo_heldout import record
from tests.zoo_heldout.record import Channel, Job, Plan

# the two GPipe pipelines of two stages (rank = 2 x replica + stage): stage
# 0 sends each microbatch's activations to stage 1 of its replica with
# dist.isend, which sends their gradients back; one message is a
# microbatch's (64 samples x width 256, float32)
PIPELINE_MESSAGE = 64 * 256 * 4
STAGE_PAIRS = ((0, 1), (2, 3))
# the two-level all-reduce: the pairs' leaders, ranks 0 and 2, swap their
# pairs' sums with dist.send and dist.recv; one message is every gradient
# of the classifier (64 -> 192, two blocks 192 -> 384 -> 192 with their
# LayerNorms, a LayerNorm, 192 -> 16), float32
LEADERS_MESSAGE = (64 * 192 + 192 + 2 * (2 * 192 + 2 * 192 * 384 + 384 + 192)
                   + 2 * 192 + 192 * 16 + 16) * 4
JOBS = (
    Job("pipeline_two_stage_dp2_isend_irecv_gpipe_activation_checkpoint",
        (Channel("forward", STAGE_PAIRS, PIPELINE_MESSAGE),
         Channel("backward", tuple((b, a) for a, b in STAGE_PAIRS), PIPELINE_MESSAGE)),
        # both replicas of a stage slowed: no healthy rank would do its work
        exclusive=(frozenset({0, 2}), frozenset({1, 3}))),
    Job("ddp_gradient_bucket_view_adamw_warmup"),
    Job("topk_sparsified_allgather_error_feedback"),
    Job("hierarchical_allreduce_two_level",
        (Channel("leaders", ((0, 2), (2, 0)), LEADERS_MESSAGE),)),
)
# a tenth of the fault runs record shapes, as in the sixth to fourteenth sets
PLAN = Plan(JOBS, Path("tests/zoo_heldout15"), healthy=3, slowdowns=(1.3, 1.5, 2.0),
            shuffle_seed="heldout15", shapes_share=0.1)


def main(argv: list[str] | None = None) -> int:
    return record.main(argv, PLAN, record.ROOT / "tests" / "data" / "heldout15", __doc__)


if __name__ == "__main__":
    sys.exit(main())
