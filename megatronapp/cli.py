"""``megatronapp`` command line: run, topology, plot (+ each module's commands).

Bad input exits with status 2 and one line on stderr naming the field; no
traceback, and no output directory that could pass for a result.
Heavy modules (pydantic, numpy, matplotlib, torch, duckdb) are imported
inside the commands that use them, so ``--help`` and usage errors stay fast.
SIGINT, SIGTERM and SIGHUP stop a command in order (worker processes
stopped, staged output removed) and print one line, exit status 128 + the
signal's number; only the standard library is imported before ``main``
installs the handlers, so an early Ctrl-C is one line too.
``MEGATRONAPP_DEBUG=1`` prints the full traceback (a failed rank's included)
before the line of an error.
"""
from __future__ import annotations

import argparse
import errno
import importlib
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Sequence

from .host import limits  # light: the size model imports the scenario schema only when used
from .errors import UserError
from .io.interrupts import Interrupted, stop_on_signals
from .io.outdirs import add_force_option
from .run.report import PROFILE_DIR, print_summary

if TYPE_CHECKING:
    from .program.backend import RunOptions

# Each module contributes its own subcommands through ``register(subparsers)``.
MODULE_CLIS = ("megatronapp.scan.cli", "megatronapp.fbd.cli", "megatronapp.dpp.cli",
               "megatronapp.sweep.cli", "megatronapp.scope.cli", "megatronapp.fidelity.cli",
               "megatronapp.report.cli", "megatronapp.scan.online.watch_cli",
               "megatronapp.mitigate.cli")


# ------------------------------------------------------------------- run
def cmd_run(args: argparse.Namespace) -> int:
    from backends.registry import check_options, get_backend

    from .mitigate.online_run import OnlineRun, check_online
    from .program.backend import ESTIMATED, REAL, RunHooks
    from .scenario.config import load_scenario
    from .io.outdirs import check_output, staged_dir
    from .io.progress import RunProgress
    from .run.touched import check_faults_touched
    from .run.write import write_run

    scenario = load_scenario(args.scenario, args.set)
    backend = get_backend(args.backend)
    _check_stall_timeout(args)
    check_options(backend, _run_options(args, Path(PROFILE_DIR)))
    out = Path(args.out or Path("runs") / scenario.name)
    check_output(out, args.force, protect=[Path(args.scenario)])
    _check_profile(args, scenario)
    check_online(scenario, args.detect)
    estimated = ESTIMATED in backend.capabilities  # else bounded by its processes
    limits.enforce(args, limits.estimate_run(scenario, backend.size if estimated else None), out,
                   backend=backend.name, estimated=estimated)
    with staged_dir(out, args.force) as tmp, RunProgress(scenario.iterations,
                                                         False if args.quiet else None) as progress:
        online = OnlineRun.wanted(scenario, args.detect, tmp, args.json,
                                  live=REAL in backend.capabilities)
        hooks = RunHooks(on_phase=progress.phase, operations=progress.operations,
                         events=online.tee(progress.record) if online else progress.record)

        def run(s: Any) -> Any:
            options = _run_options(args, tmp / PROFILE_DIR, tmp)
            return backend.run(s, online.options(s, options) if online else options, hooks)

        result = run(scenario)
        check_faults_touched(scenario, result)  # a fault that changed nothing: refused
        segments = online.after(result, run) if online else []  # the closed loop's restarts
        progress.phase(f"writing {out}")
        summary = write_run(scenario, segments[0].result if segments else result, tmp,
                            progress.counted)
        for j, segment in enumerate(segments[1:], 1):
            (tmp / f"segment{j}").mkdir()
            write_run(segment.scenario, segment.result, tmp / f"segment{j}")
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if k != "scenario"}, indent=2))
    else:
        print_summary(summary, out)
        if online:
            print("\n".join(online.lines(out, summary)))
    return 0


def _run_options(args: argparse.Namespace, profile_dir: Path, out_dir: Path | None = None
                 ) -> RunOptions:
    from .program.backend import RunOptions

    return RunOptions(stall_timeout_s=args.stall_timeout, out_dir=out_dir,
                      profile_dir=profile_dir if args.profile else None)


def _check_profile(args: argparse.Namespace, scenario: Any) -> None:
    if args.profile and scenario.fbd is not None:
        raise UserError("--profile: decoupled (fbd) runs are not profiled")


def _check_stall_timeout(args: argparse.Namespace) -> None:
    """--stall-timeout: real ranks can hang; the simulator reports deadlocks exactly."""
    if args.stall_timeout is not None and not args.stall_timeout > 0:
        raise UserError(f"--stall-timeout: must be > 0 seconds, got {args.stall_timeout:g}")


