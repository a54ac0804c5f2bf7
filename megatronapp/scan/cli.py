"""MegaScan's subcommands: detect, analyze, query, align, validate-detector."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from megatronapp.host import limits
from megatronapp.host.limits import COSTS
from megatronapp.errors import UserError
from megatronapp.io.outdirs import add_force_option
from megatronapp.io.progress import Say, status

from megatronapp.scan.cycles import (add_cycle_option, per_cycle_json, per_cycle_lines,
                                     warn_missing)
from megatronapp.scan.ingest.folders import ALL, EACH
from megatronapp.scan.methods import DETECTORS

if TYPE_CHECKING:
    from megatronapp.program.backend import Backend
    from megatronapp.trace.events import RunScenario

TARGET_HELP = ("a run directory (its per-rank raw clocks are aligned first), a folder of "
               "torch.profiler traces, or a trace file")
JSON_HELP = "print JSON instead of text"


SCENARIO_SUFFIXES = (".yaml", ".yml")  # what a trace command is given by mistake


def _scan_input(target: str, say: Say, max_bytes: float | None = None,
                cycle: int | str = ALL) -> Any:
    """``target``'s events, each JSON file's text capped at ``max_bytes``
    (default: what this machine's memory can parse); of a torch.profiler
    folder its ``cycle`` (merged: ``all``). Ranks missing are named on
    stderr (``warn_missing``)."""
    ((trace, scan),) = _scan_inputs(target, say, max_bytes, cycle)
    return scan


def _scan_inputs(target: str, say: Say, max_bytes: float | None = None,
                 cycle: int | str = EACH) -> list[tuple[Any, Any]]:
    """(trace, its ScanInput) per profiling cycle read (one for other targets)."""
    from megatronapp.scan.align.inputs import prepare_loaded
    from megatronapp.scan.ingest.load import load_traces

    traces = _side_file(lambda t: load_traces(t, say=say, max_bytes=max_bytes, cycle=cycle),
                        target)
    warn_missing(traces)  # rich's spinner prints it above itself
    return [(trace, prepare_loaded(trace, say)) for trace in traces]


def check_trace(args: argparse.Namespace, target: str | Path, what: str,
                cost: limits.TraceCost) -> None:
    """Refuse a trace too large for this machine before reading its events:
    its size (a store's row count, a JSON trace's bytes) times the command's
    ``cost`` per event, against the memory available and ``--max-seconds``;
    a command that feeds a store batch by batch is priced by its largest
    batch and the detector's state (``inputs.batching``)."""
    from megatronapp.scan.align.inputs import batching, store_of
    from megatronapp.scan.ingest.load import locate_trace, trace_size

    if args.no_limits:
        return
    size = _side_file(lambda t: trace_size(locate_trace(t)), target)
    store = store_of(target) if cost.batched else None
    fed = _side_file(batching, store) if store is not None else None  # a batch at a time
    limits.enforce(args, limits.estimate_trace(size.stored_events, size.text_bytes, cost, fed),
                   what=f"{what} on {target}")


def _side_file(read: Callable[[Any], Any], target: Any) -> Any:
    """``read(target)``, its TraceError as one line naming the argument."""
    from megatronapp.scan.ingest.load import TraceError

    try:
        return read(target)
    except TraceError as err:
        if Path(str(target)).suffix.lower() in SCENARIO_SUFFIXES:  # the commonest mix-up
            raise UserError(f"RUN_DIR_OR_TRACE: {target} is a scenario file, not a trace; did "
                            f"you mean `megatronapp run {target}`, then this command on its "
                            "run directory?") from None
        raise UserError(f"RUN_DIR_OR_TRACE: {err}") from None



# ---------------------------------------------------------------- detect
def cmd_detect(args: argparse.Namespace) -> int:
    from megatronapp.scan.align.inputs import store_of

    columns = store_of(args.target) is not None and args.method == "megascan"
    check_trace(args, args.target, "detect", COSTS.detect_columns if columns
                else COSTS.detect_events)
    with status("reading the trace") as say:
        results = _diagnose(args, say, _scenario(args.scenario))
    if args.json:
        print(json.dumps(per_cycle_json(results, lambda d: d.to_json()), indent=2))
    else:
        print("\n".join(per_cycle_lines(results, lambda d: explain(d.to_json()))))
    return 0


def _scenario(path: str | None) -> Any:
    from megatronapp.scenario.config import ScenarioError, load_scenario

    try:
        return load_scenario(path) if path else None
    except ScenarioError as err:
        field = "" if err.field == "scenario" else f"{err.field}: "
        raise UserError(f"--scenario: {field}{err.reason}") from None


def _diagnose(args: argparse.Namespace, say: Say, scenario: Any = None) -> list[tuple[Any, Any]]:
    """(trace, diagnosis) per profiling cycle read (one for other targets).
    MegaScan on a stored run reads its typed columns only, a few whole
    iterations at a time (millions of events); other inputs, and the
    baselines, read every field at once. ``scenario``, when given, replaces
    the one a run directory records."""
    from dataclasses import replace

    from megatronapp.scan.evidence.detect import megascan_stored
    from megatronapp.scan.align.inputs import store_of
    from megatronapp.scan.ingest.load import LoadedTrace
    from megatronapp.scan.methods import detector

    store, method = store_of(args.target), args.method
    if store is not None and method == "megascan":
        say(f"detecting (megascan) on {store}, a few iterations at a time")
        return [(LoadedTrace({}, True, str(store)),
                 _side_file(lambda s: megascan_stored(s, scenario), store))]
    out = []
    for trace, scan in _scan_inputs(args.target, say, limits.json_text_cap(args), args.cycle):
        say(f"detecting ({method})")
        out.append((trace, detector(method)(scan if scenario is None
                                            else replace(scan, scenario=scenario))))
    return out


def sig(x: float, unit: str = "") -> str:
    """``x`` with three significant digits (and ``unit``)."""
    return f"{x:.3g}{unit}"


def ms(seconds: float) -> str:
    return sig(seconds * 1e3, " ms")


WHAT = {"compute": "its compute", "host": "its time between ops (host: data loading, Python, "
        "a stall)", "link": "its transfers"}
# what a suspect slow at no cost may be: a link's transfers are also slowed by
# others crowding it (a slow rank's schedule), which the model cannot tell apart
WATCH = {"compute": "degraded hardware to watch",
         "link": "a degraded link, or one crowded by other transfers, to watch"}
EXPECTED_FROM = {"peers": "its peers' speed", "model": "the scenario's cost model",
                 "own iterations": "its own typical iteration",
                 "links of its class": "links of its class", "all ranks": "every rank's"}


def explain(d: dict[str, Any]) -> Iterator[str]:
    """A few lines a person can check against the trace: each root cause's
    blame first (how much of each iteration it costs), then what it ran
    against what it should have, then the noise it stands out of."""
    if d["healthy"]:
        yield ("healthy: no rank or link costs its iterations time beyond what its peers "
               "(or the cost model) and the run's own noise allow")
    for c in d["root_causes"]:
        ev = c["evidence"]
        yield f"root cause: {_who(c)} ({c['kind']}, confidence {c['confidence']:.2f})"
        if "blame_s" not in ev:  # a baseline's finding: its own evidence, as it gave it
            yield "  " + ", ".join(f"{k} {sig(v) if isinstance(v, float) else v}"
                                   for k, v in ev.items())
            continue
        yield (f"  blame: {ms(ev['blame_s'])} of each {ms(ev['iteration_s'])} iteration "
               f"({100 * ev['share']:.3g}%): how much sooner it would end at the expected time")
        yield (f"  {WHAT[c['kind']]} took {ms(ev['actual_s'])} per iteration; at "
               f"{EXPECTED_FROM.get(ev['expected_from'], ev['expected_from'])} "
               f"{ms(ev['expected_s'])}; the run's noise there is {ms(ev['noise_s'])} "
               f"({sig(ev['noise_units'])} noise units over)")
        hit = ev.get("iterations_hit")
        if isinstance(hit, list):
            yield (f"  intermittent: in iterations {', '.join(map(str, hit))} of the "
                   f"{ev['iterations_seen']} seen")
        also = ev.get("also")
        if also:
            yield f"  also {WHAT[also['kind']]}: {ms(also['blame_s'])} of blame"
    yield from _without_cost(d)
    if d["victims"]:
        shown = ", ".join(map(str, d["victims"][:16]))
        more = f" and {len(d['victims']) - 16} more" if len(d["victims"]) > 16 else ""
        yield f"victims (waited on a root cause, not faulty themselves): {shown}{more}"
    yield from _bottleneck(d)


def _who(c: dict[str, Any]) -> str:
    """A cause's suspect as a person reads it: a rank, or a link's two ends."""
    return f"link {c['rank']} <-> {c['peer']}" if c["kind"] == "link" else f"rank {c['rank']}"


def _without_cost(d: dict[str, Any]) -> Iterator[str]:
    """Suspects slow throughout whose slowness the job did not wait for."""
    for c in d.get("slow_without_cost") or ():
        ev = c["evidence"]
        yield (f"slow, at (almost) no cost yet: {_who(c)} ({c['kind']}): {WHAT[c['kind']]} took "
               f"{ms(ev['actual_s'])} per iteration against {ms(ev['expected_s'])} expected "
               f"({sig(ev['noise_units'])} noise units over) in every iteration, but cost "
               f"{100 * ev['share']:.2g}% of it: not a root cause; {WATCH[c['kind']]}")


def _bottleneck(d: dict[str, Any]) -> Iterator[str]:
    b, unjudged = d.get("bottleneck") or {}, d.get("unjudged") or {}
    if b:
        yield (f"bottleneck: rank {b['rank']} held {100 * b['share']:.3g}% of the critical path "
               f"(compute {100 * b['compute_share']:.3g}%, host {100 * b['host_share']:.3g}%, "
               f"communication {100 * b['communication_share']:.3g}%): where the time goes, "
               "not a fault by itself")
    for kind, n in unjudged.items():
        yield (f"unjudged: {n} {kind} suspect(s) had nothing to be compared with (no peers "
               "doing the same work, no cost model, too few iterations): a fault there cannot "
               "be told from its share of the work")
    if d.get("links_unjudged_at"):
        yield (f"links unjudged at ranks {', '.join(map(str, d['links_unjudged_at']))}: some of "
               "their transfers' peers are not in the trace (profile with record_shapes=True "
               "to record them)")


# --------------------------------------------------------------- analyze
def cmd_analyze(args: argparse.Namespace) -> int:
    from megatronapp.scan.analyze import analyze, format_analysis

    check_trace(args, args.target, "analyze", COSTS.analyze)
    with status("reading the trace") as say:
        results = [(trace, analyze(scan.events, scan.ops, say)) for trace, scan in
                   _scan_inputs(args.target, say, limits.json_text_cap(args), args.cycle)]
    if args.json:
        print(json.dumps(per_cycle_json(results, lambda r: r), indent=2))
    else:
        print("\n".join(per_cycle_lines(results, lambda r: [format_analysis(r)])))
    return 0


# ----------------------------------------------------------------- query
def cmd_query(args: argparse.Namespace) -> int:
    from megatronapp.scan.query import (Output, QueryLimits, answer, read_only, sandboxed,
                                        scan_loader, show)

    read_only(args.sql)  # one SELECT, before the trace is read
    check_trace(args, args.target, "query", COSTS.query)
    rules = QueryLimits.of(args, args.allow_external_access)
    with status("reading the trace") as say:
        scan = _scan_input(args.target, say, limits.json_text_cap(args), args.cycle)
        say("running the query")
        output = Output.of(args)
        result = answer(sandboxed(scan_loader(scan), rules), args.sql, output,
                        Path(args.target), rules.max_seconds)
    show(result, output)
    return 0


# ----------------------------------------------------------------- align
ALIGNED = "aligned_trace.json"


def cmd_align(args: argparse.Namespace) -> int:
    from megatronapp.io.outdirs import check_file, new_file, outputs_folder
    from megatronapp.trace.events import chrome_events, write_json

    from megatronapp.scan.align.align import trace_span
    from megatronapp.scan.eval.clock_truth import read_truth_clocks, score_against_truth
    from megatronapp.scan.ingest.deps import annotate
    from megatronapp.scan.placement import check_folder, default_outputs, home_of

    run_dir = home_of(Path(args.target))
    out = Path(args.out) if args.out else default_outputs(Path(args.target)) / ALIGNED
    inputs = _align_inputs(Path(args.target), run_dir)
    if args.out or out.parent.exists():  # before the work, not after
        check_file(out, "--out", args.force, inputs)
    else:
        check_folder(out.parent)
    check_trace(args, args.target, "align", COSTS.align)
    with status("reading the trace") as say:
        scan = _scan_input(args.target, say, limits.json_text_cap(args), args.cycle)
        if not args.out:
            outputs_folder(out.parent, "--out")
        truth = run_dir / "ground_truth.json"
        truth_clocks = (_side_file(read_truth_clocks, truth)
                        if scan.clocks and truth.is_file() else None)
        say(f"writing {out}")
        events = annotate(scan.events, list(scan.ops))
        merged = [ev for r in sorted(events)
                  for ev in chrome_events(r, f"rank {r}", events[r], lambda t: t)]
        with new_file(out, "--out", args.force, inputs) as tmp:
            write_json(tmp, {"traceEvents": merged, "displayTimeUnit": "ms",
                             "metadata": {"clock": "aligned"}})
    report: dict[str, Any] = {"wrote": str(out), "sync_ops": len(scan.ops),
                              "clocks": {str(r): {"offset_us": f.offset_us, "drift_ppm": f.drift_ppm,
                                                  "anchors": f.anchors} for r, f in scan.clocks.items()}}
    if truth_clocks is not None:
        report["error_vs_ground_truth"] = score_against_truth(
            scan.clocks, truth_clocks, ref=min(scan.clocks), span=trace_span(scan.events))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"wrote {out} ({len(scan.ops)} sync ops linked as related_sync_op)")
        if not scan.clocks:
            print("input was already aligned; clocks left as they are")
        if "error_vs_ground_truth" in report:
            e = report["error_vs_ground_truth"]
            print(f"offset error vs ground truth: median {e['offset_err_median_us']:.4f} us, "
                  f"worst {e['offset_err_max_us']:.4f} us; drift error worst "
                  f"{e['drift_err_max_ppm']:.4f} ppm over {e['ranks']} ranks")
    return 0


