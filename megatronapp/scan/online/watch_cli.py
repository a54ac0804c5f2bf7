"""``megatronapp watch DIR``: on-line MegaScan following a directory a job is writing."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from megatronapp.io.progress import status

from megatronapp.scan.online.online_config import OnlineConfig

if TYPE_CHECKING:
    from megatronapp.scan.online.online import OnlineScan
    from megatronapp.scan.online.watch import Iterations


def cmd_watch(args: argparse.Namespace) -> int:
    from megatronapp.scan.online.watch import follow  # numpy and the detector load here, not with the command line

    config = OnlineConfig(window=args.window, confirm=args.confirm, clear=args.clear,
                          min_confidence=args.min_confidence)

    def feed(scan: OnlineScan, iterations: Iterations) -> None:
        for iteration, cols in iterations:
            for d in scan.feed(iteration, cols):
                print(json.dumps(d.to_json()) if args.json else d.line(), flush=True)

    with status(f"watching {args.dir}") as say:
        scan = follow(Path(args.dir), config, feed, say, args.interval, args.idle)
    if not args.json:
        print(f"watched {scan.iterations} iterations: {len(scan.named)} verdicts standing")
    return 0


def _at_least(minimum: int, off: str = "") -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum`` (``off``: what 0 means)."""
    def count(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}{off}, got {value}")
        return value
    return count


def _probability(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a probability in [0, 1], got {text}")
    return value


MAX_INTERVAL_S = 3600.0  # a look at least every hour (time.sleep takes no more than ~9e9 s)


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def _interval(text: str) -> float:
    value = _seconds(text)
    if value > MAX_INTERVAL_S:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_INTERVAL_S:g} seconds, got {text}")
    return value


def register(subparsers: Any, _plot_hooks: list) -> None:
    watch = subparsers.add_parser(
        "watch", help="follow a directory a job is writing (a run directory, or torch.profiler "
                      "output) and report MegaScan's verdicts as they come")
    watch.add_argument("dir", metavar="DIR", help="a run directory, or a tensorboard_trace_handler "
                                                  "directory (one file per rank per cycle)")
    watch.add_argument("--interval", type=_interval, default=1.0,
                       help=f"seconds between looks (at most {MAX_INTERVAL_S:g})")
    watch.add_argument("--idle", type=_seconds, default=None,
                       help="end when no file was written for this long (default: follow until "
                            "interrupted)")
    defaults = OnlineConfig()
    watch.add_argument("--window", type=_at_least(1), default=defaults.window,
                       help="iterations MegaScan looks at")
    watch.add_argument("--confirm", type=_at_least(1), default=defaults.confirm,
                       help="windows in a row that must find a suspect before it is named")
    watch.add_argument("--clear", type=_at_least(1), default=defaults.clear,
                       help="windows in a row without it before a verdict is withdrawn")
    watch.add_argument("--min-confidence", type=_probability, default=defaults.min_confidence,
                       help="findings less confident than this do not count")
    watch.add_argument("--json", action="store_true", help="one JSON record a line per detection")
    watch.set_defaults(func=cmd_watch)
