"""A run's report as one HTML page with nothing to fetch: figures inline as
base64 PNG, text escaped. Sections: scenario (its faults in words), verdict
(MegaScan's diagnosis, its blame first), the fault's cost against a healthy
baseline, iteration times (and loss), timeline, heat map, Marey graph, memory
per rank, then MegaFBD / MegaDPP / MegaScope / the closed loop when the run
has them."""
from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any, Callable, Mapping

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from megatronapp.io.gate import readable_bytes
from megatronapp.io.html_page import grid_table, inline_png, page, pre, section, table
from megatronapp.trace.timeline import DPI, timeline_figure
from megatronapp.scan.cli import explain, ms
from megatronapp.scan.evidence.focus import PlotInput
from megatronapp.scan.plots import heatmap_figure, marey_figure

from .baseline import Baseline

DPP_SCHEDULES = ("dfc", "bfc", "adaptive")  # MegaDPP's own; its section only on these
HEALTHY = "#55A868"
COST = "#D62728"


def figure_html(fig: Figure, alt: str) -> str:
    return inline_png(fig, alt, DPI)


def fault_words(fault: Mapping[str, Any]) -> str:
    """A fault as its kind describes it; one this version does not know, as written."""
    from megatronapp.faults import parse_fault
    from megatronapp.io.schema import ScenarioError

    try:
        return parse_fault(dict(fault), "faults").describe()
    except ScenarioError:
        return json.dumps(fault)


def scenario_section(summary: Mapping[str, Any]) -> str:
    head = {"backend": summary.get("backend"), "ranks": summary.get("world_size"),
            "schedule": summary.get("schedule")}
    faults = summary.get("faults") or []
    head |= {f"fault {i + 1}" if len(faults) > 1 else "fault": fault_words(f)
             for i, f in enumerate(faults)} or {"faults": "none"}
    full = pre(json.dumps(summary.get("scenario", {}), indent=2).splitlines())
    body = table(head) + f"<details><summary>full scenario</summary>{full}</details>"
    return section("scenario", "Scenario", body)


def verdict_section(data: PlotInput) -> str:
    """``detect``'s text, each root cause and its blame in bold."""
    d = data.diagnosis.to_json()
    kind = "verdict healthy" if data.diagnosis.healthy else "verdict"
    lines = [f"<strong>{html.escape(line)}</strong>"
             if line.lstrip().startswith(("root cause:", "blame:")) else html.escape(line)
             for line in explain(d)]
    body = f'<div class="{kind}"><pre>{chr(10).join(lines)}</pre></div>'
    if data.focus.selection:
        body += f"<p>{html.escape(data.focus.selection)}</p>"
    return section("verdict", "Verdict (megatronapp detect)", body)


def cost_section(baseline: Baseline, summary: Mapping[str, Any] | None = None) -> str:
    """The cost in one sentence; a stopped run's also lies in its restarts."""
    text = baseline.sentence()
    if summary is not None and summary.get("mitigation"):
        text += (" What stops and restarts cost (time lost, redone work) is the goodput "
                 "under Mitigation.")
    return section("cost", "Cost of the fault", f'<p class="cost">{html.escape(text)}</p>')


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


def iteration_figure(values: list[float | None], baseline: Baseline) -> Figure:
    """Iteration time from zero, the healthy baseline under it and the gap
    between them shaded: the fault's cost at a glance."""
    fig = curve(values, "time (ms)", "iteration time", 1e3)
    ax = fig.axes[0]
    points = scaled(values, 1e3)
    drawn = list(points)
    if baseline.healthy_s is not None:
        healthy = ([t * 1e3 for t in baseline.healthy_times_s][:len(points)]
                   or [baseline.healthy_s * 1e3] * len(points))
        healthy += [healthy[-1]] * (len(points) - len(healthy))
        xs = range(len(points))
        ax.plot(xs, healthy, color=HEALTHY, linestyle="--", marker=".",
                label=f"healthy baseline ({baseline.source})")
        ax.fill_between(xs, healthy, points, color=COST, alpha=0.2, label="cost of the fault")
        drawn += healthy
        cost = baseline.cost_s
        if cost is not None and baseline.faulty_s:
            ax.set_title(f"iteration time; the cost: {ms(cost)} "
                         f"({100 * cost / baseline.faulty_s:.3g}%) of each iteration")
    ax.lines[0].set_label("this run")
    top = max((y for y in drawn if y == y), default=1.0)  # NaN (a gap) is not equal to itself
    ax.set_ylim(0, 1.15 * top)  # from zero: the cost's share of the iteration shows
    ax.legend(loc="lower right", fontsize="small")
    return fig


