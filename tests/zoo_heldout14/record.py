"""Record the fourteenth held-out set: every job of ``tests/zoo_heldout14``
run healthy (three times, one with ``record_shapes``) and once under each
fault, by the held-out recorder (``tests/zoo_heldout/record.py``: the same
launcher, faults, profiler settings and manifest), a slowed rank at 1.3x,
1.5x and 2x.

    python -m tests.zoo_heldout14.record [--out tests/data/heldout14] [--resume]
"""
from __future__ import annotations

import sys
from pathlib import Path

from tests.zoo_heldout import record
from tests.zoo_heldout.record import RING_DOWN, Channel, Job, Plan

# ring attention: each rank sends the keys and values it holds (and, in
# backward, their gradients) to rank + 1; one message is a block's keys and
# values, stacked (2 x 8 sequences x 64 tokens x width 128, float32)
RING_MESSAGE = 2 * 8 * 64 * 128 * 4
# the butterfly all-reduce: in step 1 ranks 0 and 1, 2 and 3 swap their
# flat gradient buffers, in step 2 ranks 0 and 2, 1 and 3; one message is
# every gradient of the MLP (64 -> 384 -> 384 -> 384 -> 16), float32
BUTTERFLY_MESSAGE = (64 * 384 + 384 + 2 * (384 * 384 + 384) + 384 * 16 + 16) * 4
STEP_1 = ((0, 1), (1, 0), (2, 3), (3, 2))
STEP_2 = ((0, 2), (2, 0), (1, 3), (3, 1))
JOBS = (
    Job("ring_attention_isend_irecv", (Channel("ring", RING_DOWN, RING_MESSAGE),)),
    Job("butterfly_allreduce_send_recv", (Channel("step 1", STEP_1, BUTTERFLY_MESSAGE),
                                          Channel("step 2", STEP_2, BUTTERFLY_MESSAGE))),
    Job("fsdp2_lora_frozen_base"), Job("vocab_parallel_cross_entropy_tp4"),
)
# a tenth of the fault runs record shapes, as in the sixth to thirteenth sets
PLAN = Plan(JOBS, Path("tests/zoo_heldout14"), healthy=3, slowdowns=(1.3, 1.5, 2.0),
            shuffle_seed="heldout14", shapes_share=0.1)


def main(argv: list[str] | None = None) -> int:
    return record.main(argv, PLAN, record.ROOT / "tests" / "data" / "heldout14", __doc__)


if __name__ == "__main__":
    sys.exit(main())
