"""HolisticTraceAnalysis' own figures on a folder of traces, the oracle the GPU
time accounting is checked against (``tests/test_scan_gpu_public.py``).

Per rank, in µs: its temporal breakdown (``kernel_time``: first to last GPU
activity; ``idle_time``; ``compute_time``: the union of its computation
kernels) and, from the same kernel classification, the union of its NCCL
kernels (every state of ``_get_gpu_kernel_type_time`` that holds
communication). HTA keeps only GPU work whose CPU launch lies in the trace;
it is told to keep the last profiler step (``include_last_profiler_step``).
"""
from __future__ import annotations

import logging
import warnings
from functools import cache
from pathlib import Path

KINDS = ("COMPUTATION", "COMMUNICATION", "MEMORY")


@cache
def hta_figures(folder: Path) -> dict[int, dict[str, float]]:
    logging.getLogger("hta").setLevel(logging.ERROR)
    with warnings.catch_warnings():  # HTA's own use of pandas' deprecated arguments
        warnings.simplefilter("ignore")
        return _figures(folder)


def _figures(folder: Path) -> dict[int, dict[str, float]]:
    from hta.analyzers.breakdown_analysis import BreakdownAnalysis
    from hta.trace_analysis import TraceAnalysis
    from hta.utils.utils import get_kernel_type

    analysis = TraceAnalysis(trace_dir=str(folder), include_last_profiler_step=True)
    breakdown = analysis.get_temporal_breakdown(visualize=False).set_index("rank")
    names = analysis.t.symbol_table.get_sym_table()
    out = {}
    for rank, frame in analysis.t.traces.items():
        gpu = frame[frame["stream"].ne(-1)].copy()
        gpu["kernel_type"] = [get_kernel_type(names[n]) for n in gpu["name"]]
        states = BreakdownAnalysis._get_gpu_kernel_type_time(gpu, list(KINDS))
        comm = states[states["kernel_type"].str.contains("COMMUNICATION")]["sum"].sum()
        row = breakdown.loc[rank]
        out[int(rank)] = {"window": float(row["kernel_time(us)"]),
                          "idle": float(row["idle_time(us)"]),
                          "compute": float(row["compute_time(us)"]), "comm": float(comm)}
    return out


def hta_version() -> str:
    from importlib.metadata import version

    return version("HolisticTraceAnalysis")