def iterations_section(summary: Mapping[str, Any], baseline: Baseline) -> str:
    body = figure_html(iteration_figure(summary.get("iteration_times_s", []), baseline),
                       "iteration time per iteration against the healthy baseline")
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


def readable(key: str, value: Any) -> Any:
    """A summary value in its unit: bytes as kB..TB, seconds as ms, three digits."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return value
    if key.endswith("_bytes"):
        return readable_bytes(value)
    if key.endswith("_s"):
        return ms(value)
    return f"{value:.3g}" if isinstance(value, float) else value


def dpp_table(dpp: Mapping[str, Any]) -> str:
    return table({k.removesuffix("_bytes").removesuffix("_s").replace("_", " "): readable(k, v)
                  for k, v in dpp.items() if not isinstance(v, (dict, list))})


def mitigation_html(loop: Mapping[str, Any], run_dir: Path) -> str:
    """The closed loop's segments (what stopped each, what it was re-planned to)
    and its goodput against the same job without the loop."""
    from megatronapp.mitigate.loop import summary_lines

    segments = loop["segments"]
    dirs = [f"{run_dir}/segment{j}/" for j in range(1, len(segments))]
    columns = ["segment", "first iteration", "iterations", "time", "ranks", "dp",
               "microbatches", "stopped by"]
    rows = [{"segment": j, "first iteration": seg["first_iteration"],
             "iterations": seg["iterations"], "time": ms(seg["seconds"]),
             "ranks": seg["world_size"], "dp": seg["dp"], "microbatches": seg["microbatches"],
             "stopped by": stopped_by(seg.get("stopped_by"))} for j, seg in enumerate(segments)]
    return grid_table(columns, rows) + pre([line.strip() for line in summary_lines(dict(loop), dirs)])


def stopped_by(verdict: Mapping[str, Any] | None) -> str:
    if verdict is None:
        return "ran to the end"
    if verdict.get("kind") == "stop":
        return f"rank {verdict['rank']} failed"
    who = (f"link {verdict['rank']} <-> {verdict['peer']}" if verdict.get("peer") is not None
           else f"rank {verdict['rank']}")
    return f"{who} named at iteration {verdict['iteration']}"


def module_sections(summary: Mapping[str, Any], run_dir: Path) -> list[str]:
    """Each module's section, only where the run used it: MegaDPP's on its own
    schedules, the closed loop's where it ran."""
    from megatronapp.fbd.run import summary_lines
    from megatronapp.scope.summary import run_lines

    used = {"fbd": bool(summary.get("fbd")), "scope": bool(summary.get("scope")),
            "dpp": bool(summary.get("dpp")) and summary.get("schedule") in DPP_SCHEDULES,
            "mitigation": bool((summary.get("mitigation") or {}).get("segments"))}
    builders: list[tuple[str, str, Callable[[], str]]] = [
        ("fbd", "MegaFBD", lambda: pre(summary_lines(summary))),
        ("dpp", "MegaDPP", lambda: dpp_table(summary["dpp"])),
        ("scope", "MegaScope", lambda: pre(run_lines(summary["scope"], run_dir))),
        ("mitigation", "Mitigation (the closed loop)",
         lambda: mitigation_html(summary["mitigation"], run_dir))]
    return [section(key, title, build()) for key, title, build in builders if used[key]]


def report_html(run_dir: Path, summary: Mapping[str, Any], data: PlotInput,
                baseline: Baseline) -> str:
    name = run_dir.resolve().name
    parts = [scenario_section(summary), verdict_section(data), cost_section(baseline, summary),
             iterations_section(summary, baseline), *figures_sections(name, data),
             memory_section(summary), *module_sections(summary, run_dir)]
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


def trace_report_html(target: Path, trace: Any, data: PlotInput, baseline: Baseline) -> str:
    """The page of a trace that is not a run directory (a torch.profiler folder)."""
    name = target.resolve().name
    parts = [trace_section(trace), verdict_section(data), cost_section(baseline),
             gpu_time_section(data.events),
             *figures_sections(name, data),
             section("run-only", "Scenario, iterations, memory, modules", f"<p>{NEEDS_A_RUN}</p>")]
    return page(f"{name}: megatronapp report", "\n".join(parts))
