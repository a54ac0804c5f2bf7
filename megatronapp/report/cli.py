"""``megatronapp report RUN_DIR_OR_TRACE [--out FILE] [--cycle N|all] [--force]``."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from megatronapp.host import limits
from megatronapp.errors import UserError
from megatronapp.io.outdirs import add_force_option

REPORT_FILE = "report.html"
BASELINE_MAX_SECONDS = 60.0  # a report simulates the healthy run only when it is this cheap


def cmd_report(args: argparse.Namespace) -> int:
    from megatronapp.io.outdirs import new_file, outputs_folder
    from megatronapp.io.progress import status
    from megatronapp.scan.cli import _side_file, check_trace
    from megatronapp.scan.evidence.focus import plot_cost
    from megatronapp.scan.placement import check_folder, default_outputs

    target = Path(args.run_dir)
    summary = _summary(target)
    check_trace(args, target, "report", plot_cost(target))
    out = Path(args.out) if args.out else default_outputs(target) / REPORT_FILE
    if not args.out:
        check_folder(out.parent)
    inputs = [target / "summary.json"] if summary is not None else _trace_files(target)
    with status(f"loading {target}") as say:
        page = _page(target, summary, args, say)
        if not args.out:
            outputs_folder(out.parent, "--out")
        with new_file(out, "--out", args.force, inputs=inputs) as tmp:
            tmp.write_text(page, encoding="utf-8")
    print(f"wrote {out}")
    return 0


def _page(target: Path, summary: dict[str, Any] | None, args: argparse.Namespace,
          say: Any) -> str:
    """The page of a run directory (its summary), or of a trace it reads."""
    from megatronapp.scan.cli import _side_file
    from megatronapp.scan.evidence.focus import load_plot_input

    cap = limits.json_text_cap(args)
    if summary is not None:
        data = _side_file(lambda t: load_plot_input(t, cap, say), target)
        baseline = _baseline(summary, data, args, say)
        say("drawing the report")
        from .page import report_html  # matplotlib loads here, under the spinner

        return report_html(target, summary, data, baseline)
    trace, data = _side_file(lambda t: _trace_input(t, cap, say, args.cycle), target)
    baseline = _baseline(None, data, args, say)
    say("drawing the report")
    from .page import trace_report_html

    return trace_report_html(target, trace, data, baseline)


def _baseline(summary: dict[str, Any] | None, data: Any, args: argparse.Namespace,
              say: Any) -> Any:
    """The healthy baseline: a simulated run's scenario without its faults (run
    on the simulator where the limits allow it), else MegaScan's blame."""
    from backends.registry import run_function

    from .baseline import baseline_of

    def check(estimate: limits.Estimate) -> None:
        if not args.no_limits:
            most = min(args.max_seconds, BASELINE_MAX_SECONDS)
            limits.check(estimate, limits.machine_limits(None, most),
                         what="the healthy baseline (the scenario without its faults)")

    return baseline_of(summary, data.diagnosis.to_json(), run_function("sim"), check, say)


def _trace_input(target: Path, cap: float, say: Any, cycle: int | str) -> tuple[Any, Any]:
    """A trace (not a run directory), read and diagnosed as ``plot`` does."""
    from megatronapp.scan.align.inputs import prepare_loaded
    from megatronapp.scan.cycles import warn_missing
    from megatronapp.scan.evidence.focus import plot_input_of
    from megatronapp.scan.ingest.load import load_trace

    trace = load_trace(target, say=say, max_bytes=cap, cycle=cycle)
    warn_missing([trace])
    say("detecting the root cause")
    return trace, plot_input_of(prepare_loaded(trace, say))


def _trace_files(target: Path) -> list[Path]:
    """A trace's files, which ``--out`` may never replace."""
    from megatronapp.scan.cli import _side_file
    from megatronapp.scan.ingest.load import locate_trace

    return list(_side_file(locate_trace, target).paths)


def _summary(target: Path) -> dict[str, Any] | None:
    """A run directory's summary; None for a trace (a folder of torch.profiler
    files, a trace file); one line where there is neither."""
    from megatronapp.scan.cli import _side_file
    from megatronapp.scan.ingest.load import TraceError, locate_trace, read_object
    from megatronapp.trace.summary_file import summary_model

    path = target / "summary.json"
    if not path.is_file():
        try:
            locate_trace(target)
        except TraceError:
            raise UserError(f"RUN_DIR_OR_TRACE: {path} not found (run 'megatronapp run' first) "
                            f"and no trace in {target}") from None
        return None
    summary: dict[str, Any] = _side_file(read_object, path)
    summary_model(summary, path)  # a malformed or newer summary is one line
    return summary


def register(subparsers: Any, _plot_hooks: list[Any]) -> None:
    from megatronapp.scan.cycles import add_cycle_option

    report = subparsers.add_parser("report", help="one self-contained HTML page about a run "
                                   "or a trace: scenario, verdict, figures, GPU time, memory, "
                                   "modules")
    report.add_argument("run_dir", metavar="RUN_DIR_OR_TRACE", help="a directory written by "
                        "'megatronapp run', or a folder of torch.profiler traces")
    report.add_argument("--out", help=f"the page to write (default: RUN_DIR/{REPORT_FILE}; "
                        f"beside a trace folder, FOLDER-megascan/{REPORT_FILE}, never inside it)")
    add_cycle_option(report, each=False)
    limits.add_options(report)
    add_force_option(report, "an existing page that megatronapp did not write")
    report.set_defaults(func=cmd_report)
