"""Sweeps: spec points, one-line errors, local processes and a real local Ray cluster."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pyarrow.parquet as pq
import pytest

from megatronapp.faults import Truth
from megatronapp.scenario.config import ScenarioError
from megatronapp.sweep.spec import load_spec

from .support import ROOT, run_cli

BASE = ROOT / "scenarios" / "throttle.yaml"


def _spec(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(f"scenario: {BASE}\n{body}")
    return path


def test_points_are_grid_times_draws_times_seeds_each_a_valid_scenario(tmp_path: Path) -> None:
    spec = load_spec(_spec(tmp_path, """seeds: [3, 4]
grid:
  faults.0.factor: [1.1, 1.5]
  parallel.microbatches: [8, 16]
random:
  draws: 3
  seed: 9
  keys:
    cluster.jitter.compute_sigma: {uniform: [0.0, 0.05]}
    parallel.dp: {choice: [2, 4]}
"""))
    points = spec.points()
    assert len(points) == 2 * 2 * 3 * 2
    first = points[0]
    assert first.scenario["faults"][0]["factor"] == first.values["faults.0.factor"] == 1.1
    assert first.scenario["parallel"]["dp"] == first.values["parallel.dp"]
    assert [p.seed for p in points[:2]] == [3, 4] and points[1].scenario["seed"] == 4
    sigmas = {p.values["cluster.jitter.compute_sigma"] for p in points}
    assert len(sigmas) == 3 and all(0.0 <= s <= 0.05 for s in sigmas)
    again = load_spec(_spec(tmp_path, spec_text(tmp_path))).points()
    assert [p.values for p in again] == [p.values for p in points]  # draws come from the seed


def spec_text(tmp_path: Path) -> str:
    return (tmp_path / "spec.yaml").read_text().split("\n", 1)[1]


@pytest.mark.parametrize("body,field", [
    ("grid: {faults.0.factor: 2}\n", "sweep grid"),
    ("bogus: 1\n", "sweep bogus"),
    ("grid: {model.layers: [7]}\n", "point 0 (model.layers=7)"),
    ("random: {draws: 1, keys: {parallel.pp: {loguniform: [0, 2]}}}\n", "sweep random.keys"),
])
def test_a_bad_spec_is_one_line_naming_the_field(tmp_path: Path, body: str, field: str) -> None:
    with pytest.raises(ScenarioError) as err:
        load_spec(_spec(tmp_path, body)).points()
    assert str(err.value).startswith(field)
    proc = run_cli("sweep", str(tmp_path / "spec.yaml"), "--out", str(tmp_path / "x.csv"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.csv").exists()


@pytest.mark.slow
def test_sweep_on_local_processes_writes_one_table(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "seeds: 2\ngrid: {faults.0.factor: [1.0, 2.0]}\ndetect: true\n")
    out, page = tmp_path / "table.parquet", tmp_path / "pages" / "sweep.html"
    proc = run_cli("sweep", str(spec), "--out", str(out), "--jobs", "2",
                   "--set", "iterations=2", "--report", str(page))
    assert proc.returncode == 0, proc.stderr
    rows = pq.read_table(out).to_pylist()
    # factor 1.0 injects nothing: a point is right when it is called healthy
    assert [r["injected"] for r in rows] == ["compute:5" if r["faults.0.factor"] == 2.0 else ""
                                             for r in rows]
    assert all(r["named_first"] == (r["root_causes"].split(" ")[0] == "compute:5"
                                    if r["injected"] else r["healthy"]) for r in rows)
    _check_sweep_page(page.read_text(), rows)
    assert [r["point"] for r in rows] == [0, 1, 2, 3]
    slow = [r for r in rows if r["faults.0.factor"] == 2.0]
    fast = [r for r in rows if r["faults.0.factor"] == 1.0]
    assert min(r["iteration_time_s"] for r in slow) > max(r["iteration_time_s"] for r in fast)
    assert str(os.getpid()) not in {r["worker"].rsplit(":", 1)[1] for r in rows}  # spawned
    assert all("compute:5" in r["root_causes"] for r in slow)  # throttle.yaml slows rank 5


THROTTLED_5 = Truth("throttle", "compute", 5)
STALLED_5 = Truth("host_stall", "host", 5)
FLAPPING_1_2 = Truth("link_flap", "link", 2, 1)


@pytest.mark.parametrize("causes,truth,healthy,right", [
    ([], [THROTTLED_5], True, False),  # a missed fault
    ([("link", 1, 2), ("compute", 5, None)], [THROTTLED_5], False, False),  # not first
    ([("compute", 5, None)], [THROTTLED_5], False, True),
    ([("compute", 5, None)], [STALLED_5], False, True),  # a stalled rank named as the rank
    ([("link", 5, 6)], [STALLED_5], False, False),
    ([("link", 1, 2)], [FLAPPING_1_2], False, True),  # either end first
    ([("compute", 1, None)], [FLAPPING_1_2], False, False),
    ([], [], True, True), ([("compute", 3, None)], [], False, False)])  # nothing injected
def test_named_first_scores_the_first_cause_against_what_was_injected(
        causes: list, truth: list, healthy: bool, right: bool) -> None:
    from megatronapp.sweep.run import named_first

    assert named_first(causes, truth, healthy) is right


def _check_sweep_page(text: str, rows: list[dict]) -> None:
    """One section per swept key with its figure, and the counts of its table."""
    from html.parser import HTMLParser

    class Page(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.sections: list[str] = []
            self.images = 0
            self.cells: list[str] = []

        def handle_starttag(self, tag: str, attrs: list) -> None:
            found = dict(attrs)
            if tag == "section":
                self.sections.append(found["id"])
            self.images += tag == "img" and found["src"].startswith("data:image/png;base64,")

        def handle_data(self, data: str) -> None:
            self.cells.append(data.strip())

    parsed = Page()
    parsed.feed(text)
    assert parsed.sections == ["sweep", "key-0"] and parsed.images == 1
    assert "Against faults.0.factor" in parsed.cells and "http" not in text
    named_at_2 = sum(1 for r in rows if r["faults.0.factor"] == 2.0 and r["named_first"])
    at_2 = parsed.cells.index("2.0")  # the row of factor 2.0: value, runs, named first
    assert parsed.cells[at_2 + 1: at_2 + 3] == ["2", str(named_at_2)]


@pytest.mark.parametrize("report,words", [("x.txt", "must end in .html"),
                                          ("table.csv", "must end in .html")])
def test_a_bad_report_path_is_refused_before_any_point(tmp_path: Path, report: str,
                                                       words: str) -> None:
    spec = _spec(tmp_path, "seeds: 1\ngrid: {faults.0.factor: [1.0]}\n")
    proc = run_cli("sweep", str(spec), "--out", str(tmp_path / "table.csv"),
                   "--report", str(tmp_path / report))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"megatronapp: --report: {tmp_path / report} "
                                                f"{words}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str], Path]]:
    """A one-CPU Ray head on 127.0.0.1 with its session files in a temporary
    directory (short: it holds Unix sockets), started here and stopped here."""
    port = _free_port()
    temp = tmp_path_factory.mktemp("ray")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    ray = str(Path(sys.executable).with_name("ray"))
    head = subprocess.Popen([ray, "start", "--head", "--block", "--port", str(port),
                             "--node-ip-address", "127.0.0.1", "--num-cpus", "1",
                             "--temp-dir", str(temp), "--include-dashboard=false",
                             "--disable-usage-stats"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        yield f"127.0.0.1:{port}", env, temp
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        deadline = time.time() + 15
        while head.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        try:
            os.killpg(head.pid, signal.SIGKILL)  # what --block left behind
        except ProcessLookupError:
            pass


def _ray_worker_pids(temp: Path) -> set[int]:
    """Processes the Ray cluster ran as workers: its logs are named after them
    (worker-<id>-<job>-<pid>.out, python-core-worker-<id>_<pid>.log)."""
    names = [f.name for f in temp.glob("session_*/logs/*") if "worker-" in f.name]
    return {int(token) for n in names for token in re.split(r"[-_.]", n) if token.isdigit()}


@pytest.mark.slow
def test_sweep_and_validation_on_a_local_ray_cluster(tmp_path: Path, ray_head) -> None:
    address, env, temp = ray_head
    spec = _spec(tmp_path, "seeds: 2\ngrid: {faults.0.factor: [1.5]}\n")
    out = tmp_path / "table.parquet"
    proc = subprocess.run([sys.executable, "-m", "megatronapp.cli", "sweep", str(spec), "--out",
                           str(out), "--ray", address], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = pq.read_table(out).to_pylist()
    assert [(r["point"], r["seed"], r["error"]) for r in rows] == [(0, 0, None), (1, 1, None)]
    assert f"on Ray cluster at {address}" in proc.stderr
    ran_in = {int(r["worker"].rsplit(":", 1)[1]) for r in rows}
    assert ran_in and ran_in <= _ray_worker_pids(temp)  # every point ran in a Ray worker
    csv = tmp_path / "val.csv"
    proc = subprocess.run([sys.executable, "-m", "megatronapp.cli", "validate-detector",
                           "--trials", "2", "--csv", str(csv), "--ray", address],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| megascan |" in proc.stdout and csv.is_file()


def test_a_point_too_large_is_refused_before_any_point_runs(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "grid: {iterations: [1, 2000000000]}\n")
    out = tmp_path / "table.csv"
    proc = run_cli("sweep", str(spec), "--out", str(out))
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert err[0].startswith("megatronapp: limits: sweep spec (2 runs)") and "--no-limits" in err[0]
    assert not out.exists() and proc.stdout == ""


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_processes_that_run_points_at_once_need_memory_at_once(tmp_path: Path, jobs: str,
                                                               monkeypatch) -> None:
    """Two points that fit one at a time; side by side they may not."""
    from megatronapp.host import limits
    from megatronapp.host.executors import Where
    from megatronapp.sweep.run import estimate_sweep

    points = load_spec(_spec(tmp_path, "grid: {iterations: [1, 2]}\n"), ["iterations=1"]).points()
    one = estimate_sweep(points, Where(jobs=1), detect=False)
    monkeypatch.setattr(limits, "available_memory", lambda: one.memory_bytes * 1.5)
    out = tmp_path / "table.csv"
    proc = run_cli("sweep", str(tmp_path / "spec.yaml"), "--out", str(out), "--jobs", jobs,
                   "--set", "iterations=1")
    assert (proc.returncode, out.exists()) == ((0, True) if jobs == "1" else (2, False))
    if jobs == "2":
        assert "too large for this machine's memory" in proc.stderr
        proc = run_cli("sweep", str(tmp_path / "spec.yaml"), "--out", str(out), "--jobs", jobs,
                       "--set", "iterations=1", "--no-limits")
        assert proc.returncode == 0 and out.exists(), proc.stderr


def test_a_drawn_value_is_labelled_in_four_significant_digits() -> None:
    from megatronapp.sweep.page import levels

    rows = [{"factor": 1.2345678901234567, "iteration_time_s": 0.1},
            {"factor": 2.0, "iteration_time_s": 0.2}]
    assert [lv.label for lv in levels(rows, "factor", False)] == ["1.235", "2.0"]
