"""`megatronapp plot`'s figures point at the answer: on the quick-start run
(rank 5 throttled) the root cause is outlined and named, the Marey graph is
its pipeline's, every axis is labelled; large runs are read from
trace.parquet, only the ranks drawn."""
from __future__ import annotations

from pathlib import Path

import pytest
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure

from megatronapp.trace import on_disk as run_trace
from megatronapp.cli import main
from megatronapp.scenario.config import load_scenario
from megatronapp.dpp.plots import windows_figure
from megatronapp.trace.timeline import MAX_TICK_LABELS, timeline_figure
from megatronapp.run.write import write_run
from megatronapp.scan.evidence.focus import PlotInput, load_plot_input
from megatronapp.scan.plots import heatmap_figure, marey_figure
from megatronapp.trace.events import Event
from sim import run_sim

ROOT = Path(__file__).resolve().parents[1]
QUICK_START = ROOT / "scenarios" / "throttle.yaml"
THROTTLED = 5  # the quick-start scenario's throttled rank


@pytest.fixture(scope="module")
def quick_start(tmp_path_factory: pytest.TempPathFactory) -> Path:
    s = load_scenario(str(QUICK_START))
    out = tmp_path_factory.mktemp("plots") / "run"
    out.mkdir()
    write_run(s, run_sim(s), out)
    return out


@pytest.fixture(scope="module")
def drawn(quick_start: Path) -> PlotInput:
    return load_plot_input(quick_start)


def _texts(fig: Figure) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def _tick_labels(fig: Figure) -> list[str]:
    """The plot's row labels (its first axes: not the colour bar's)."""
    return [t.get_text() for t in fig.axes[0].get_yticklabels()]


def _every_axis_labelled(fig: Figure) -> None:
    for ax in fig.axes:
        assert ax.get_xlabel() or ax.get_ylabel(), ax  # a colour bar has one axis
        if ax.get_label() != "<colorbar>":
            assert ax.get_xlabel() and ax.get_ylabel(), ax.get_title()


def test_the_plots_name_the_detected_root_cause(drawn: PlotInput) -> None:
    assert drawn.focus.root == THROTTLED  # what `megatronapp detect` names on this run
    assert f"rank {THROTTLED}" in drawn.focus.root_label


def test_marey_graph_is_the_root_causes_pipeline_with_a_legend(drawn: PlotInput) -> None:
    fig = marey_figure(drawn.events, focus=drawn.focus)
    assert any(f"(rank {THROTTLED})" in label for label in _tick_labels(fig))
    assert any(f"rank {THROTTLED}" in text for text in _texts(fig))
    assert fig.axes[0].get_legend() is not None
    _every_axis_labelled(fig)


def test_heat_map_outlines_and_names_the_root_cause(drawn: PlotInput) -> None:
    fig = heatmap_figure(drawn.events, focus=drawn.focus)
    assert any(f"root cause: rank {THROTTLED}" in text for text in _texts(fig))
    _every_axis_labelled(fig)


def test_timeline_marks_the_root_cause_and_draws_one_collection_per_kind(
        drawn: PlotInput) -> None:
    fig = timeline_figure(drawn.events, root=drawn.focus.root, root_label=drawn.focus.root_label)
    ax = fig.axes[0]
    assert any(f"rank {THROTTLED}" in text for text in _texts(fig))
    assert ax.get_legend() is not None
    _every_axis_labelled(fig)
    lanes = [c for c in ax.collections if isinstance(c, PolyCollection)]
    events = sum(len(evs) for evs in drawn.events.values())
    assert len(lanes) <= 6 < events  # not one artist per event


def test_timeline_draws_compute_above_communication(drawn: PlotInput) -> None:
    """The docstring's promise: compute in a row's upper half (y runs down)."""
    ax = timeline_figure(drawn.events).axes[0]
    bottom, top = ax.get_ylim()
    assert bottom > top  # row 0 at the top
    lanes = {c.get_label(): c for c in ax.collections}
    for kind, upper in (("forward", True), ("backward", True), ("collective", False)):
        ys = [path.vertices[:, 1].min() % 1 for path in lanes[kind].get_paths()]
        assert all((y < 0.5) == upper for y in ys), kind