# -------------------------------------------------------------- topology
def cmd_topology(args: argparse.Namespace) -> int:
    from .parallel.topology import Topology

    for name in ("tp", "pp", "dp"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name}: must be >= 1")
    limits.enforce(args, limits.estimate_topology(args.tp * args.pp * args.dp),
                   what="this topology")
    topo = Topology(tp=args.tp, pp=args.pp, dp=args.dp)
    if args.fbd:  # MegaFBD's virtual -> physical rank mapping
        from .fbd.cli import print_layout

        return print_layout(topo, args.forward_tp, args.json)
    groups = topo.groups_json()
    if args.json:
        print(json.dumps(groups))
    else:
        for rank in range(topo.world_size):
            print(topo.label(rank))
        for kind, gs in groups.items():
            print(f"{kind} groups: {gs}")
    return 0


# ------------------------------------------------------------------ plot
def cmd_plot(args: argparse.Namespace) -> int:
    from .io.outdirs import outputs_folder, staged_outputs
    from .io.progress import status
    from .scan.cli import check_trace
    from .scan.evidence.focus import plot_cost
    from .scan.placement import check_folder, default_outputs

    run_dir = Path(args.run_dir)
    _check_plot_source(run_dir)
    out = Path(args.out) if args.out else default_outputs(run_dir)
    check_folder(out)
    check_trace(args, run_dir, "plot", plot_cost(run_dir))
    written = []
    with status(f"loading {run_dir}") as say:
        data = _plot_input(run_dir, limits.json_text_cap(args), say, args.cycle)  # all, or none
        with staged_outputs(outputs_folder(out, "--out"), "--out", args.force) as stage:
            say("drawing the timeline")
            from .trace.timeline import plot_timeline  # matplotlib loads here, under the spinner

            f = data.focus
            written.append(plot_timeline(data.events, stage / "timeline.png", run_dir.name,
                                         f.root, f.root_label, f.selection))
            for extra in args.plot_hooks:
                say("drawing each module's plots")
                written += extra(stage, data.events, f)
    for path in [out / Path(p).name for p in written]:
        print(f"wrote {path}")
    return 0


def _check_plot_source(run_dir: Path) -> None:
    """A run directory (trace.parquet or trace.json), else a directory of
    torch.profiler traces (aligned first; the plots go beside it, ``placement``)."""
    from .scan.ingest.kineto import kineto_files

    if any((run_dir / name).is_file() for name in ("trace.parquet", "trace.json")):
        return
    if run_dir.is_dir() and kineto_files(run_dir):
        return
    raise UserError(f"run_dir: no trace.parquet or trace.json in {run_dir} and no "
                    "torch.profiler traces there (run 'megatronapp run' first)")


def _plot_input(run_dir: Path, max_bytes: float, say: Callable[[str], None],
                cycle: int | str = "all") -> Any:
    from .scan.cli import _side_file
    from .scan.evidence.focus import load_plot_input

    return _side_file(lambda target: load_plot_input(target, max_bytes, say, cycle=cycle),
                      run_dir)


PlotHook = Callable[[Path, Any, Any], list[Path]]  # (folder, events, PlotFocus) -> written


# ---------------------------------------------------------- export-trace
def cmd_export(args: argparse.Namespace) -> int:
    from .trace.chrome import parse_ranges
    from .run.write import TRACE_FILE, export_trace, selection
    from .scan.cli import check_trace

    rank_ranges = parse_ranges(args.ranks, "--ranks")  # nothing expanded yet
    iteration_ranges = parse_ranges(args.iterations, "--iterations")
    run_dir = Path(args.run_dir)
    out = Path(args.out) if args.out else None
    ranks = iterations = None
    if (run_dir / TRACE_FILE).is_file():  # else export_trace says what is missing
        check_trace(args, run_dir / TRACE_FILE, "export-trace", limits.COSTS.export)
        ranks, iterations, note = selection(run_dir / TRACE_FILE, rank_ranges, iteration_ranges)
        if note:
            print(f"megatronapp: note: {note}", file=sys.stderr)
    path, count = export_trace(run_dir, ranks, iterations, args.format, args.clock, out,
                               args.force)
    print(f"wrote {path} ({count:,} events; open in https://ui.perfetto.dev)")
    return 0


# ---------------------------------------------------------------- parser
class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, unless it has none or its help says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        return super()._get_help_string(action) or text


