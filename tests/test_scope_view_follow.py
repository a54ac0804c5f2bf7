"""Following a run as it writes its capture, and the statistics the training
view draws from it (per-step means and histogram ridges).

The growing directory is written the way a run's rank writes it
(``PartWriter`` flushing part files step after step, then ``merge_capture``).
The follower sees each new step, only once; a tensor-parallel row appears
once all its slices are in; the merged capture replaces the parts. The slow
tests run a real ``scope serve --follow`` process: a websocket client and the
page in chromium see steps arrive while rows are appended.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pytest

from megatronapp.errors import UserError
from megatronapp.scope.storage import HostRecord, PartWriter, RecordKey, Rows, merge_capture
from megatronapp.scope.view.follow import PartsFollower, followed_capture
from megatronapp.scope.view.source import TrainingSeries, followed_source
from tests.scope_view_support import (ViewServer, blank_of, client, follow_next_step,
                                      launch_chromium, open_training_view, shoot,
                                      start_followed_run, write_training_step)


def series_steps(follower: PartsFollower) -> list[int]:
    snap = follower.poll()
    assert snap is not None
    return TrainingSeries.of(snap.stats).steps.tolist()


def test_the_follower_sees_each_step_once_as_the_parts_grow(tmp_path: Path) -> None:
    writer = PartWriter(tmp_path, 0)
    follower = PartsFollower(tmp_path)
    assert follower.poll() is None  # nothing written yet
    write_training_step(writer, 0)
    assert series_steps(follower) == [0]
    assert follower.poll() is None  # nothing new
    write_training_step(writer, 1)
    write_training_step(PartWriter(tmp_path, 1), 1)  # another rank, same step
    snap = follower.poll()
    assert snap is not None and snap.manifest["capture_state"] == "parts"
    assert TrainingSeries.of(snap.stats).steps.tolist() == [0, 1]
    assert snap.stats.num_rows == 3 * 2 * 2 * 8  # (step 0 + 2 ranks at step 1) x layers x stats x tokens


def test_a_tensor_parallel_row_appears_once_all_its_slices_are_in(tmp_path: Path) -> None:
    import torch

    from megatronapp.scope import stats
    from megatronapp.scenario.scope_spec import parse_stat

    specs = (parse_stat("max"),)
    x = np.arange(8.0).reshape(1, 8)
    follower = PartsFollower(tmp_path)
    write_training_step(PartWriter(tmp_path, 2), 0)
    for shard in (0, 1):
        part = stats.partials(torch.tensor(x[:, 4 * shard:4 * shard + 4]), specs,
                              stats.Slice(4 * shard, 8)).numpy()
        one = np.zeros(1, np.int64)
        w = PartWriter(tmp_path, shard)
        w.write([HostRecord(RecordKey(0, 0, 0, 1, "mlp.pre"), Rows(one, one - 1, one), ("max",),
                            tuple(stats.widths(specs, 8)), part, shard, 2)], [])
        w.flush()
        snap = follower.poll()
        assert snap is not None
        got = snap.stats.filter(pa.compute.equal(snap.stats["site"], "mlp.pre"))
        assert got["value"].to_pylist() == ([] if shard == 0 else [7.0])


def test_the_merged_capture_replaces_the_parts(tmp_path: Path) -> None:
    writer = PartWriter(tmp_path, 0)
    follower = PartsFollower(tmp_path)
    for step in range(3):
        write_training_step(writer, step)
    before = follower.poll()
    writer.close(dropped=4)
    merge_capture(tmp_path, {"source": "train"})
    after = follower.poll()
    assert before is not None and after is not None
    assert after.manifest["capture_state"] == "merged" and after.manifest["dropped_records"] == 4
    key = [("step", "ascending"), ("layer", "ascending"), ("stat", "ascending"),
           ("token", "ascending")]
    assert after.stats.sort_by(key).equals(before.stats.sort_by(key))
    assert follower.poll() is None


def test_following_needs_parts_or_a_manifest(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with pytest.raises(UserError, match="no capture being written"):
        followed_source(run)
    run.mkdir()
    with pytest.raises(UserError, match="no capture being written"):
        followed_source(run)
    (run / "scope" / "parts").mkdir(parents=True)
    src = followed_source(run)
    assert followed_capture(run) == run / "scope" and src.checkpoint_dir is None
    assert src.info()["steps"] == 0


def test_a_run_being_staged_is_followed_until_it_moves_into_place(tmp_path: Path) -> None:
    """``megatronapp run --out RUN`` writes a hidden sibling, renamed to RUN at the end."""
    from megatronapp.io.outdirs import staged_dir

    run = tmp_path / "run"
    follower = PartsFollower(run)
    with staged_dir(run) as tmp:
        writer = PartWriter(tmp / "scope", 0)
        write_training_step(writer, 0)
        assert followed_capture(run) == tmp / "scope"
        write_training_step(writer, 1)
        assert series_steps(follower) == [0, 1]
        writer.close(dropped=0)
        merge_capture(tmp / "scope", {"source": "train"})
    assert followed_capture(run) == run / "scope"
    snap = follower.poll()
    assert snap is not None and snap.manifest["capture_state"] == "merged"
    assert TrainingSeries.of(snap.stats).steps.tolist() == [0, 1]


def test_ridges_are_per_step_histograms_on_shared_edges() -> None:
    table = pa.table({
        "step": [0, 0, 0, 5, 5, 5, 5],
        "layer": [1, 2, 2, 1, 1, 2, 2],
        "site": ["resid_post"] * 6 + ["attn.q"],
        "stat": ["std"] * 7,
        "value": [1.0, 1.0, 2.0, 3.0, 4.0, float("nan"), 9.0],
    })
    r = TrainingSeries.of(table).ridges("resid_post", "std", bins=3)
    assert r.steps.tolist() == [0, 5]
    np.testing.assert_allclose(r.edges, [1.0, 2.0, 3.0, 4.0])  # NaN and the other site left out
    np.testing.assert_array_equal(r.counts, [[2, 1, 0], [0, 0, 2]])
    assert TrainingSeries.of(table).ridges("resid_post", "mean").counts.sum() == 0


# ------------------------------------------------------------- a real server
@pytest.fixture
def growing(tmp_path: Path) -> Iterator[tuple[PartWriter, ViewServer]]:
    run = tmp_path / "run"
    writer = start_followed_run(run)
    with ViewServer(run, ("--follow",)) as srv:
        yield writer, srv


def next_json(ws: Any, kind: str) -> dict[str, Any]:
    while True:
        msg = ws.recv(timeout=60)
        if isinstance(msg, str) and json.loads(msg)["kind"] == kind:
            return json.loads(msg)


@pytest.mark.slow
def test_a_run_served_from_its_parent_is_named_as_given(tmp_path: Path) -> None:
    # docs/img's screenshots name runs/NAME, not the temporary folder they were made in
    start_followed_run(tmp_path / "runs" / "follow")
    with ViewServer(Path("runs/follow"), ("--follow",), cwd=tmp_path) as srv, client(srv) as ws:
        assert next_json(ws, "info")["capture"] == "runs/follow"


@pytest.mark.slow
def test_a_websocket_client_sees_new_steps_arrive(growing: tuple[PartWriter, ViewServer]) -> None:
    from megatronapp.scope.view.protocol import decode_frame

    writer, srv = growing
    with client(srv) as ws:
        info = next_json(ws, "info")
        assert info["following"] is True and info["live"] is None
        assert next_json(ws, "training")["steps"] == 1
        for step in (1, 2):
            write_training_step(writer, step)
            update = next_json(ws, "training")
            assert update["steps"] == step + 1 and update["last_step"] == step
        ws.send(json.dumps({"type": "series", "site": "resid_post", "stat": "std"}))
        while isinstance(frame := ws.recv(timeout=60), str):
            pass
        header, arrays = decode_frame(frame)
        assert arrays["steps"].tolist() == [0, 1, 2] and arrays["values"].shape == (2, 3)
        assert arrays["ridge_counts"].shape[0] == 3
        assert arrays["ridge_counts"].sum(axis=1).tolist() == [16, 16, 16]  # layers x tokens
    assert srv.alive()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
def test_the_training_view_gains_a_step_and_draws_ridges(
        growing: tuple[PartWriter, ViewServer]) -> None:
    from playwright.sync_api import sync_playwright

    writer, srv = growing
    errors: list[str] = []
    with sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            open_training_view(page, srv.url)
            blank = blank_of(page, 900, 420)
            assert page.evaluate("window.megascope.series.arrays.steps.data.length") == 1
            ridges_one = page.evaluate("document.getElementById('ridge-canvas').toDataURL()")
            line_one = page.evaluate("document.getElementById('train-canvas').toDataURL()")
            assert ridges_one != blank and page.evaluate("window.megascope.ridges") == 1
            follow_next_step(page, writer, 1)
            assert page.evaluate("window.megascope.ridges") == 2
            assert page.evaluate("document.getElementById('ridge-canvas').toDataURL()") != ridges_one
            assert page.evaluate("document.getElementById('train-canvas').toDataURL()") != line_one
            assert "following the run (the run is writing): 2 steps so far (last step 1)" in page.text_content("#dropped")
            shoot(page, Path(srv.target).parent, "training-follow", full_page=True)
        finally:
            browser.close()
    assert errors == [] and srv.alive()


LIVE_RUN = """seed: 3
iterations: 600
schedule: 1f1b
parallel: {tp: 1, pp: 2, dp: 1, microbatches: 2}
model: {layers: 2, hidden: 64, heads: 4, seq_len: 32, vocab: 96, micro_batch_size: 4}
data: {kind: text}
training: {optimizer: adam, lr: 0.003}
scope:
  observe:
    - {site: resid_post, every_n_steps: 20, microbatches: [0], tokens: pooled, stats: [mean, std]}
