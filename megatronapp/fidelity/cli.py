"""``megatronapp predict`` and ``megatronapp calibrate`` (the simulator's fidelity).

Heavy modules (pydantic, numpy, the simulator) are imported inside the
commands, so ``--help`` stays fast."""
from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

from ..host import limits
from ..program.backend import RunHooks
from ..io.outdirs import add_force_option
from ..io.progress import shown, status

if TYPE_CHECKING:
    from ..scenario.config import Scenario


SHOW_EVERY = 20_000  # operations between progress lines


@contextmanager
def sim_progress(enabled: bool, what: str) -> Iterator[RunHooks]:
    """A live count of simulated operations, counted by the compiled engine or
    event by event (the SimPy interpreter)."""
    count = [0]
    with status(f"{what} starting", enabled) as say:
        def counted(done: int) -> None:
            before, count[0] = count[0], count[0] + done
            if count[0] // SHOW_EVERY != before // SHOW_EVERY:
                say(f"{what} {count[0]:,} operations")

        yield RunHooks(operations=lambda done, _total: counted(done),
                       events=lambda _rank, _event: counted(1))


def simulate(s: Scenario, replica: bool, quiet: bool = False) -> list[float]:
    """The iteration times ``megatronapp run`` reports for ``s`` on the simulator
    (``replica``: one data-parallel replica stands for all), with progress on a
    terminal."""
    from backends.registry import run_named

    from ..program.backend import RunOptions
    from ..trace.summary import run_iteration_times

    with sim_progress(shown() and not quiet, f"simulating {s.name}:") as hooks:
        return run_iteration_times(run_named("sim", RunOptions(replica=replica), s, hooks))


def cmd_predict(args: argparse.Namespace) -> int:
    from dataclasses import replace
    from pathlib import Path

    from ..scenario.config import (apply_overrides, default_name, parse_scenario,
                                   read_scenario_data)
    from ..scenario.megatron_defaults import defaults_used, unset_keys
    from ..dpp.memory import MemoryExceeded
    from .predict import predict, prediction_lines
    from .published import comparison, published_row_for

    data = apply_overrides(read_scenario_data(args.scenario), args.set)
    data.setdefault("name", default_name(args.scenario))
    s = parse_scenario(data)
    try:  # the limits price the run, which compiles it: memory is checked there first
        _check_limits(args, s)
        result = predict(s, lambda sc, rep: simulate(sc, rep, args.quiet), replica=args.replica)
    except MemoryExceeded:
        if not args.json:  # show where the memory goes, then fail in one line
            print("\n".join(_memory_only(s)))
        raise
    row = published_row_for(Path(args.scenario))
    result = replace(result, defaults=tuple(defaults_used(s, unset_keys(data))),
                     published=comparison(row, bool(args.set)) if row else None)
    print(json.dumps(result.as_dict(), indent=2) if args.json
          else "\n".join(prediction_lines(result)))
    return 0


def _check_limits(args: argparse.Namespace, s: Scenario) -> None:
    """The simulation priced as ``run`` prices it (``--replica``: one data-parallel
    replica), refused before it starts when it does not fit."""
    from backends.registry import get_backend

    simulated = s
    if args.replica:
        simulated = s.model_copy(update={"parallel": s.parallel.model_copy(update={"dp": 1})})
    limits.enforce(args, limits.in_sequence([limits.estimate_run(simulated,
                                                                 get_backend("sim").size)]),
                   what="this prediction")


def _memory_only(s: Scenario) -> list[str]:
    from ..dpp.static_memory import stage_memory
    from .predict import Prediction, prediction_lines

    memory = tuple(stage_memory(s).values()) if s.schedule != "adaptive" else ()
    blank = Prediction(s.name, s.world_size, 1.0, (float("nan"),), 0.0, 0.0, memory,
                       s.cluster.gpu.memory_gb * 1e9, (), False)
    lines = prediction_lines(blank)
    return [lines[0].split(",")[0] + ": does not fit"] + [
        line for line in lines if line.startswith("  memory") or line.startswith("    ")]


def cmd_calibrate(args: argparse.Namespace) -> int:
    from .calibrate import calibrate_command

    return calibrate_command(args, lambda sc: simulate(sc, False, quiet=True))


def replica_steady_s(s: Scenario) -> float:
    """One replica's steady-state iteration time (what the published rows are judged by)."""
    from .predict import steady_state_s

    return steady_state_s(simulate(s, True, quiet=True))


def cmd_fit(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..errors import UserError
    from concurrent.futures import ProcessPoolExecutor

    from .fit_published import fit_command, parse_generation

    root = Path(args.root)
    if not (root / "scenarios" / "published" / "runs.yaml").is_file():
        raise UserError(f"--root: {root} holds no scenarios/published/runs.yaml")
    try:
        wanted = [parse_generation(g) for g in args.generation]
    except ValueError as err:
        raise UserError(f"--generation: {err}") from None
    with status("fitting", shown() and not args.quiet) as say, \
            ProcessPoolExecutor(max_workers=args.jobs) as pool:
        lines = fit_command(root, wanted, replica_steady_s, say, pool.map, args.steps)
    print("\n".join(lines))
    return 0


def register(sub: Any, plot_hooks: list) -> None:
    pred = sub.add_parser("predict", help="iteration time, MFU and memory per rank of a "
                          "scenario, simulated without writing a trace")
    pred.add_argument("scenario", help="scenario YAML file")
    pred.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a scenario key (repeatable)")
    pred.add_argument("--replica", action="store_true",
                      help="simulate one data-parallel replica plus its dp collectives "
                           "(exact without faults or jitter; much faster for large dp)")
    pred.add_argument("--json", action="store_true", help="print the prediction as JSON")
    pred.add_argument("--quiet", action="store_true", help="no progress display")
    limits.add_options(pred)
    pred.set_defaults(func=cmd_predict)

    cal = sub.add_parser("calibrate", help="fit the efficiency model to a measured run and "
                         "write a calibrated scenario")
    cal.add_argument("measured", metavar="RUN_DIR_OR_TRACE",
                     help="a run directory (megatronapp run --backend torch), its trace.json, "
                          "or a torch.profiler trace (a *.pt.trace.json[.gz] file or a "
                          "directory of one per rank)")
    cal.add_argument("--scenario", required=True,
                     help="the scenario to calibrate (written with the fitted constants)")
    cal.add_argument("--out", help="where to write the calibrated scenario "
                     "(default: SCENARIO with .calibrated.yaml)")
    cal.add_argument("--json", action="store_true", help="print the fit as JSON")
    add_force_option(cal, "an existing --out file")
    cal.set_defaults(func=cmd_calibrate)

    fid = sub.add_parser("fidelity", help="the simulator against published runs")
    fid_sub = fid.add_subparsers(dest="fidelity_command", required=True)
    fit = fid_sub.add_parser(
        "fit", help="fit each software generation's constants on its fitted published rows "
                    "and write them into the device profiles (megatronapp/scenario/"
                    "device_fits.yaml)")
    fit.add_argument("--generation", action="append", default=[], metavar="DEVICE:SOFTWARE",
                     help="fit only this generation, e.g. h100-sxm:megatron-core-0.8 "
                          "(repeatable; default: every fitted generation)")
    fit.add_argument("--root", default=".", help="the checkout whose scenarios/published/ "
                     "holds the rows (default: the current directory)")
    fit.add_argument("--jobs", type=int, default=1, help="simulations run at once")
    fit.add_argument("--steps", type=int, default=6, help="Gauss-Newton steps at most")
    fit.add_argument("--quiet", action="store_true", help="no progress display")
    fit.set_defaults(func=cmd_fit)