def _align_inputs(target: Path, run_dir: Path) -> list[Path]:
    """What align reads, which --out may never replace: the trace file, or a
    directory's torch.profiler traces, and the ground truth beside them (a
    run directory's own files its manifest protects)."""
    from megatronapp.io.outdirs import path_errors

    from megatronapp.scan.ingest.kineto import kineto_files

    with path_errors("RUN_DIR_OR_TRACE", target):
        traces = kineto_files(target) if target.is_dir() else [target]
    return [*traces, run_dir / "ground_truth.json"]


# ---------------------------------------------------- validate-detector
def cmd_validate(args: argparse.Namespace) -> int:
    from backends.registry import get_backend

    from megatronapp.program.backend import REAL
    from megatronapp.host.executors import Where, where_from
    from megatronapp.io.outdirs import check_file

    from megatronapp.scan.eval.trials import PLANS
    from megatronapp.scan.eval.validate import estimate_trials, replay_trials, run_trials

    if args.replay:
        corpora = [Path(d) for d in args.replay]
        for corpus in corpora:
            if not corpus.is_dir():
                raise UserError(f"--replay: {corpus} is not a directory")
        check_file(Path(args.csv), "--csv", args.force, corpora, make_parent=True)  # before scoring
        return _report(_collect(lambda _started: (r for c in corpora for r in replay_trials(c)),
                                None, "scoring saved trials"), args, "replayed")
    backend = get_backend(args.backend)
    real = REAL in backend.capabilities
    trials = args.trials if args.trials is not None else DEFAULT_TRIALS["torch" if real else "sim"]
    if trials < 1:
        raise UserError("--trials: must be >= 1")
    name = ("real" if real else "sim") + ("-new" if args.fault_kinds == "new" else "")
    run, plan = _validation_run(args, backend), PLANS[name]
    where = Where() if real else where_from(args)  # real runs: one at a time
    limits.enforce(args, estimate_trials(plan, args.seed, trials, where, get_backend("sim").size,
                                         real), what=f"validate-detector ({trials:,} trials)")
    keep = Path(args.save_runs) if args.save_runs else (
        Path(DEFAULT_REAL_CORPUS) / f"seed{args.seed}" if real else None)
    if keep is not None and where.ray_address:
        raise UserError("--save-runs: trials on a Ray cluster write on its machines; "
                        "keep runs only on local processes")
    check_file(Path(args.csv), "--csv", args.force, make_parent=True)  # before the trials
    label = "running and scoring real trials" if real else "simulating and scoring trials"
    done = _collect(lambda started: run_trials(args.seed, trials, where, run, plan, keep,
                                               on_start=started), trials, label)
    if keep is not None:
        print(f"kept every trial's run directory under {keep} (score again with --replay {keep})")
    return _report(done, args, plan.name, plan.bands)


