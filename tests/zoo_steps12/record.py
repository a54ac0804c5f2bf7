"""Record a study set of tuning job kinds traced for 12 steps: two
data-parallel jobs of the tuning sets (every rank doing the same work),
``ddp_sync_batchnorm_by_hand`` of ``tests/zoo_heldout16`` and
``ddp_gradient_accumulation_clip_amp`` of ``tests/zoo_heldout12``, run
healthy (four times, one with ``record_shapes``) and once under each rank
fault, by the held-out recorder (``tests/zoo_heldout/record.py``: the same
launcher, faults, profiler settings and manifest) but with 12 traced
iterations (``ProfilerStep#2`` to ``#13``) in place of 4, to measure how
detection depends on how many iterations a trace holds. The faults: a
slowed rank at 1.3x, 1.5x and 2x, extra calls 2x, a loader stall, a stall
before the optimizer step, a noisy neighbour and a slowed rank 2x in every
third iteration; no slow links and no two slowed ranks. It is tuning data,
not a held-out set.

    python -m tests.zoo_steps12.record [--out tests/data/steps12] [--resume]
"""
from __future__ import annotations

import sys
from pathlib import Path

from tests.zoo_heldout import record
from tests.zoo_heldout.record import Job, Plan

JOBS = (
    Job("ddp_sync_batchnorm_by_hand"),
    Job("ddp_gradient_accumulation_clip_amp", home=Path("tests/zoo_heldout12")),
)
FAULTS = ("slow-1.3x", "slow-1.5x", "slow-2x", "extra-calls-2x", "loader-stall", "step-stall",
          "intermittent-2x-every-3", "noisy-neighbour")
# as in the sixth to eighteenth sets, a tenth of the fault runs record shapes
PLAN = Plan(JOBS, Path("tests/zoo_heldout16"), healthy=4, slowdowns=(1.3, 1.5, 2.0),
            shuffle_seed="steps12", shapes_share=0.1, steps=12, faults=FAULTS)


def main(argv: list[str] | None = None) -> int:
    return record.main(argv, PLAN, record.ROOT / "tests" / "data" / "steps12", __doc__)


if __name__ == "__main__":
    sys.exit(main())