"""


def wait_for(ready: Any, proc: Any, what: str) -> None:
    """Until ``ready()``; fails when ``proc`` ends first or after 300 s."""
    for _ in range(3000):
        if ready():
            return
        if proc.poll() is not None:
            pytest.fail(f"the training run ended before {what}")
        time.sleep(0.1)
    pytest.fail(f"no {what} after 300 s")


@pytest.mark.slow
def test_following_a_real_torch_training_run(tmp_path: Path) -> None:
    """A two-stage torch training run writes its capture while ``scope serve
    --follow`` serves it: the page's training records count more steps as the
    run goes on, and the last one is the merged capture with every step."""
    import subprocess
    import sys

    from tests.scope_view_support import ROOT

    (tmp_path / "live.yaml").write_text(LIVE_RUN)
    run = tmp_path / "run"
    with open(tmp_path / "run.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "megatronapp.cli", "run",
                                 str(tmp_path / "live.yaml"), "--backend", "torch", "--out",
                                 str(run)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: followed_capture(run) is not None, proc, "its capture's parts/")
            seen: list[tuple[str, int]] = []  # (capture state, steps) of each update
            with ViewServer(run, ("--follow",)) as srv, client(srv) as ws:
                while not seen or seen[-1][0] != "merged":
                    update = next_json(ws, "training")
                    seen.append((update["capture_state"], update["steps"]))
            assert proc.wait(timeout=300) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert seen[-1] == ("merged", 600 // 20)
    live = [steps for state, steps in seen if state == "parts"]
    assert live == sorted(live)
    assert any(0 < steps < 600 // 20 for steps in live), f"no step arrived while it ran: {seen}"