class Parser(argparse.ArgumentParser):
    """Every (sub)command's parser: defaults in the help, and a usage error is
    one line on stderr (``megatronapp: --tp: invalid int value: 'x'``), exit 2."""

    def __init__(self, **kw: Any):
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(**kw)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"megatronapp: {_with_suggestion(message.removeprefix('argument '))}\n")


def _with_suggestion(message: str) -> str:
    """argparse's ``invalid choice: 'x' (choose from ...)`` led by the closest choice."""
    from .io.suggest import closest, quoted_names

    head, sep, tail = message.partition("invalid choice: ")
    if not sep:
        return message
    word, *choices = quoted_names(tail)
    best = closest(word, choices)
    return message if best is None else f"{head}{sep}{word!r}; did you mean {best!r}? " \
        f"({tail.partition(' (')[2]}"


class Version(argparse.Action):
    """``--version``: the installed package's version, looked up only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kw: Any):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_args: Any) -> NoReturn:
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("megatronapp")
        except PackageNotFoundError:
            found = "(not installed)"
        print(f"megatronapp {found}")
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    from backends.registry import add_backend_option

    parser = Parser(
        prog="megatronapp",
        description="Simulate, trace, diagnose and schedule distributed LLM training.")
    parser.add_argument("--version", action=Version)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run a scenario on a backend")
    run.add_argument("scenario", help="scenario YAML file")
    add_backend_option(run)
    run.add_argument("--out", help="output directory (default runs/<scenario name>); a new "
                     "or empty directory, or a previous result with --force")
    add_force_option(run, "a previous result in --out (only if it holds nothing else)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a scenario key, e.g. --set parallel.pp=4 (repeatable)")
    run.add_argument("--json", action="store_true", help="print the summary as JSON")
    run.add_argument("--quiet", action="store_true", help="no progress display")
    run.add_argument("--stall-timeout", type=limits.positive_seconds, default=None,
                     metavar="SECONDS",
                     help="torch backend: stop and name each rank's blocked op when no rank "
                          "makes progress for this long (default 300)")
    limits.add_options(run)
    run.add_argument("--profile", action="store_true",
                     help="torch backend: also write a torch.profiler (Kineto) trace per rank to "
                          "RUN_DIR/profile/ (read it with detect/analyze/align/query RUN_DIR/profile)")
    run.add_argument("--detect", action="store_true",
                     help="MegaScan on-line: each iteration's events as they complete; verdicts "
                          "printed as they come and written to RUN_DIR/detections.jsonl")
    run.set_defaults(func=cmd_run)

    topo = sub.add_parser("topology", help="print rank groups in Megatron-core's order")
    for name, what in (("tp", "tensor"), ("pp", "pipeline"), ("dp", "data")):
        topo.add_argument(f"--{name}", type=int, default=1, help=f"{what}-parallel size")
    topo.add_argument("--json", action="store_true", help="print the groups as JSON")
    topo.add_argument("--fbd", action="store_true",
                      help="print MegaFBD's worker threads (virtual ranks) per device")
    topo.add_argument("--forward-tp", type=int, default=None,
                      help="with --fbd: physical TP degree of the forward instance (default tp)")
    limits.add_options(topo)
    topo.set_defaults(func=cmd_topology, topology_parser=topo)

    export = sub.add_parser("export-trace", help="write a Chrome/Perfetto trace of some ranks and "
                                                 "iterations of a run")
    export.add_argument("run_dir", metavar="RUN_DIR", help="a directory written by 'megatronapp run'")
    export.add_argument("--ranks", help="ranks to keep, e.g. 0-63,100 (default all)")
    export.add_argument("--iterations", help="iterations to keep, e.g. 0 or 0-2 (default all)")
    export.add_argument("--format", choices=("chrome", "perfetto"), default="chrome",
                        help="chrome: Trace Event JSON; perfetto: Perfetto's protobuf trace")
    export.add_argument("--clock", choices=("aligned", "local"), default="aligned",
                        help="aligned: one true clock; local: each rank's own (injected skew)")
    export.add_argument("--out", help="output file (default RUN_DIR/trace-<selection>.json or "
                                      ".pftrace)")
    limits.add_options(export)
    add_force_option(export, "an existing file that megatronapp did not write")
    export.set_defaults(func=cmd_export)

    plot_hooks: list[PlotHook] = []  # each module may add its own plots
    plot = sub.add_parser("plot", help="plot a run directory or a directory of torch.profiler "
                                       "traces (timeline.png and more)")
    plot.add_argument("run_dir", help="a directory written by 'megatronapp run', or of "
                      "torch.profiler traces")
    plot.add_argument("--out", metavar="DIR", help="where the plots go (default: the run "
                      "directory; beside a folder of torch.profiler traces, FOLDER-megascan, "
                      "never inside it)")
    from .scan.cycles import add_cycle_option

    add_cycle_option(plot, each=False)
    limits.add_options(plot)
    add_force_option(plot, "existing plots that megatronapp did not write")
    plot.set_defaults(func=cmd_plot, plot_hooks=plot_hooks)

    for module in MODULE_CLIS:
        importlib.import_module(module).register(sub, plot_hooks)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        with stop_on_signals():
            status = _main(argv)
            sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
            return status
    except BrokenPipeError:  # `... | head`: stop quietly, as other command-line tools do
        _stdout_to_devnull()
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt:  # Python's own SIGINT handling (not the main thread)
        stop = Interrupted(signal.SIGINT)
    except Interrupted as interrupted:
        stop = interrupted
    _report(stop.line(), stop)
    stop.__traceback__ = None  # its frames hold the command's objects: free them now, not at exit
    return stop.exit_status


def _stdout_to_devnull() -> None:
    """Output still buffered for a closed pipe goes nowhere (else Python reports
    the broken pipe again while it exits)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help, --version and usage errors (already printed)
        return stop.code if isinstance(stop.code, int) else 2
    from .scenario.config import ScenarioError  # after parsing: --help and usage errors stay fast
    from .scan.ingest.load import TraceError

    try:
        _check_utf8(args, list(argv if argv is not None else sys.argv[1:]))
        return int(args.func(args) or 0)
    except ScenarioError as err:
        _report(f"scenario error: {err}", err)
    except (UserError, TraceError) as err:
        _report(str(err), err)
    except OSError as err:
        if err.errno not in PATH_ERRNOS or err.filename is None:
            raise
        _report(path_error_line(args, err, list(argv or sys.argv[1:])), err)
    except Exception as err:
        if not _out_of_memory(err):
            raise
        _report(f"{args.command}: out of memory ({type(err).__name__}); "
                f"{limits.readable_bytes(limits.available_memory())} available now: try a "
                "smaller input or a machine with more memory", err)
    return 2


