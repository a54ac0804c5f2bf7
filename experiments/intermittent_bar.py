"""How high an intermittent cause's bar (``recur_multiple``) must stand for
recorded healthy runs to stay quiet: per eligible healthy run (no machine
straggler), the largest second-highest noise units of any suspect in the
iterations it counts in (an intermittent cause is named for two iterations
at the bar), and how many runs each bar would name. Prints a table; writes
nothing.

    python -m experiments.intermittent_bar SET [SET ...] [--bars 5,10,20,50]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from megatronapp.scan.align.inputs import ScanInput


def second_highest_units(scan: "ScanInput") -> float:
    """The largest, over suspects, of the second-highest noise units among the
    iterations a suspect counts in (0 where none counts in two)."""
    from megatronapp.scan.evidence.detect import Detector
    from megatronapp.scan.evidence.params import Params

    params = Params()
    detector = Detector(scan.gpus_per_node, scan.scenario)
    detector.feed(scan)
    best = 0.0
    for e in detector.evidence():
        units = np.sort(e.units[e.hits(params)])[::-1]
        if len(units) >= 2:
            best = max(best, float(units[1]))
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.intermittent_bar",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("sets", type=Path, nargs="+", help="recorded sets (tests/data/heldoutN)")
    parser.add_argument("--bars", default="5,10,15,20,30,50")
    args = parser.parse_args(argv)
    from megatronapp.errors import UserError
    from megatronapp.scan.eval import sets

    try:
        bars = [float(b) for b in args.bars.split(",")]
        runs = [run for folder in args.sets for run in sets.recorded(folder, "tuning-zoo")]
    except ValueError as err:  # a bar that is no number, or a set that cannot be read
        print(f"intermittent_bar: {err if isinstance(err, UserError) else '--bars: ' + str(err)}",
              file=sys.stderr)
        return 2
    values = []
    for run in runs:
        if run.healthy and run.eligible:
            values.append(second_highest_units(run.load()))
            print(f"{run.name}: {values[-1]:.1f}", file=sys.stderr, flush=True)
    found = np.array(values)
    print("| recur_multiple | healthy runs it would name |\n|---:|---:|")
    for bar in bars:
        print(f"| {bar:g} | {int((found >= bar).sum())} of {len(found)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
