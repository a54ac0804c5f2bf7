"""The options ``query`` and ``scope query`` share, without importing DuckDB
(so that ``--help`` and usage errors stay fast)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from megatronapp.host import limits

DEFAULT_MAX_ROWS = 10_000  # rows printed; --out takes every row


@dataclass(frozen=True)
class Output:
    """Where a query's rows go: the terminal (at most ``max_rows``) or a file."""

    max_rows: int = DEFAULT_MAX_ROWS
    as_json: bool = False
    out: Path | None = None
    force: bool = False

    @classmethod
    def of(cls, args: argparse.Namespace) -> Output:
        return cls(args.max_rows, args.json, Path(args.out) if args.out else None, args.force)


def row_count(text: str) -> int:
    """argparse type: a whole number of rows > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of rows, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """The options ``query`` and ``scope query`` share."""
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--max-rows", type=row_count, default=DEFAULT_MAX_ROWS, metavar="N",
                        help=f"print at most N rows, and say so on stderr when there are more "
                             f"(default {DEFAULT_MAX_ROWS:,})")
    parser.add_argument("--out", metavar="FILE",
                        help="write every row to FILE instead (.parquet or .csv), whole or "
                             "not at all")
    parser.add_argument("--force", action="store_true",
                        help="let --out replace an existing file (never one of the inputs)")
    parser.add_argument("--memory-limit", default=None, metavar="SIZE",
                        help="DuckDB memory limit, e.g. 2GB (default: a quarter of the memory "
                             "available, at most 4GB)")
    limits.add_options(parser)  # the input's size is checked first; the SQL stops at --max-seconds
