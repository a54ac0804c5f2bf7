"""Record the nineteenth held-out set: every job of ``tests/zoo_heldout19``
run healthy (three times, one with ``record_shapes``) and once under each
fault, by the held-out recorder (``tests/zoo_heldout/record.py``: the same
launcher, faults, profiler settings and manifest), a slowed rank at 1.3x,
1.5x and 2x, with 12 traced iterations a run (``ProfilerStep#2`` to
``#13``) in place of the earlier sets' 4.

    python -m tests.zoo_heldout19.record [--out tests/data/heldout19] [--resume]
"""
from __future__ import annotations

import sys
from pathlib import Path

from tests.zoo_heldout import record
from tests.zoo_heldout.record import Channel, Job, Plan

# the encoder-decoder pipeline's links: the encoder's activations from rank
# 0 to rank 1, its memory from rank 1 to both decoder stages (ranks 2 and
# 3), the decoder's activations from rank 2 to rank 3, and each one's
# gradients back; one message is a microbatch's activations (8 sequences x
# 16 tokens x width 64, float32), the memory's and the decoder's alike
PIPELINE_MESSAGE = 8 * 16 * 64 * 4
FORWARD = ((0, 1), (1, 2), (1, 3), (2, 3))
JOBS = (
    Job("encoder_decoder_pipeline_cross_attention_isend_irecv",
        (Channel("forward", FORWARD, PIPELINE_MESSAGE),
         Channel("backward", tuple((b, a) for a, b in FORWARD), PIPELINE_MESSAGE)),
        # rank 0 reads the source, rank 2 the decoder's input, rank 3 the labels
        readers=(0, 2, 3)),
    Job("partitioned_gcn_halo_all_to_all"),
    Job("dp_sgd_per_sample_clipping_vmap"),
    Job("population_based_training_exploit_broadcast"),
)
# a tenth of the fault runs record shapes, as in the sixth to eighteenth sets
PLAN = Plan(JOBS, Path("tests/zoo_heldout19"), healthy=3, slowdowns=(1.3, 1.5, 2.0),
            shuffle_seed="heldout19", shapes_share=0.1, steps=12)


def main(argv: list[str] | None = None) -> int:
    return record.main(argv, PLAN, record.ROOT / "tests" / "data" / "heldout19", __doc__)


if __name__ == "__main__":
    sys.exit(main())
