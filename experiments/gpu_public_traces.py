"""GPU time per rank on public torch.profiler traces of real GPU jobs, beside
HolisticTraceAnalysis' temporal breakdown of the same files.

    python -m experiments.gpu_public_traces [--also DIR ...]

Reads every folder of ``tests/data/gpu_public/`` (and each ``--also`` folder,
e.g. DeepSeek's ``profile-data`` ``train.json``, which is not kept in the
repository) with MegaScan's reader and with HTA (``tests/hta_oracle.py``),
and writes ``results/gpu_public_traces.json``: per rank the GPU window,
compute, NCCL and idle time of both, the largest relative difference, and
how many NCCL kernels the file holds, how many were read as communication
and how many were set aside (launched before the trace began).
"""
from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path
from typing import Any

from experiments.render import markdown_table
from experiments.results import ROOT, start

PUBLIC = ROOT / "tests" / "data" / "gpu_public"
FIGURES = ("window", "compute", "comm", "idle")


def _launched_nccl(path: Path) -> tuple[int, int]:
    """(rank, NCCL kernels whose CUDA launch the file holds), from the raw JSON."""
    with (gzip.open(path, "rt") if path.name.endswith(".gz") else open(path)) as fh:
        data = json.load(fh)
    events = data["traceEvents"]
    launches = {e["args"]["correlation"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e["args"]}
    return int(data["distributedInfo"]["rank"]), sum(
        e.get("cat") == "kernel" and e["name"].startswith("nccl")
        and e["args"].get("correlation") in launches for e in events)


def measure(folder: Path) -> dict[str, Any]:
    from megatronapp.scan.ingest.gpu_time import gpu_times
    from megatronapp.scan.ingest.kineto import kineto_files, load_kineto

    from tests.hta_oracle import hta_figures

    paths = kineto_files(folder)
    t0, c0 = time.perf_counter(), time.process_time()
    job = load_kineto(paths)
    ours = gpu_times(job.events)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    theirs = hta_figures(folder)
    launched = dict(map(_launched_nccl, paths))
    ranks = {}
    for rank, t in sorted(ours.items()):
        mine = {"window": t.window_s, "compute": t.compute_s, "comm": t.comm_s, "idle": t.idle_s}
        hta = {k: theirs[rank][k] * 1e-6 for k in FIGURES}
        comm = sum(e.args["kind"] in ("collective", "p2p") for e in job.events[rank])
        ranks[str(rank)] = {"ours_s": mine, "hta_s": hta,
                            "max_rel_diff": max(abs(mine[k] - hta[k]) / hta[k]
                                                for k in FIGURES if hta[k] > 0),
                            "idle_fraction": t.idle_fraction, "memory_s": t.memory_s,
                            "overlap_s": t.overlap_s, "nccl_read": comm,
                            "nccl_launched": launched[rank]}
    return {"folder": folder.name, "files": [p.name for p in paths],
            "world_size": job.world_size, "ranks": ranks,
            "nccl_kernels": sum(job.nccl_kernels.values()),
            "set_aside": sum(job.set_aside.values()),
            "read_wall_s": wall, "read_cpu_s": cpu}


def main(argv: list[str] | None = None) -> int:
    from tests.hta_oracle import hta_version

    parser = argparse.ArgumentParser(prog="python -m experiments.gpu_public_traces",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--also", type=Path, nargs="*", default=[],
                        help="more folders of traces (not kept in the repository)")
    args = parser.parse_args(argv)
    run = start("gpu_public_traces", argv)
    folders = sorted(p for p in PUBLIC.iterdir() if p.is_dir()) + list(args.also)
    traces = []
    for folder in folders:
        print(f"measuring {folder}", flush=True)
        traces.append(measure(folder))
    print(f"wrote {run.record({'hta_version': hta_version(), 'traces': traces})}")
    return 0


def tables(doc: dict[str, Any]) -> dict[str, str]:
    data = doc["data"]
    rows = []
    for trace in data["traces"]:
        for rank, r in trace["ranks"].items():
            o, h = r["ours_s"], r["hta_s"]
            rows.append([trace["folder"], f"{rank} of {trace['world_size']}",
                         *(f"{o[k] * 1e3:.1f} / {h[k] * 1e3:.1f}" for k in FIGURES),
                         f"{100 * r['max_rel_diff']:.2f}%", f"{r['idle_fraction']:.3f}",
                         f"{r['nccl_read']} / {r['nccl_launched']}"])
    agreement = markdown_table(
        ["trace", "rank", "window ms (ours / HTA)", "compute ms", "NCCL ms", "idle ms",
         "largest difference", "idle fraction", "NCCL kernels read / launched"],
        rows, "llrrrrrrr")
    return {"agreement": agreement + f"\nHolisticTraceAnalysis {data['hta_version']}.\n"}


if __name__ == "__main__":
    raise SystemExit(main())
