"""Record the seventeenth held-out set: every job of ``tests/zoo_heldout17``
run healthy (three times, one with ``record_shapes``) and once under each
fault, by the held-out recorder (``tests/zoo_heldout/record.py``: the same
launcher, faults, profiler settings and manifest), a slowed rank at 1.3x,
1.5x and 2x.

    python -m tests.zoo_heldout17.record [--out tests/data/heldout17] [--resume]
"""
from __future__ import annotations

import sys
from pathlib import Path

from tests.zoo_heldout import record
from tests.zoo_heldout.record import Channel, Job, Plan

# the pipeline of two tensor-parallel stages (stage = rank // 2): each rank
# of the first stage sends its half of a microbatch's activations to the
# rank of the same tensor-parallel index in the second (dist.isend), which
# sends its half of their gradients back; one message is half a
# microbatch's (32 samples x width 512 / 2, float32)
PIPELINE_MESSAGE = 32 * 512 // 2 * 4
STAGE_PAIRS = ((0, 2), (1, 3))
JOBS = (
    Job("pipeline_tp2_pp2_scatter_gather_1f1b",
        (Channel("forward", STAGE_PAIRS, PIPELINE_MESSAGE),
         Channel("backward", tuple((b, a) for a, b in STAGE_PAIRS), PIPELINE_MESSAGE)),
        # both ranks of a stage slowed: no healthy rank would do its work
        exclusive=(frozenset({0, 1}), frozenset({2, 3}))),
    Job("clip_contrastive_gather_with_grad"),
    Job("word2vec_sgns_sparse_ddp"),
    Job("lbfgs_lstm_sine_waves_ddp"),
)
# a tenth of the fault runs record shapes, as in the sixth to sixteenth sets
PLAN = Plan(JOBS, Path("tests/zoo_heldout17"), healthy=3, slowdowns=(1.3, 1.5, 2.0),
            shuffle_seed="heldout17", shapes_share=0.1)


def main(argv: list[str] | None = None) -> int:
    return record.main(argv, PLAN, record.ROOT / "tests" / "data" / "heldout17", __doc__)


if __name__ == "__main__":
    sys.exit(main())
