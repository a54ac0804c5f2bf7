"""``megatronapp report RUN_DIR [--out FILE] [--force]``."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from megatronapp.host import limits
from megatronapp.errors import UserError
from megatronapp.io.outdirs import add_force_option

REPORT_FILE = "report.html"


def cmd_report(args: argparse.Namespace) -> int:
    from megatronapp.io.outdirs import new_file
    from megatronapp.io.progress import status
    from megatronapp.scan.cli import _side_file, check_trace
    from megatronapp.scan.evidence.focus import load_plot_input, plot_cost

    run_dir = Path(args.run_dir)
    summary = _summary(run_dir)
    check_trace(args, run_dir, "report", plot_cost(run_dir))
    out = Path(args.out) if args.out else run_dir / REPORT_FILE
    with status(f"loading {run_dir}") as say, new_file(out, "--out", args.force,
                                                       inputs=[run_dir / "summary.json"]) as tmp:
        data = _side_file(lambda t: load_plot_input(t, limits.json_text_cap(args), say), run_dir)
        say("drawing the report")
        from .page import report_html  # matplotlib loads here, under the spinner

        tmp.write_text(report_html(run_dir, summary, data), encoding="utf-8")
    print(f"wrote {out}")
    return 0


def _summary(run_dir: Path) -> dict[str, Any]:
    from megatronapp.scan.cli import _side_file
    from megatronapp.scan.ingest.load import read_object
    from megatronapp.trace.summary_file import summary_model

    path = run_dir / "summary.json"
    if not path.is_file():
        raise UserError(f"RUN_DIR: {path} not found (run 'megatronapp run' first)")
    summary: dict[str, Any] = _side_file(read_object, path)
    summary_model(summary, path)  # a malformed or newer summary is one line
    return summary


def register(subparsers: Any, _plot_hooks: list[Any]) -> None:
    report = subparsers.add_parser("report", help="one self-contained HTML page about a run: "
                                   "scenario, verdict, figures, memory, modules")
    report.add_argument("run_dir", metavar="RUN_DIR", help="a directory written by "
                        "'megatronapp run'")
    report.add_argument("--out", help=f"the page to write (default: RUN_DIR/{REPORT_FILE})")
    limits.add_options(report)
    add_force_option(report, "an existing page that megatronapp did not write")
    report.set_defaults(func=cmd_report)
