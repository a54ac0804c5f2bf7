"""Record the twentieth held-out set: every job of ``tests/zoo_heldout20``
run healthy (three times, one with ``record_shapes``) and once under each
fault, by the held-out recorder (``tests/zoo_heldout/record.py``: the same
launcher, faults, profiler settings and manifest), a slowed rank at 1.3x,
1.5x and 2x, with 12 traced iterations a run (``ProfilerStep#2`` to
``#13``), as in the nineteenth set.

    python -m tests.zoo_heldout20.record [--out tests/data/heldout20] [--resume]
"""
from __future__ import annotations

import sys
from pathlib import Path

from tests.zoo_heldout import record
from tests.zoo_heldout.record import CHAIN_DOWN, Channel, Job, Plan

# the Mamba-2 job's links: each block's state passed on from rank r to rank
# r + 1, and its gradient back; one message is a batch's state of one block
# (32 sequences x 4 heads x 32 channels x state size 8, float32)
STATE_MESSAGE = 32 * 4 * 32 * 8 * 4
# split learning's links: each client's activations (and the gradients of
# the server's outputs) to the server, the server's outputs (and the
# gradients of the client's activations) back; one message is a client's
# batch of activations (128 samples x width 256, float32)
SPLIT_MESSAGE = 128 * 256 * 4
CLIENTS = (1, 2, 3)
JOBS = (
    Job("mamba2_sequence_parallel_state_passing_send_recv",
        (Channel("forward", CHAIN_DOWN, STATE_MESSAGE),
         Channel("backward", tuple((b, a) for a, b in CHAIN_DOWN), STATE_MESSAGE))),
    Job("splitfed_u_shaped_server_send_recv",
        (Channel("to server", tuple((c, 0) for c in CLIENTS), SPLIT_MESSAGE),
         Channel("to client", tuple((0, c) for c in CLIENTS), SPLIT_MESSAGE)),
        # the clients read the data; the server (rank 0) reads nothing
        readers=CLIENTS),
    Job("summa_2d_tensor_parallel_broadcast_reduce"),
    Job("evolution_strategies_shared_seeds_allgather"),
)
# a tenth of the fault runs record shapes, as in the sixth to nineteenth sets
PLAN = Plan(JOBS, Path("tests/zoo_heldout20"), healthy=3, slowdowns=(1.3, 1.5, 2.0),
            shuffle_seed="heldout20", shapes_share=0.1, steps=12)


def main(argv: list[str] | None = None) -> int:
    return record.main(argv, PLAN, record.ROOT / "tests" / "data" / "heldout20", __doc__)


if __name__ == "__main__":
    sys.exit(main())
