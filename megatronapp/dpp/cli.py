"""``megatronapp dpp ...``: window metrics of a run, schedule comparisons."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from ..host import limits
from ..parallel.schedules import SCHEDULES

if TYPE_CHECKING:
    from ..scenario.config import Scenario

COMPARED = ("1f1b", "interleaved", "dfc", "bfc", "adaptive")
COLUMNS = ("iteration_ms", "p2p_send_window_ms", "allreduce_window_ms", "compute_ratio",
           "p2p_bandwidth_demand_gbps", "peak_memory_gb")


def scenario_for(data: dict[str, Any], schedule: str, overrides: Sequence[str] = ()) -> Scenario:
    """One scenario file run under another schedule (1F1B has no chunks)."""
    from ..scenario.config import apply_overrides, parse_scenario

    sets = [f"schedule={schedule}", *overrides]
    if schedule in ("gpipe", "1f1b"):
        sets.append("parallel.vpp=1")
    return parse_scenario(apply_overrides(data, sets))


def compare_row(s: Scenario) -> dict[str, float]:
    """Simulate one scenario; its iteration time, windows and peak memory."""
    from backends.registry import run_named

    from ..program.backend import RunOptions
    from ..trace.summary import iteration_times
    from .windows import dpp_summary

    events = run_named("sim", RunOptions(), s).events
    d = dpp_summary(s, events)
    times = iteration_times(events)
    return {"iteration_ms": sum(times) / len(times) * 1e3,
            "p2p_send_window_ms": d["p2p_send_window_s"] * 1e3,
            "allreduce_window_ms": d["allreduce_window_s"] * 1e3,
            "compute_ratio": d["compute_ratio"],
            "p2p_bandwidth_demand_gbps": d["p2p_bandwidth_demand_gbps"],
            "peak_memory_gb": d["peak_memory_bytes"] / 1e9}


def compare(data: dict[str, Any], schedules: Sequence[str], overrides: Sequence[str] = (),
            progress: bool = False) -> dict[str, dict[str, float] | str]:
    """schedule -> its row, or the one-line reason it cannot run (memory)."""
    from ..scenario.config import ScenarioError
    from ..io.progress import status

    rows: dict[str, dict[str, float] | str] = {}
    with status("simulating", None if progress else False) as say:
        for schedule in schedules:
            say(f"simulating {schedule} ({len(rows) + 1}/{len(schedules)})")
            s = scenario_for(data, schedule, overrides)
            try:
                rows[schedule] = compare_row(s)
            except ScenarioError as err:
                if err.field != "cluster.gpu.memory_gb":
                    raise
                rows[schedule] = f"does not fit: {err.reason}"
    return rows


def format_table(rows: dict[str, dict[str, float] | str], title: str = "") -> str:
    lines = [title] if title else []
    lines.append(f"{'schedule':<12}" + "".join(f"{c:>27}" for c in COLUMNS))
    for schedule, row in rows.items():
        if isinstance(row, str):
            lines.append(f"{schedule:<12}  {row}")
        else:
            lines.append(f"{schedule:<12}" + "".join(f"{row[c]:>27.3f}" for c in COLUMNS))
    return "\n".join(lines)


def cmd_compare(args: argparse.Namespace) -> int:
    from backends.registry import get_backend

    from ..scenario.config import default_name, read_scenario_data
    from ..errors import UserError

    schedules = [x for x in args.schedules.split(",") if x]
    for schedule in schedules:
        if schedule not in SCHEDULES:
            raise UserError(f"--schedules: unknown schedule {schedule!r}")
    data = read_scenario_data(args.scenario)
    data.setdefault("name", default_name(args.scenario))
    count = get_backend("sim").size  # compare simulates every schedule
    limits.enforce(args, limits.estimate_runs((scenario_for(data, schedule, args.set)
                                               for schedule in schedules), count),
                   what=f"comparing {len(schedules)} schedules")
    rows = compare(data, schedules, args.set, progress=not args.json)
    print(json.dumps(rows, indent=2) if args.json else format_table(rows, data["name"]))
    return 0


def cmd_windows(args: argparse.Namespace) -> int:
    from ..errors import UserError
    from ..scan.ingest.load import load_chrome_file
    from .windows import window_metrics

    trace = Path(args.run_dir) / "trace.json"
    if not trace.is_file():
        raise UserError(f"run_dir: {trace} not found (run 'megatronapp run' first)")
    metrics = window_metrics(load_chrome_file(trace)).as_dict()
    for key, value in in_milliseconds(metrics).items():
        print(f"{key:<28}{value:.6g}")
    return 0


def in_milliseconds(metrics: dict[str, float]) -> dict[str, float]:
    """Durations (``*_s``) in ms, as ``dpp compare`` prints them; other values as they are."""
    return {(k[:-2] + "_ms" if k.endswith("_s") else k): (v * 1e3 if k.endswith("_s") else v)
            for k, v in metrics.items()}


def plot_hook(run_dir: Path, events: dict, _focus: Any = None) -> list[Path]:
    """``megatronapp plot`` adds the window metrics (the root cause is not theirs
    to mark), unless the trace has none to show."""
    from ..trace.timeline import save
    from .plots import window_values, windows_figure

    values = window_values(events)
    if values.empty():
        print("no dpp_windows.png: the trace has no pipeline sends, all-reduce windows or "
              "stored activations")
        return []
    return [save(windows_figure(values, title=Path(run_dir).name),
                 Path(run_dir) / "dpp_windows.png")]


def register(subparsers: Any, plot_hooks: list) -> None:
    """Add ``dpp compare`` and ``dpp windows``; ``megatronapp plot`` draws windows too."""
    dpp = subparsers.add_parser("dpp", help="MegaDPP: pipeline windows and schedule comparison")
    sub = dpp.add_subparsers(dest="dpp_command", required=True)
    comp = sub.add_parser("compare", help="simulate one scenario under several schedules")
    comp.add_argument("scenario", help="scenario YAML file")
    comp.add_argument("--schedules", default=",".join(COMPARED),
                      help=f"comma-separated, from {', '.join(SCHEDULES)}")
    comp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a scenario key (repeatable)")
    comp.add_argument("--json", action="store_true", help="print the rows as JSON")
    limits.add_options(comp)
    comp.set_defaults(func=cmd_compare)
    win = sub.add_parser("windows", help="window metrics of a run directory")
    win.add_argument("run_dir", help="a directory written by 'megatronapp run'")
    win.set_defaults(func=cmd_windows)
    plot_hooks.append(plot_hook)