DEFAULT_TRIALS = {"sim": 500, "torch": 100}
DEFAULT_REAL_CORPUS = "runs/validate-detector-torch"


def _validation_run(args: argparse.Namespace, backend: Backend) -> RunScenario:
    """The run function handed to the harness (it is pickled)."""
    from backends.registry import run_function

    from megatronapp.program.backend import REAL, RunOptions

    if REAL not in backend.capabilities:
        return run_function(backend.name)
    if args.jobs not in (None, 1):
        raise UserError("--jobs: real runs share this machine's cores; run them one at a time (1)")
    if args.ray is not None:
        raise UserError("--ray: real trials run on this machine, not on a Ray cluster")
    return run_function(backend.name, RunOptions(stall_timeout_s=REAL_STALL_TIMEOUT_S))


REAL_STALL_TIMEOUT_S = 120.0


def _collect(reports: Callable[[Callable[[Any], None]], Iterator[Any]], total: int | None,
             label: str) -> list[Any]:
    """Every report of ``reports(started)``, while the progress line says how
    many are done and which trial runs now (``started`` is told each trial)."""
    of = f"/{total}" if total else ""
    done: list[Any] = []
    with status(f"{label}: starting") as say:
        def started(trial: Any) -> None:
            p = trial.scenario.parallel
            say(f"{label}: {len(done)}{of} done; trial {trial.index}: {trial.band}, "
                f"tp {p.tp} pp {p.pp} dp {p.dp}")

        for report in reports(started):
            done.append(report)
            say(f"{label}: {len(done)}{of} done")
    return done