def test_ticks_are_thinned_on_many_ranks_and_all_shown_on_two() -> None:
    def one_op(ranks: int) -> dict[int, list[Event]]:
        return {r: [Event("forward", 0.0, 1.0 + r % 3, {})] for r in range(ranks)}

    assert _tick_labels(heatmap_figure(one_op(2))) == ["0", "1"]
    assert _tick_labels(timeline_figure(one_op(2))) == ["rank 0", "rank 1"]
    for fig in (heatmap_figure(one_op(1024)), timeline_figure(one_op(1024))):
        labels = _tick_labels(fig)
        assert 1 < len(labels) <= MAX_TICK_LABELS


def test_live_activation_panel_is_one_labelled_bar_per_rank(drawn: PlotInput) -> None:
    fig = windows_figure(drawn.events)
    live = fig.axes[2]
    assert len(live.patches) == len(drawn.events) and not live.lines
    _every_axis_labelled(fig)


def test_a_trace_without_pipeline_windows_gets_no_empty_dpp_figure(tmp_path: Path, capsys,
                                                                  drawn: PlotInput) -> None:
    """A profiler trace of a job with no pipeline (DDP: compute and an
    all-reduce without our window ranges) has nothing for MegaDPP's figure:
    no empty axes are written, and the user is told why."""
    from megatronapp.dpp.cli import plot_hook

    ddp_like = {r: [Event("aten::mm", 0.0, 1e-3, {}), Event("allreduce", 1e-3, 2e-3, {})]
                for r in range(4)}
    assert plot_hook(tmp_path, ddp_like) == [] and not list(tmp_path.iterdir())
    assert "no dpp_windows.png" in capsys.readouterr().out
    assert [p.name for p in plot_hook(tmp_path, drawn.events)] == ["dpp_windows.png"]


def test_large_runs_draw_the_root_causes_pipeline_first(quick_start: Path) -> None:
    """Above the rank limit only the ranks that matter are read and drawn,
    and the figure says so."""
    few = load_plot_input(quick_start, max_ranks=8)
    assert len(few.events) == 8
    assert {1, 5, 9, 13} <= set(few.events)  # rank 5's pipeline (tp 2, pp 4, dp 2)
    assert "8 of 16 ranks shown" in few.focus.selection


def test_plot_reads_trace_parquet_when_the_run_wrote_no_trace_json(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Runs over the browser limit write only trace.parquet; plot must read it."""
    monkeypatch.setattr(run_trace, "BROWSER_EVENTS", 1_000)  # this run is above it
    scenario = tmp_path / "s.yaml"
    scenario.write_text(QUICK_START.read_text().replace("iterations: 4", "iterations: 1"))
    assert main(["run", str(scenario), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    run = tmp_path / "run"
    assert not (run / "trace.json").exists() and (run / "trace.parquet").is_file()
    assert main(["plot", str(run)]) == 0, capsys.readouterr().err
    for name in ("timeline.png", "scan_heatmap.png", "scan_marey.png", "dpp_windows.png"):
        assert (run / name).read_bytes()[:4] == b"\x89PNG", name


def _cell_colour(fig: Figure, row: int, column: str) -> tuple[float, ...]:
    """The colour a heat map cell is drawn in (the layer that holds it)."""
    ax = fig.axes[0]
    j = [t.get_text() for t in ax.get_xticklabels()].index(column)
    for image in ax.images:
        values = image.get_array()
        if not values.mask[row, j]:
            return tuple(image.to_rgba(values)[row, j])
    raise AssertionError(f"no layer holds {column} of row {row}")


def test_heat_map_darkest_cell_is_the_slow_compute_not_a_victims_wait() -> None:
    """Rank 1 computes 1.3x slow; rank 0 waits 7x as long in its all-reduce.
    The slow compute must be the darkest cell, the wait in another hue."""
    def rank(r: int) -> list[Event]:
        forward = 1.3 if r == 1 else 1.0
        wait = 7.0 if r == 0 else 1.0
        return [Event("forward", 0.0, forward, {"kind": "compute"}),
                Event("allreduce", 2.0, wait, {"kind": "collective", "group": [0, 1, 2, 3]})]

    fig = heatmap_figure({r: rank(r) for r in range(4)})
    slow = _cell_colour(fig, 1, "forward")
    wait = _cell_colour(fig, 0, "allreduce")
    healthy = _cell_colour(fig, 2, "forward")

    def darkness(c: tuple[float, ...]) -> float:
        return 1.0 - (0.299 * c[0] + 0.587 * c[1] + 0.114 * c[2])

    assert darkness(slow) > darkness(wait) > darkness(healthy)
    assert slow[0] > slow[2] and wait[2] > wait[0]  # compute red, the wait blue
