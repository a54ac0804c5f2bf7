"""Record the eighth held-out set: every job of ``tests/zoo_heldout8`` run
healthy (three times, one with ``record_shapes``) and once under each
fault, by the held-out recorder (``tests/zoo_heldout/record.py``: the same
launcher, faults, profiler settings and manifest), a slowed rank at 1.3x,
1.5x and 2x.

    python -m tests.zoo_heldout8.record [--out tests/data/heldout8] [--resume]
"""
from __future__ import annotations

import sys
from pathlib import Path

from tests.zoo_heldout import record
from tests.zoo_heldout.record import RING_DOWN, RING_UP, WORLD, Channel, Job, Plan

# the loop of the looped pipeline: activations go forward round the ring
# (rank 3 hands stage 3's output to rank 0's stage 4), gradients back; one
# message is a microbatch's (96 samples x width 512, float32)
MESSAGE = 96 * 512 * 4
JOBS = (
    Job("top2_moe_uneven"), Job("ddp_fp16_compress_gru_seq2seq"),
    Job("dlrm_sharded_embeddings"),
    # the first stage (rank 0) reads the features, the last (rank 3) the labels
    Job("looped_bfs_pipeline", (Channel("forward", RING_DOWN, MESSAGE),
                                Channel("backward", RING_UP, MESSAGE)),
        readers=(0, WORLD - 1)),
)
# a tenth of the fault runs record shapes, as in the sixth and seventh sets
PLAN = Plan(JOBS, Path("tests/zoo_heldout8"), healthy=3, slowdowns=(1.3, 1.5, 2.0),
            shuffle_seed="heldout8", shapes_share=0.1)


def main(argv: list[str] | None = None) -> int:
    return record.main(argv, PLAN, record.ROOT / "tests" / "data" / "heldout8", __doc__)


if __name__ == "__main__":
    sys.exit(main())
