"""Cut a torch.profiler (Kineto) trace down to a few whole profiler steps.

    python tests/data/gpu_public/downsample.py SRC.json.gz DST.json.gz --first 2 --steps 2

Keeps the file's header (``distributedInfo``, ``deviceProperties``, ...),
every metadata event, the CPU events that lie inside the kept
``ProfilerStep#N`` ranges, and on every stream the GPU work those CPU events
launched (linked by correlation id), with the flows and GPU ranges between
them. Work launched before the first kept step (still running when it
starts) goes with its launch. Written gzipped, with no timestamp in the gzip
header, so a rerun gives the same bytes.
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path
from typing import Any

STEP = re.compile(r"ProfilerStep#(\d+)$")
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}
FLOW_PHASES = {"s", "t", "f"}


def read(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        data: dict[str, Any] = json.load(fh)
    return data


def kept_window(events: list[dict[str, Any]], first: int, steps: int) -> tuple[float, float]:
    """(start, end) in µs of ``steps`` profiler steps from the ``first``-th (0-based)."""
    ranges = sorted({(e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("ph") == "X" and e.get("cat") != "gpu_user_annotation"
                     and STEP.match(str(e.get("name", "")))})
    chosen = ranges[first:first + steps]
    if len(chosen) < steps:
        raise SystemExit(f"the trace has {len(ranges)} profiler steps, fewer than "
                         f"{first + steps}")
    return chosen[0][0], chosen[-1][1]


def downsample(data: dict[str, Any], first: int, steps: int) -> dict[str, Any]:
    events = data["traceEvents"]
    lo, hi = kept_window(events, first, steps)
    cpu = [e for e in events if e.get("ph") == "X" and e.get("cat") not in GPU_CATS
           and e.get("cat") != "Trace" and lo <= e["ts"] and e["ts"] + e["dur"] <= hi]
    launched = {e["args"]["correlation"] for e in cpu if "correlation" in e.get("args", {})}
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS - {
        "gpu_user_annotation"} and e.get("args", {}).get("correlation") in launched]
    gpu_lo = min((e["ts"] for e in gpu), default=lo)
    gpu_hi = max((e["ts"] + e["dur"] for e in gpu), default=hi)
    ranges = [e for e in events if e.get("cat") == "gpu_user_annotation"
              and gpu_lo <= e["ts"] and e["ts"] + e["dur"] <= gpu_hi]
    flows = [e for e in events if e.get("ph") in FLOW_PHASES and lo <= e["ts"] <= gpu_hi]
    instants = [e for e in events if e.get("ph") in ("i", "I") and lo <= e["ts"] <= hi]
    header = [e for e in events if e.get("ph") == "M" or e.get("cat") == "Trace"]
    kept = header + cpu + gpu + ranges + flows + instants
    return {**{k: v for k, v in data.items() if k != "traceEvents"}, "traceEvents": kept}


def write(data: dict[str, Any], path: Path) -> None:
    text = json.dumps(data).encode("utf-8")  # spaced as Kineto writes (HTA looks for '"rank": N')
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0,
                                                filename="") as fh:
        fh.write(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--first", type=int, default=1, help="first step kept (0-based)")
    parser.add_argument("--steps", type=int, default=2, help="profiler steps kept")
    args = parser.parse_args()
    write(downsample(read(args.src), args.first, args.steps), args.dst)


if __name__ == "__main__":
    main()
