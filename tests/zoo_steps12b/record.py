"""Record a second study set of tuning job kinds traced for 12 steps: six
job kinds of the tuning sets, none of them in ``tests/data/steps12`` --
three data-parallel jobs (``ddp_swa_bn_update`` of ``tests/zoo_heldout13``,
``ddp_multitask_unused`` of ``tests/zoo_heldout9``,
``ddp_gradient_bucket_view_adamw_warmup`` of ``tests/zoo_heldout15``), a
sharded-data-parallel job (``fsdp2_lora_frozen_base`` of
``tests/zoo_heldout14``), a pipeline with point-to-point sends
(``batched_p2p_pipeline`` of ``tests/zoo_heldout11``, its channels and
readers as that set declares them) and a tensor- and data-parallel job
(``tp_dp_2d_mesh`` of ``tests/zoo_heldout10``) -- run healthy (four
times, two with ``record_shapes``) and once under each fault the plan
offers, by the held-out recorder (``tests/zoo_heldout/record.py``: the
same launcher, faults, profiler settings and manifest) but with 12 traced
iterations (``ProfilerStep#2`` to ``#13``) in place of 4, to measure and
fit how detection depends on how many iterations a trace holds. The
faults: a slowed rank at 1.3x, 1.5x and 2x, extra calls 2x, a loader
stall, a stall before the optimizer step, a slowed rank 2x in every third
iteration, a noisy neighbour, two slowed ranks 2x and, for the pipeline,
each channel's slow link (with and without shapes) and a slowed rank 2x
with a slow link. It is tuning data, not a held-out set.

    python -m tests.zoo_steps12b.record [--out tests/data/steps12b] [--resume]
"""
from __future__ import annotations

import sys
from pathlib import Path

from tests.zoo_heldout import record
from tests.zoo_heldout.record import CHAIN_DOWN, WORLD, Channel, Job, Plan

PIPELINE_MESSAGE = 64 * 256 * 4  # as tests/zoo_heldout11/record.py declares it
JOBS = (
    Job("ddp_swa_bn_update"),
    Job("ddp_multitask_unused", home=Path("tests/zoo_heldout9")),
    Job("ddp_gradient_bucket_view_adamw_warmup", home=Path("tests/zoo_heldout15")),
    Job("fsdp2_lora_frozen_base", home=Path("tests/zoo_heldout14")),
    # the first stage (rank 0) reads the features, the last (rank 3) the labels
    Job("batched_p2p_pipeline", (Channel("forward", CHAIN_DOWN, PIPELINE_MESSAGE),
                                 Channel("backward", tuple((b, a) for a, b in CHAIN_DOWN),
                                         PIPELINE_MESSAGE)),
        readers=(0, WORLD - 1), home=Path("tests/zoo_heldout11")),
    Job("tp_dp_2d_mesh", home=Path("tests/zoo_heldout10")),
)
# as in the sixth to eighteenth sets, a tenth of the fault runs record shapes
PLAN = Plan(JOBS, Path("tests/zoo_heldout13"), healthy=4, slowdowns=(1.3, 1.5, 2.0),
            shuffle_seed="steps12b", shapes_share=0.1, steps=12, faults=None)


def main(argv: list[str] | None = None) -> int:
    return record.main(argv, PLAN, record.ROOT / "tests" / "data" / "steps12b", __doc__)


if __name__ == "__main__":
    sys.exit(main())