def _report(reports: list[Any], args: argparse.Namespace, what: str,
            bands: Any = None) -> int:
    from megatronapp.scan.eval.trials import CONTROLS, PLANS
    from megatronapp.scan.eval.validate import alignment_line, markdown_table, real_run_lines, summarize, write_csv

    ok = [r for r in reports if r.error is None]
    if bands is None:  # replayed: every plan's bands, controls last
        faults = [b for plan in PLANS.values() for b in plan.bands if b not in CONTROLS]
        bands = faults + list(CONTROLS)
    rows = summarize([o for r in ok for o in r.outcomes], bands)
    write_csv(rows, Path(args.csv), args.force)
    print(markdown_table(rows))
    print("\n" + alignment_line(ok))
    real = real_run_lines(reports, bands)
    if real:
        print("\n".join(real))
    seconds = sum(r.seconds for r in reports)
    print(f"{len(ok)} {what} trials scored in {seconds:.1f} s of trial time "
          f"({seconds / max(1, len(reports)):.2f} s per trial)")
    for r in reports:
        if r.error is not None:
            print(f"trial {r.index} failed to run: {r.error}")
    print(f"wrote {args.csv}")
    return 0


# -------------------------------------------------------------- register
def plot_hook(run_dir: Path, events: dict, focus: Any = None) -> list[Path]:
    """``megatronapp plot`` adds MegaScan's heat map and Marey graph, the root
    cause (``focus``, a ``PlotFocus``) marked on both."""
    from megatronapp.scan.evidence.focus import PlotFocus
    from megatronapp.scan.plots import plot_hook as draw

    return draw(run_dir, events, focus or PlotFocus())


