"""Record the third held-out set: every job of ``tests/zoo_heldout3`` run
healthy (three times, one with ``record_shapes``) and once under each
fault, by the held-out recorder (``tests/zoo_heldout/record.py``: the same
launcher, faults, profiler settings and manifest), a slowed rank at 1.3x,
1.5x and 2x.

    python -m tests.zoo_heldout3.record [--out tests/data/heldout3] [--resume]
"""
from __future__ import annotations

import sys
from pathlib import Path

from tests.zoo_heldout import record
from tests.zoo_heldout.record import Channel, Job, Plan

SERVER, WORKERS = 0, tuple(range(1, record.WORLD))
# one message of the parameter server: its network's 300,426 parameters (or
# their gradients), flattened, in float32
MESSAGE = 300_426 * 4
JOBS = (
    Job("ddp_dcgan"), Job("ddp_gcn"), Job("fsdp2_super_resolution"),
    Job("parameter_server", (Channel("push", tuple((w, SERVER) for w in WORKERS), MESSAGE),
                             Channel("pull", tuple((SERVER, w) for w in WORKERS), MESSAGE))),
)
# fewer fault runs record shapes than in the second set: the set stays within 12 MB
PLAN = Plan(JOBS, Path("tests/zoo_heldout3"), healthy=3, slowdowns=(1.3, 1.5, 2.0),
            shuffle_seed="heldout3", shapes_share=0.15)


def main(argv: list[str] | None = None) -> int:
    return record.main(argv, PLAN, record.ROOT / "tests" / "data" / "heldout3", __doc__)


if __name__ == "__main__":
    sys.exit(main())
