"""A run's report as one HTML page with nothing to fetch: figures inline as
base64 PNG, text escaped. Sections: scenario, verdict (MegaScan's diagnosis
and its evidence), iteration times (and loss), timeline, heat map, Marey
graph, memory per rank, then MegaFBD / MegaDPP / MegaScope when the run's
summary has them."""
from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any, Callable, Mapping

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from megatronapp.io.html_page import grid_table, inline_png, page, pre, section, table
from megatronapp.trace.timeline import DPI, timeline_figure
from megatronapp.scan.cli import explain
from megatronapp.scan.evidence.focus import PlotInput
from megatronapp.scan.plots import heatmap_figure, marey_figure


def figure_html(fig: Figure, alt: str) -> str:
    return inline_png(fig, alt, DPI)


def scenario_section(summary: Mapping[str, Any]) -> str:
    head = {"backend": summary.get("backend"), "ranks": summary.get("world_size"),
            "schedule": summary.get("schedule"), "faults": summary.get("faults") or "none"}
    full = pre(json.dumps(summary.get("scenario", {}), indent=2).splitlines())
    body = table(head) + f"<details><summary>full scenario</summary>{full}</details>"
    return section("scenario", "Scenario", body)


def verdict_section(data: PlotInput) -> str:
    d = data.diagnosis.to_json()
    kind = "verdict healthy" if data.diagnosis.healthy else "verdict"
    body = f'<div class="{kind}">{pre(list(explain(d)))}</div>'
    if data.focus.selection:
        body += f"<p>{html.escape(data.focus.selection)}</p>"
    return section("verdict", "Verdict (megatronapp detect)", body)


def scaled(values: list[float | None], scale: float = 1.0) -> list[float]:
    """Values as numbers to draw; a null (not a finite number when written) is a gap."""
    return [float("nan") if not isinstance(v, (int, float)) else v * scale for v in values]


