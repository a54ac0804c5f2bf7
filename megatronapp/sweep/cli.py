"""``megatronapp sweep SPEC``: a grid or random draws over scenario keys and seeds."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from megatronapp.host import limits
from megatronapp.errors import UserError
from megatronapp.host.executors import add_where_options, where_from
from megatronapp.io.outdirs import add_force_option, check_file, new_file


def cmd_sweep(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from backends.registry import get_backend, run_function

    from .run import estimate_sweep, run_sweep, write_table
    from .spec import load_spec

    spec = load_spec(args.spec, args.set)
    where = where_from(args)
    out = Path(args.out or Path("runs") / f"sweep-{spec.name}.parquet")
    if out.suffix not in (".parquet", ".csv"):
        raise UserError(f"--out: {out} must end in .parquet or .csv")
    check_file(out, "--out", args.force, [Path(args.spec)], make_parent=True)  # before any point
    report = _report_path(args.report, out)
    if report is not None:
        check_file(report, "--report", args.force, [Path(args.spec)], make_parent=True)
    total = spec.point_count()
    if total == 0:
        raise UserError(f"SPEC: {args.spec} makes no runs (a grid key with no values, or "
                        "seeds: 0)")
    limits.enforce(args, limits.estimate_points(total), what=f"sweep {spec.name} ({total:,} runs)")
    points = spec.points()
    count = get_backend(spec.model.backend).size
    limits.enforce(args, estimate_sweep(points, where, spec.model.detect, count),
                   what=f"sweep {spec.name} ({total} runs)")
    bar = Progress(TextColumn(f"[bold]sweep {spec.name}"), BarColumn(),
                   TextColumn("{task.completed}/{task.total} runs"), TimeElapsedColumn(),
                   transient=True, disable=not sys.stderr.isatty())
    print(f"sweep {spec.name}: {total} runs on {where.describe()}", file=sys.stderr)
    with bar:
        task = bar.add_task("runs", total=total)
        rows = list(run_sweep(spec, run_function(spec.model.backend), where,
                              lambda: bar.advance(task)))
    def page() -> None:  # the report, or neither: the table waits for it
        if report is not None:
            _write_report(report, spec, rows, args.force, Path(args.spec))

    write_table(rows, out, args.force, [Path(args.spec)], then=page)
    failed = sum(1 for r in rows if r.get("error"))
    print(f"wrote {out} ({len(rows)} rows" + (f", {failed} failed: see its error column)"
                                              if failed else ")"))
    return 0


def _report_path(report: str | None, out: Path) -> Path | None:
    if report is None:
        return None
    path = Path(report)
    if path.suffix != ".html":
        raise UserError(f"--report: {path} must end in .html")
    if path.resolve() == out.resolve():
        raise UserError(f"--report: {path} is the --out table")
    return path


def _write_report(path: Path, spec: Any, rows: list[dict[str, Any]], force: bool,
                  spec_path: Path) -> None:
    from .page import sweep_html  # matplotlib loads here

    with new_file(path, "--report", force, [spec_path], make_parent=True) as tmp:
        tmp.write_text(sweep_html(spec.name, spec.keys(), rows, spec.model.detect),
                       encoding="utf-8")
    print(f"wrote {path} (open it in a browser)")


def register(subparsers: Any, plot_hooks: list) -> None:
    sweep = subparsers.add_parser("sweep", help="run a grid or random draws of scenarios, "
                                                "locally or on a Ray cluster")
    sweep.add_argument("spec", metavar="SPEC", help="sweep spec YAML (see docs/sweeps.md)")
    sweep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a key of the base scenario (repeatable)")
    sweep.add_argument("--out", help="result table, .parquet or .csv "
                                     "(default runs/sweep-<spec name>.parquet)")
    sweep.add_argument("--report", metavar="PAGE.html",
                       help="also write one self-contained HTML page: detection rate and "
                            "iteration time against each swept key")
    add_where_options(sweep)
    limits.add_options(sweep)
    add_force_option(sweep, "an existing --out table")
    sweep.set_defaults(func=cmd_sweep)
