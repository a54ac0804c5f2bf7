"""Record the thirteenth held-out set: every job of ``tests/zoo_heldout13``
run healthy (three times, one with ``record_shapes``) and once under each
fault, by the held-out recorder (``tests/zoo_heldout/record.py``: the same
launcher, faults, profiler settings and manifest), a slowed rank at 1.3x,
1.5x and 2x.

    python -m tests.zoo_heldout13.record [--out tests/data/heldout13] [--resume]
"""
from __future__ import annotations

import sys
from pathlib import Path

from tests.zoo_heldout import record
from tests.zoo_heldout.record import Job, Plan

# no job sends point to point (the ranks meet in collectives only), so no
# job has a channel to slow
JOBS = (
    Job("megatron_sequence_parallel_tp2_dp2"), Job("ddp_swa_bn_update"),
    Job("manual_zero3_layerwise_allgather"), Job("async_allreduce_overlap"),
)
# a tenth of the fault runs record shapes, as in the sixth to twelfth sets
PLAN = Plan(JOBS, Path("tests/zoo_heldout13"), healthy=3, slowdowns=(1.3, 1.5, 2.0),
            shuffle_seed="heldout13", shapes_share=0.1)


def main(argv: list[str] | None = None) -> int:
    return record.main(argv, PLAN, record.ROOT / "tests" / "data" / "heldout13", __doc__)


if __name__ == "__main__":
    sys.exit(main())
