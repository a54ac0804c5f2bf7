"""Record the eighteenth held-out set: every job of ``tests/zoo_heldout18``
run healthy (three times, one with ``record_shapes``) and once under each
fault, by the held-out recorder (``tests/zoo_heldout/record.py``: the same
launcher, faults, profiler settings and manifest), a slowed rank at 1.3x,
1.5x and 2x.

    python -m tests.zoo_heldout18.record [--out tests/data/heldout18] [--resume]
"""
from __future__ import annotations

import sys
from pathlib import Path

from tests.zoo_heldout import record
from tests.zoo_heldout.record import Channel, Job, Plan

# Chimera's two pipelines over the four ranks: what a rank sends the next
# rank down carries the down pipeline's activations and the up pipeline's
# gradients, what it sends the next rank up the up pipeline's activations
# and the down pipeline's gradients; one message is a microbatch's
# (16 samples x width 256, float32)
PIPELINE_MESSAGE = 16 * 256 * 4
DOWN = tuple((r, r + 1) for r in range(record.WORLD - 1))
JOBS = (
    Job("chimera_bidirectional_pipeline_isend_irecv",
        (Channel("down", DOWN, PIPELINE_MESSAGE),
         Channel("up", tuple((b, a) for a, b in DOWN), PIPELINE_MESSAGE)),
        # the ranks where the pipelines start and end read the data
        readers=(0, record.WORLD - 1)),
    Job("ddpm_denoising_diffusion_ddp_ema"),
    Job("signum_majority_vote_int8_allreduce"),
    Job("vqvae_ema_codebook_allreduce"),
)
# a tenth of the fault runs record shapes, as in the sixth to seventeenth sets
PLAN = Plan(JOBS, Path("tests/zoo_heldout18"), healthy=3, slowdowns=(1.3, 1.5, 2.0),
            shuffle_seed="heldout18", shapes_share=0.1)


def main(argv: list[str] | None = None) -> int:
    return record.main(argv, PLAN, record.ROOT / "tests" / "data" / "heldout18", __doc__)


if __name__ == "__main__":
    sys.exit(main())
