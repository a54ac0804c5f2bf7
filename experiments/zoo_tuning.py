"""Record MegaScan's tuning set of real traces: every job of ``tests/zoo``
(the jobs MegaScan was developed against) run healthy and under the same
faults, drawn the same way, as the held-out set (``tests/zoo_heldout/record.py``):
slowed ranks, extra calls, a slow data loader, a stalled optimizer step,
an intermittent straggler, a noisy neighbour, two slowed ranks, shaped links
on each point-to-point channel.

The traces are not kept in the repository (they are made again by this
command); ``experiments.scan_accuracy`` reads them from ``--out``.

    python -m experiments.zoo_tuning --out runs/zoo-tuning [--resume]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tests.zoo_heldout import record
from tests.zoo_heldout.record import CHAIN_DOWN, WORLD, Channel, Job

MESSAGE = 128 * 512 * 4  # one microbatch's activations (or gradients): 128 x 512 floats
TUNING_JOBS = (
    Job("ddp_mlp"), Job("fsdp2_mlp"), Job("tp_mlp"), Job("allreduce_uneven"),
    Job("pipeline_1f1b", (Channel("forward", CHAIN_DOWN, MESSAGE),
                          Channel("backward", tuple((b, a) for a, b in CHAIN_DOWN), MESSAGE)),
        readers=(0, WORLD - 1)),
    Job("pipelining_1f1b", (Channel("forward", CHAIN_DOWN, MESSAGE),
                            Channel("backward", tuple((b, a) for a, b in CHAIN_DOWN), MESSAGE)),
        readers=(0, WORLD - 1)),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.zoo_tuning",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/zoo-tuning"))
    parser.add_argument("--resume", action="store_true",
                        help="finish a set an interrupted recording left")
    args = parser.parse_args(argv)
    return record.record(args.out, args.resume,
                         record.Plan(TUNING_JOBS, Path("tests/zoo"), shuffle_seed="tuning"))


if __name__ == "__main__":
    sys.exit(main())
