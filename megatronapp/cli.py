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
import importlib
import inspect
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

from . import limits  # light: the size model imports the scenario schema only when used
from .errors import UserError
from .interrupts import Interrupted, stop_on_signals
from .outdirs import add_force_option

BACKENDS = ("sim", "torch")
MAX_FAULT_LINES = 20  # the summary lists every fault; the terminal the first few
# Each module contributes its own subcommands through ``register(subparsers)``.
MODULE_CLIS = ("megatronapp.scan.cli", "megatronapp.fbd.cli", "megatronapp.dpp.cli",
               "megatronapp.sweep.cli", "megatronapp.scope.cli", "megatronapp.fidelity.cli")


def load_backend(name: str) -> Callable[..., Any]:
    """The entry point of a backend in ``BACKENDS`` (``--backend`` lists them)."""
    return importlib.import_module(f"backends.{name}").run_scenario


# ------------------------------------------------------------------- run
def backend_hooks(run_backend: Callable[..., Any], progress: Any) -> dict[str, Any]:
    """Operation counts from backends that report them (the compiled simulator);
    per-event hooks for those that record events one by one."""
    if "progress" in inspect.signature(run_backend).parameters:
        return {"progress": progress.operations, "on_phase": progress.phase}
    return {"on_record": progress.record, "on_phase": progress.phase}


def cmd_run(args: argparse.Namespace) -> int:
    from .config import load_scenario
    from .outdirs import check_output, staged_dir
    from .progress import RunProgress
    from .runs import write_run

    scenario = load_scenario(args.scenario, args.set)
    run_backend = load_backend(args.backend)
    backend_kw = _stall_option(args)
    out = Path(args.out or Path("runs") / scenario.name)
    check_output(out, args.force, protect=[Path(args.scenario)])
    _check_profile(args, scenario)
    limits.enforce(args, limits.estimate_run(scenario), out, backend=args.backend)
    with staged_dir(out, args.force) as tmp, RunProgress(scenario.iterations,
                                                         False if args.quiet else None) as progress:
        if args.profile:
            backend_kw["profile_dir"] = str(tmp / PROFILE_DIR)
        if args.backend == "torch":  # real runs write captures and checkpoints there
            backend_kw["out_dir"] = tmp
        result = run_backend(scenario, **backend_hooks(run_backend, progress), **backend_kw)
        progress.phase(f"writing {out}")
        summary = write_run(scenario, result, tmp, progress.counted)
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if k != "scenario"}, indent=2))
    else:
        print_summary(summary, out)
    return 0


PROFILE_DIR = "profile"  # RUN_DIR/profile/rank{r}.pt.trace.json.gz with --profile


def _check_profile(args: argparse.Namespace, scenario: Any) -> None:
    if not args.profile:
        return
    if args.backend != "torch":
        raise UserError("--profile: only the torch backend runs torch.profiler")
    if scenario.fbd is not None:
        raise UserError("--profile: decoupled (fbd) runs are not profiled")


def _stall_option(args: argparse.Namespace) -> dict[str, Any]:
    """--stall-timeout: real ranks can hang; the simulator reports deadlocks exactly."""
    if args.stall_timeout is None:
        return {}
    if not args.stall_timeout > 0:
        raise UserError(f"--stall-timeout: must be > 0 seconds, got {args.stall_timeout:g}")
    if args.backend != "torch":
        raise UserError("--stall-timeout: only the torch backend takes it")
    return {"stall_timeout_s": args.stall_timeout}


def print_summary(summary: dict[str, Any], out: Path) -> None:
    if "fbd" in summary:  # a decoupled (MegaFBD) run: devices, roles, throughput
        from .fbd.run import summary_lines

        print("\n".join(summary_lines(summary)))
    else:
        _print_pipeline_summary(summary)
    for note in summary.get("adjustments", []):  # what Megatron would silently change
        print(f"  note: {note}")
    losses = summary.get("loss_per_iteration")
    if losses:  # a real run trains: say whether it learns
        print("  loss per iteration (nats/token): " + " ".join(f"{x:.3f}" for x in losses))
    if "scope" in summary:
        from .scope.summary import run_lines

        print("\n".join(run_lines(summary["scope"], out)))
    faults = summary["faults"] or [{"kind": "none"}]
    for f in faults[:MAX_FAULT_LINES]:
        detail = ", ".join(f"{k}={v}" for k, v in f.items() if k != "kind" and v is not None)
        print(f"  fault: {f['kind']}" + (f" ({detail})" if detail else ""))
    if len(faults) > MAX_FAULT_LINES:
        print(f"  ... and {len(faults) - MAX_FAULT_LINES} more faults (see summary.json)")
    print("\n".join(written_lines(summary.get("trace", {}), out)))
    if (out / PROFILE_DIR).is_dir():
        print(f"  wrote {out / PROFILE_DIR}/ (torch.profiler traces, one per rank)")


def written_lines(trace: dict[str, Any], out: Path) -> list[str]:
    """Where the trace went, and how to look at a big one."""
    from .export import BROWSER_EVENTS

    lines = [f"  wrote {out / 'trace.parquet'} ({trace.get('events', 0):,} events; "
             f"query it with megatronapp query or DuckDB), {out / 'summary.json'}"]
    if trace.get("trace_json"):
        lines.append(f"  wrote {out / 'trace.json'} (open in https://ui.perfetto.dev)")
    else:
        lines.append(f"  no trace.json: {trace.get('events', 0):,} events are more than a browser "
                     f"opens (limit {BROWSER_EVENTS:,}); export a selection with "
                     f"megatronapp export-trace {out} --ranks 0-63 --iterations 0")
    return lines


