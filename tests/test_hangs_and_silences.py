"""What used to hang, lose an update or say nothing: a watch of a job whose
metadata is impossible ends with one line; commands adding files to one run
at once each keep theirs in its manifest; a watch of garbage says so and reads
an unchanged file once; a sweep whose report is refused leaves no table; a
character the model does not know is refused as an answer; a temperature the
sampler cannot take is refused; a followed capture that cannot be read is said
on the page; an inert mitigation beside MegaFBD is accepted."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatronapp.scan.ingest import kineto
from megatronapp.scenario.config import ScenarioError, load_scenario

from .scope_view_support import ViewServer, client, make_run
from .support import ROOT, capped_cli, one_line_error

def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return capped_cli(*args, cwd=cwd, memory=6 << 30)


one_line = one_line_error


def _kineto_file(path: Path, rank: int, world: int) -> None:
    data = {"schemaVersion": 1, "traceEvents": [], "baseTimeNanoseconds": 0,
            "distributedInfo": {"rank": rank, "world_size": world}}
    path.write_text(json.dumps(data))


# ------------------------------------------------------------------ hangs
def test_a_watch_of_a_job_of_negative_world_size_ends(tmp_path):
    _kineto_file(tmp_path / "r0.pt.trace.json", 0, -3)
    one_line(cli("watch", str(tmp_path), "--idle", "2", "--interval", "0.1"),
             "distributedInfo.world_size must be an integer >= 1, got -3")


def test_a_folder_removed_while_it_is_watched(tmp_path):
    from megatronapp.errors import UserError
    from megatronapp.scan.online.online_config import OnlineConfig
    from megatronapp.scan.online.watch import follow

    watched = tmp_path / "job"
    watched.mkdir()
    polls: list[str] = []

    def progress(line: str) -> None:  # called once a poll: the folder goes after the first
        polls.append(line)
        if len(polls) == 1:
            watched.rmdir()

    with pytest.raises(UserError) as caught:
        follow(watched, OnlineConfig(), lambda _scan, _its: None, progress, interval_s=0.01)
    assert str(caught.value) == f"DIR: {watched} was removed while it was watched"
    assert len(polls) == 1


# ------------------------------------------------------------------ lost updates
def test_concurrent_exports_into_one_run_each_keep_their_file(throttle_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(throttle_run, run)

    def export(i: int) -> int:
        return cli("export-trace", str(run), "--ranks", str(i % 16), "--iterations", "0",
                   "--out", str(run / f"export-{i}.json")).returncode

    with ThreadPoolExecutor(max_workers=30) as pool:
        codes = list(pool.map(export, range(30)))
    assert codes == [0] * 30
    added = json.loads((run / "manifest.json").read_text())["added"]
    assert sorted(added) == sorted(f"export-{i}.json" for i in range(30))


def test_files_added_at_once_each_join_the_manifest_however_slow_its_write(
        throttle_run, tmp_path, monkeypatch):
    """Sixteen writers add a file each while every manifest write takes 50 ms:
    without the lock each reads the manifest before the others have written."""
    from megatronapp.io import outdirs

    run = tmp_path / "run"
    shutil.copytree(throttle_run, run)
    write = outdirs._write_manifest

    def slow(*args: object) -> None:
        time.sleep(0.05)
        write(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(outdirs, "_write_manifest", slow)

    def add(i: int) -> None:
        with outdirs.new_file(run / f"note-{i}.txt", "--out") as tmp:
            tmp.write_text(str(i))

    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(add, range(16)))
    added = json.loads((run / "manifest.json").read_text())["added"]
    assert sorted(added) == sorted(f"note-{i}.txt" for i in range(16))


# ------------------------------------------------------------------ silences
def test_a_watch_of_garbage_says_so_and_reads_each_unchanged_file_once(tmp_path, monkeypatch,
                                                                       capsys):
    job = tmp_path / "job"
    job.mkdir()
    for r in range(2):
        (job / f"r{r}.pt.trace.json.gz").write_bytes(gzip.compress(os.urandom(4096)))
    reads: list[Path] = []
    real = kineto.read_json_any

    def counted(path: Path, max_bytes: float | None = None) -> object:
        reads.append(Path(path))
        return real(path, max_bytes)

    monkeypatch.setattr("megatronapp.scan.online.watch.read_json_any", counted)
    from megatronapp.cli import main

    assert main(["watch", str(job), "--idle", "2", "--interval", "0.05"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "r0.pt.trace.json.gz" in err[0] and "not a file being written" \
        in err[0]
    assert sorted(reads) == sorted(job.iterdir())  # tens of polls, each file inflated once


def test_a_watch_of_a_folder_of_other_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    one_line(cli("watch", str(tmp_path), "--idle", "1", "--interval", "0.1"),
             "no torch.profiler traces", "notes.txt")


def test_a_refused_report_leaves_no_table(tmp_path):
    (tmp_path / "s.yaml").write_text(f"scenario: {ROOT / 'scenarios/throttle.yaml'}\n")
    one_line(cli("sweep", "s.yaml", "--out", "t.parquet", "--report", "/proc/r.html",
                 cwd=tmp_path), "--report")
    assert [p.name for p in tmp_path.iterdir()] == ["s.yaml"]


def test_an_inert_mitigation_beside_fbd_is_accepted_and_an_acting_one_named():
    fbd = ROOT / "scenarios/fbd_hetero.yaml"
    assert load_scenario(fbd, ["mitigation={action: none}"]).mitigation is not None
    with pytest.raises(ScenarioError) as caught:
        load_scenario(fbd, ["mitigation={action: exclude}"])
    assert caught.value.field == "mitigation.action" and "action: none" in str(caught.value)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    make_run(out, steps=2)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("option", ["--answer", "--baseline"])
def test_an_answer_the_model_does_not_know_is_refused(tiny, option):
    line = one_line(cli("scope", "dla", str(tiny / "gen"), "--prompt", "def f", option, "€"),
                    option, "'€' is not in the model's vocabulary")
    assert "\ufffd" not in line and not list((tiny / "gen" / "clean").glob("dla-*"))


@pytest.mark.slow
def test_a_followed_capture_of_garbage_parquet_is_said_on_the_page(tmp_path):
    part = tmp_path / "run" / "scope" / "parts" / "rank0"
    part.mkdir(parents=True)
    (part / "stats-000001.parquet").write_bytes(b"not parquet at all")
    with ViewServer(tmp_path / "run", ("--follow",)) as srv, client(srv) as ws:
        kinds = []
        for _ in range(4):
            message = json.loads(ws.recv(timeout=30))
            kinds.append(message["kind"])
            if message["kind"] == "error":
                assert "stats-000001.parquet" in message["message"]
                assert "not a readable part file" in message["message"]
                break
        assert "error" in kinds, kinds
        assert srv.logged(0, "not a readable part file", 10)
