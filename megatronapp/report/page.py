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

from megatronapp.io.html_page import inline_png, page, pre, section, table
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


def curve(values: list[float], ylabel: str, title: str, scale: float = 1.0) -> Figure:
    fig = Figure(figsize=(8, 3.2), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(range(len(values)), [v * scale for v in values], marker="o", label=title)
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


def memory_figure(per_rank: list[float], capacity: float | None) -> Figure:
    fig = Figure(figsize=(8, 3.2), layout="constrained")
    ax = fig.add_subplot()
    ax.bar(range(len(per_rank)), [b / 1e9 for b in per_rank], color="#4C72B0", label="peak")
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