def _check_utf8(args: argparse.Namespace, argv: list[str]) -> None:
    """Every argument is UTF-8 text (bytes that are not arrive as lone surrogates):
    one line naming the first that is not, before any command reads it."""
    for name, value in vars(args).items():
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str) and not _is_utf8(text):
                flag = "--" + name.replace("_", "-")
                option = flag if flag in argv else name.upper()
                raise UserError(f"{option}: {ascii(text)[:80]} is not UTF-8 (megatronapp takes "
                                "UTF-8 text and file names)")


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# What the file system says of a path the user named (the gate says most of it
# first; a path a command reaches on its own is said here, as one line)
PATH_ERRNOS = {errno.ENAMETOOLONG, errno.ELOOP, errno.ENOENT, errno.ENOTDIR, errno.EISDIR,
               errno.EACCES, errno.EPERM}


def path_error_line(args: argparse.Namespace, err: OSError, argv: list[str]) -> str:
    """``OPTION: PATH: reason``, the option being the argument whose value the path is in."""
    from .io.gate import shown

    path = os.fsdecode(err.filename)
    named = [name for name, value in vars(args).items()
             if any(isinstance(v, str) and v and path.startswith(v)
                    for v in (value if isinstance(value, list) else [value]))]
    dest = max(named, key=lambda n: len(str(getattr(args, n))), default=None)
    flag = None if dest is None else "--" + dest.replace("_", "-")
    option = flag if flag in argv else (dest.upper() if dest else args.command)
    return f"{option}: {shown(path)}: {err.strerror or err}"


def _out_of_memory(err: Exception) -> bool:
    """A MemoryError (pyarrow's ArrowMemoryError is one) or DuckDB's, when it
    is loaded: the limits model underestimated, or memory went elsewhere."""
    duckdb = sys.modules.get("duckdb")
    return isinstance(err, MemoryError) or (
        duckdb is not None and isinstance(err, duckdb.OutOfMemoryException))


def _report(line: str, err: BaseException) -> None:
    """One line on stderr; the traceback first only with MEGATRONAPP_DEBUG=1."""
    if os.environ.get("MEGATRONAPP_DEBUG", "") not in ("", "0"):
        traceback.print_exception(err, file=sys.stderr)
    print(f"megatronapp: {line}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