def register(subparsers: Any, plot_hooks: list) -> None:
    from backends.registry import add_backend_option

    """Add this module's subcommands; ``plot_hooks`` gets extra plotters."""
    from megatronapp.host.executors import add_where_options

    plot_hooks.append(plot_hook)
    detect = subparsers.add_parser("detect", help="name the root-cause slow rank or link")
    detect.add_argument("target", metavar="RUN_DIR_OR_TRACE", help=TARGET_HELP)
    detect.add_argument("--json", action="store_true", help=JSON_HELP)
    detect.add_argument("--method", default="megascan", choices=DETECTORS,
                        help="MegaScan's detector or a baseline to compare it with")
    detect.add_argument("--scenario", metavar="SCENARIO",
                        help="the scenario the traced job ran, where the trace does not record "
                             "it (a torch.profiler trace): pipeline stages without peers are "
                             "then compared per unit of the work each op models")
    add_cycle_option(detect, each=True)
    limits.add_options(detect)
    detect.set_defaults(func=cmd_detect)

    analyze = subparsers.add_parser(
        "analyze", help="per-rank compute/comm/idle time, bubbles, the critical path")
    analyze.add_argument("target", metavar="RUN_DIR_OR_TRACE", help=TARGET_HELP)
    analyze.add_argument("--json", action="store_true", help=JSON_HELP)
    add_cycle_option(analyze, each=True)
    limits.add_options(analyze)
    analyze.set_defaults(func=cmd_analyze)

    from megatronapp.scan.query_options import add_output_options  # no DuckDB import: --help stays fast

    query = subparsers.add_parser("query", help="SQL over the trace's events table (DuckDB)")
    query.add_argument("target", metavar="RUN_DIR_OR_TRACE", help=TARGET_HELP)
    query.add_argument("sql", help='e.g. "SELECT rank, sum(dur_us) FROM events GROUP BY rank"')
    add_output_options(query)
    add_cycle_option(query, each=False)
    query.add_argument("--allow-external-access", action="store_true",
                       help="let the SQL read and write files, attach databases and load "
                            "extensions (off by default: the query sees only the events table)")
    query.set_defaults(func=cmd_query)

    align = subparsers.add_parser("align", help="align per-rank clocks, link sync ops, write trace")
    align.add_argument("target", metavar="RUN_DIR_OR_TRACE", help=TARGET_HELP)
    align.add_argument("--out", help=f"output trace (default: RUN_DIR/{ALIGNED} in a run "
                       f"directory; beside a folder of torch.profiler traces, "
                       f"FOLDER-megascan/{ALIGNED}, never inside it)")
    align.add_argument("--json", action="store_true", help=JSON_HELP)
    add_cycle_option(align, each=False)
    limits.add_options(align)
    add_force_option(align)
    align.set_defaults(func=cmd_align)

    val = subparsers.add_parser("validate-detector", help="measure detector accuracy vs ground truth")
    add_backend_option(val, help_of={
        "sim": "simulated jobs of 2-64 ranks", "torch": "real jobs of 2-4 ranks (one thread "
        "each) with real injected faults"})
    val.add_argument("--trials", type=int, default=None,
                     help=f"default {DEFAULT_TRIALS['sim']} (sim) or {DEFAULT_TRIALS['torch']} (torch)")
    val.add_argument("--seed", type=int, default=0, help="seed of the trials' random draws")
    val.add_argument("--fault-kinds", choices=("classic", "new"), default="classic",
                     help="classic: throttle, slow_link, link_jitter; new: host_stall, "
                          "intermittent throttle, link_flap, device_variation")
    add_where_options(val)
    val.add_argument("--csv", default="runs/validate-detector.csv", help="where to write the table")
    add_force_option(val, "an existing --csv file")
    val.add_argument("--save-runs", metavar="DIR", default=None,
                     help="keep each trial's run directory here, replacing trials kept there before "
                          f"(torch default: {DEFAULT_REAL_CORPUS}/seedS)")
    val.add_argument("--replay", metavar="DIR", nargs="+", default=None,
                     help="score the trials saved in each DIR again (one table), running nothing")
    limits.add_options(val)
    val.set_defaults(func=cmd_validate)
