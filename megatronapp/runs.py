"""Run directories: summary.json, ground truth, writing a run, reading back.

Where a run may be written, and how it is published, is ``outdirs``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .config import ClockSkew, Scenario, adjustments, scenario_to_dict
from .dpp.windows import dpp_summary
from .errors import UserError
from .outdirs import staged_dir  # noqa: F401 (runs are written through it)
from .summary import summarize
from .tracer import Event, RunResult, write_json, write_traces


def ground_truth(s: Scenario, result: RunResult) -> dict[str, Any]:
    """What was injected, for scoring detectors and aligners."""
    faults = [f.model_dump(mode="json") for f in s.faults]
    clocks = {str(r): {"offset_us": c.offset_us, "drift_ppm": c.drift_ppm}
              for r, c in sorted(result.clocks.items())}
    skewed = [f.rank for f in s.faults if isinstance(f, ClockSkew)]
    truth = {"faults": faults, "clocks": clocks, "skewed_ranks": skewed}
    if "fbd" in result.extra:  # trace pids are MegaFBD worker threads, fault ranks devices
        device_of = result.extra["fbd"]["device_of_worker"]
        truth.update(skewed_ranks=[int(w) for w, d in device_of.items() if d in skewed],
                     skewed_devices=skewed, device_of_pid=device_of)
    return truth


def build_summary(s: Scenario, result: RunResult) -> dict[str, Any]:
    summary = {"backend": result.backend, "world_size": result.topo.world_size,
               "schedule": s.schedule, **summarize(result.events),
               "faults": ground_truth(s, result)["faults"], **result.extra,
               "adjustments": adjustments(s), "scenario": scenario_to_dict(s)}
    if "fbd" not in result.extra:  # MegaFBD runs report their own memory and idle time
        summary["dpp"] = dpp_summary(s, result.events)  # pipeline windows and peak memory
    return summary


def finite_json(data: Any) -> Any:
    """``data`` with every NaN or infinity replaced by null: JSON has no such
    numbers (an empty run's mean is undefined, not an invalid file)."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: finite_json(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite_json(v) for v in data]
    return data


def write_run(s: Scenario, result: RunResult, out_dir: Path) -> dict[str, Any]:
    """Traces, ground truth and summary.json; an OSError (a full disk) is one line."""
    summary = finite_json(build_summary(s, result))
    try:
        write_traces(result, out_dir)
        write_json(out_dir / "ground_truth.json", finite_json(ground_truth(s, result)))
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False))
    except OSError as err:
        raise UserError(f"--out: cannot write the result: {err.strerror or err}") from None
    return summary


def read_events(path: Path) -> dict[int, list[Event]]:
    """Events of one of our trace files (merged or per rank), in seconds, sorted."""
    from .scan.load import load_chrome_file

    return load_chrome_file(path)