def curve(values: list[float | None], ylabel: str, title: str, scale: float = 1.0) -> Figure:
    fig = Figure(figsize=(8, 3.2), layout="constrained")
    ax = fig.add_subplot()
    points = scaled(values, scale)
    ax.plot(range(len(points)), points, marker="o", label=title)
    if not any(p == p for p in points):  # NaN is not equal to itself
        ax.text(0.5, 0.5, "no finite value recorded", ha="center", va="center",
                transform=ax.transAxes)
    ax.set(xlabel="iteration", ylabel=ylabel, title=title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend()
    return fig


def iterations_section(summary: Mapping[str, Any]) -> str:
    body = figure_html(curve(summary.get("iteration_times_s", []), "time (ms)",
                             "iteration time", 1e3), "iteration time per iteration")
    losses = summary.get("loss_per_iteration")
    if losses:
        body += figure_html(curve(losses, "loss (nats/token)", "loss"), "loss per iteration")
    return section("iterations", "Iteration time" + (" and loss" if losses else ""), body)


def figures_sections(name: str, data: PlotInput) -> list[str]:
    f = data.focus
    return [section("timeline", "Timeline", figure_html(
                timeline_figure(data.events, name, f.root, f.root_label, f.selection),
                "per-rank timeline")),
            section("heatmap", "Heat map", figure_html(
                heatmap_figure(data.events, f"{name}: mean op time", f), "op time heat map")),
            section("marey", "Marey graph", figure_html(
                marey_figure(data.events, title=f"{name}: Marey graph", focus=f),
                "Marey graph of one pipeline"))]


def memory_figure(per_rank: list[float | None], capacity: float | None) -> Figure:
    fig = Figure(figsize=(8, 3.2), layout="constrained")
    ax = fig.add_subplot()
    ax.bar(range(len(per_rank)), scaled(per_rank, 1e-9), color="#4C72B0", label="peak")
    if capacity:
        ax.axhline(capacity / 1e9, color="#D62728", linestyle="--", label="capacity")
    ax.set(xlabel="rank", ylabel="peak memory (GB)", title="peak memory per rank")
    ax.legend()
    return fig


def memory_section(summary: Mapping[str, Any]) -> str | None:
    dpp = summary.get("dpp") or {}
    per_rank = dpp.get("peak_memory_bytes_per_rank")
    if not per_rank:
        return None
    values = list(per_rank.values()) if isinstance(per_rank, dict) else list(per_rank)
    return section("memory", "Memory per rank", figure_html(
        memory_figure(values, dpp.get("memory_capacity_bytes")), "peak memory per rank"))


def module_sections(summary: Mapping[str, Any], run_dir: Path) -> list[str]:
    from megatronapp.fbd.run import summary_lines
    from megatronapp.scope.summary import run_lines

    builders: list[tuple[str, str, Callable[[], str]]] = [
        ("fbd", "MegaFBD", lambda: pre(summary_lines(summary))),
        ("dpp", "MegaDPP", lambda: table({k: v for k, v in summary["dpp"].items()
                                          if not isinstance(v, (dict, list))})),
        ("scope", "MegaScope", lambda: pre(run_lines(summary["scope"], run_dir)))]
    return [section(key, title, build()) for key, title, build in builders if key in summary]


def report_html(run_dir: Path, summary: Mapping[str, Any], data: PlotInput) -> str:
    name = run_dir.resolve().name
    parts = [scenario_section(summary), verdict_section(data), iterations_section(summary),
             *figures_sections(name, data), memory_section(summary),
             *module_sections(summary, run_dir)]
    body = "\n".join(p for p in parts if p)
    return page(f"{name}: megatronapp report", body)


# ------------------------------------------------------------ a trace folder
NEEDS_A_RUN = ("The scenario, iteration-time and loss curves, memory and module sections need "
               "a run directory written by 'megatronapp run' (its summary.json); this page is "
               "of a trace, which records none of them.")


def trace_section(trace: Any) -> str:
    """What was read: the source, its ranks, the job's world size and cycles."""
    from megatronapp.scan.ingest.folders import rank_ranges

    ranks = sorted(trace.events)
    rows: dict[str, Any] = {"source": trace.source, "ranks": rank_ranges(ranks)}
    if trace.world_size is not None:
        rows["world size (distributedInfo)"] = trace.world_size
        missing = trace.missing_ranks
        rows["ranks missing"] = rank_ranges(missing) if missing else "none"
    if trace.cycles:
        rows["profiling cycles read"] = ", ".join(map(str, trace.cycles))
    return section("trace", "Trace", table(rows))


def gpu_time_figure(times: Mapping[int, Any]) -> Figure:
    """Per rank, its GPU window split into compute, communication and memory
    work that compute does not hide, and idle (ms)."""
    ranks = sorted(times)
    fig = Figure(figsize=(10, max(2.5, 0.3 * len(ranks) + 1.5)), layout="constrained")
    ax = fig.add_subplot()
    parts = (("compute", [times[r].compute_s for r in ranks], "#4C72B0"),
             ("communication and memory not under compute", [times[r].exposed_s for r in ranks],
              "#DD8452"),
             ("idle", [times[r].idle_s for r in ranks], "#CCCCCC"))
    left = [0.0] * len(ranks)
    for label, seconds, color in parts:
        ax.barh([str(r) for r in ranks], [s * 1e3 for s in seconds], left=left, color=color,
                label=label)
        left = [a + s * 1e3 for a, s in zip(left, seconds)]
    ax.set(xlabel="GPU time (ms, first to last GPU activity)", ylabel="rank",
           title="GPU time per rank")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    return fig


def gpu_time_section(events: Mapping[int, Any]) -> str:
    from megatronapp.scan.ingest.gpu_time import gpu_times

    times = gpu_times(events)
    if not times:
        return section("gpu", "GPU time per rank", "<p>The trace holds no GPU work.</p>")
    columns = ["rank", "window ms", "busy ms", "compute ms", "NCCL ms", "NCCL under compute ms",
               "memory ms", "idle ms", "idle %"]
    rows = [{"rank": r, "window ms": t.window_s * 1e3, "busy ms": t.busy_s * 1e3,
             "compute ms": t.compute_s * 1e3, "NCCL ms": t.comm_s * 1e3,
             "NCCL under compute ms": t.overlap_s * 1e3, "memory ms": t.memory_s * 1e3,
             "idle ms": t.idle_s * 1e3, "idle %": 100 * t.idle_fraction}
            for r, t in sorted(times.items())]
    return section("gpu", "GPU time per rank", figure_html(
        gpu_time_figure(times), "GPU time per rank") + grid_table(columns, rows))


def trace_report_html(target: Path, trace: Any, data: PlotInput) -> str:
    """The page of a trace that is not a run directory (a torch.profiler folder)."""
    name = target.resolve().name
    parts = [trace_section(trace), verdict_section(data), gpu_time_section(data.events),
             *figures_sections(name, data),
             section("run-only", "Scenario, iterations, memory, modules", f"<p>{NEEDS_A_RUN}</p>")]
    return page(f"{name}: megatronapp report", "\n".join(parts))
