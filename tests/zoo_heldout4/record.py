"""Record the fourth held-out set: every job of ``tests/zoo_heldout4`` run
healthy (three times, one with ``record_shapes``) and once under each
fault, by the held-out recorder (``tests/zoo_heldout/record.py``: the same
launcher, faults, profiler settings and manifest), a slowed rank at 1.3x,
1.5x and 2x.

    python -m tests.zoo_heldout4.record [--out tests/data/heldout4] [--resume]
"""
from __future__ import annotations

import sys
from pathlib import Path

from tests.zoo_heldout import record
from tests.zoo_heldout.record import RING_DOWN, RING_UP, Channel, Job, Plan

# one gossip message: the audio classifier's 24,906 parameters, flattened, in float32
MESSAGE = 24_906 * 4
JOBS = (
    Job("ddp_unet"), Job("ddp_text_transformer_bf16"), Job("ddp_simclr"),
    Job("gossip_sgd", (Channel("to next", RING_DOWN, MESSAGE),
                       Channel("to previous", RING_UP, MESSAGE))),
)
# a tenth of the fault runs record shapes: the set stays near 12 MB
PLAN = Plan(JOBS, Path("tests/zoo_heldout4"), healthy=3, slowdowns=(1.3, 1.5, 2.0),
            shuffle_seed="heldout4", shapes_share=0.1)


def main(argv: list[str] | None = None) -> int:
    return record.main(argv, PLAN, record.ROOT / "tests" / "data" / "heldout4", __doc__)


if __name__ == "__main__":
    sys.exit(main())