def _print_pipeline_summary(summary: dict[str, Any]) -> None:
    times = summary["iteration_times_s"]
    mean = sum(times) / len(times) if times else float("nan")
    sc = summary["scenario"]
    p = sc["parallel"]
    print(f"{sc['name']}: {summary['backend']} backend, {summary['world_size']} ranks "
          f"(tp {p['tp']}, pp {p['pp']}, dp {p['dp']}, vpp {p['vpp']}), schedule {sc['schedule']}, "
          f"{p['microbatches']} microbatches")
    print(f"  iterations: {len(times)}, mean {mean * 1e3:.3f} ms "
          f"(min {min(times) * 1e3:.3f}, max {max(times) * 1e3:.3f})")
    print(f"  bubble fraction: {summary['bubble_fraction']:.3f}")


# -------------------------------------------------------------- topology
def cmd_topology(args: argparse.Namespace) -> int:
    from .topology import Topology

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
    from .outdirs import staged_outputs
    from .progress import status

    run_dir = Path(args.run_dir)
    written = []
    with status(f"loading {run_dir}") as say, staged_outputs(run_dir, "run_dir",
                                                            args.force) as stage:
        events = _plot_events(run_dir)  # every plot below is written, or none
        say("drawing the timeline")
        from .plots import plot_timeline  # matplotlib loads here, under the spinner

        written.append(plot_timeline(events, stage / "timeline.png", title=run_dir.name))
        for extra in args.plot_hooks:
            say("drawing each module's plots")
            written += extra(stage, events)
    paths = [run_dir / Path(p).name for p in written]
    for path in paths:
        print(f"wrote {path}")
    return 0


def _plot_events(run_dir: Path) -> dict[int, Any]:
    """A run directory's merged trace.json, else a directory of
    torch.profiler traces (aligned first); the plots go next to them."""
    from .runs import read_events
    from .scan.inputs import load_scan_input
    from .scan.kineto import kineto_files

    trace = run_dir / "trace.json"
    if trace.is_file():
        return read_events(trace)
    if run_dir.is_dir() and kineto_files(run_dir):
        return load_scan_input(run_dir).events
    raise UserError(f"run_dir: {trace} not found and no torch.profiler traces there "
                    "(run 'megatronapp run' first)")


PlotHook = Callable[[Path, dict], list[Path]]


# ---------------------------------------------------------- export-trace
def cmd_export(args: argparse.Namespace) -> int:
    from .export import parse_selection
    from .runs import export_trace

    ranks = parse_selection(args.ranks, "--ranks")
    iterations = parse_selection(args.iterations, "--iterations")
    run_dir = Path(args.run_dir)
    out = Path(args.out) if args.out else None
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
        self.exit(2, f"megatronapp: {message.removeprefix('argument ')}\n")


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
    parser = Parser(
        prog="megatronapp",
        description="Simulate, trace, diagnose and schedule distributed LLM training.")
    parser.add_argument("--version", action=Version)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run a scenario on a backend")
    run.add_argument("scenario", help="scenario YAML file")
    run.add_argument("--backend", default="sim", choices=BACKENDS,
                     help="sim: the SimPy cluster model; torch: real torch.distributed ranks")
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
    add_force_option(export, "an existing file that megatronapp did not write")
    export.set_defaults(func=cmd_export)

    plot_hooks: list[PlotHook] = []  # each module may add its own plots
    plot = sub.add_parser("plot", help="plot a run directory or a directory of torch.profiler "
                                       "traces (timeline.png and more)")
    plot.add_argument("run_dir", help="a directory written by 'megatronapp run', or of "
                      "torch.profiler traces")
    add_force_option(plot, "existing plots that megatronapp did not write")
    plot.set_defaults(func=cmd_plot, plot_hooks=plot_hooks)

    for module in MODULE_CLIS:
        importlib.import_module(module).register(sub, plot_hooks)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        with stop_on_signals():
            return _main(argv)
    except KeyboardInterrupt:  # Python's own SIGINT handling (not the main thread)
        stop = Interrupted(signal.SIGINT)
    except Interrupted as interrupted:
        stop = interrupted
    _report(stop.line(), stop)
    return stop.exit_status


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help, --version and usage errors (already printed)
        return stop.code if isinstance(stop.code, int) else 2
    from .config import ScenarioError  # after parsing: --help and usage errors stay fast
    from .scan.load import TraceError

    try:
        return int(args.func(args) or 0)
    except ScenarioError as err:
        _report(f"scenario error: {err}", err)
    except (UserError, TraceError) as err:
        _report(str(err), err)
    return 2


def _report(line: str, err: BaseException) -> None:
    """One line on stderr; the traceback first only with MEGATRONAPP_DEBUG=1."""
    if os.environ.get("MEGATRONAPP_DEBUG", "") not in ("", "0"):
        traceback.print_exception(err, file=sys.stderr)
    print(f"megatronapp: {line}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
