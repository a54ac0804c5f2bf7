"""Run directories: staged writing, summary.json, ground truth, reading back."""
from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from .config import ClockSkew, Scenario, scenario_to_dict
from .dpp.windows import dpp_summary
from .summary import summarize
from .tracer import Event, RunResult, write_json, write_traces


@contextmanager
def staged_dir(out: Path) -> Iterator[Path]:
    """Write into a hidden sibling; it replaces ``out`` only if all went well."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


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
               "scenario": scenario_to_dict(s)}
    if "fbd" not in result.extra:  # MegaFBD runs report their own memory and idle time
        summary["dpp"] = dpp_summary(s, result.events)  # pipeline windows and peak memory
    return summary


def write_run(s: Scenario, result: RunResult, out_dir: Path) -> dict[str, Any]:
    write_traces(result, out_dir)
    summary = build_summary(s, result)
    write_json(out_dir / "ground_truth.json", ground_truth(s, result))
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def read_events(path: Path) -> dict[int, list[Event]]:
    """Events of one of our trace files (merged or per rank), in seconds, sorted."""
    from .scan.load import load_chrome_file

    return load_chrome_file(path)
