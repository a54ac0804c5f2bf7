"""MegaScan's rule tree as it was before the model replaced it (method
``megascan-rules``) and the baselines, on the tuning and held-out sets, as
``experiments.scan_accuracy`` scores them: the "today" its model is judged
against. It ran once, at the commit its results file records; the rule tree
is gone from later commits (check that commit out to run it again).

    python -m experiments.scan_today --tuning-zoo runs/zoo-tuning --real runs/real-trials
"""
from __future__ import annotations

import sys

from experiments import scan_accuracy
from experiments.scan_accuracy import tables  # noqa: F401  (the renderer reads it here)

NAME = "scan_today"
METHODS = ("megascan-rules", "hta-latest", "nvidia-0.75", "slowest-mean", "megatronapp-orig")


def main(argv: list[str] | None = None) -> int:
    from megatronapp.scan.methods import DETECTORS

    parser = scan_accuracy.parser()
    args = parser.parse_args([*(argv if argv is not None else sys.argv[1:]),
                              "--methods", *METHODS])
    if "megascan-rules" not in DETECTORS:
        print("scan_today: the rule tree (megascan-rules) is not in this commit; check out the "
              "commit results/scan_today.json names", file=sys.stderr)
        return 2
    return scan_accuracy.run_experiment(NAME, args, megascan=False)


if __name__ == "__main__":
    sys.exit(main())
