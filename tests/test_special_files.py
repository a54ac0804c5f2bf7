"""Special files as inputs: a device, a FIFO, links to them, a compression
bomb. Each command says what the file is in one line, exit 2, in bounded
memory and time, instead of reading without end or waiting forever; a FIFO
beside a served capture leaves the server answering."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .scope_view_support import ViewServer, client, run_dir  # noqa: F401 (a fixture)
from .support import ROOT, capped_cli, one_line_error

pytestmark = pytest.mark.slow
def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return capped_cli(*args, cwd=cwd)


one_line = one_line_error


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "scenario.yaml"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("command", ["run", "predict"])
def test_dev_zero_as_a_scenario(command, tmp_path):
    link = tmp_path / "zero.yaml"
    link.symlink_to("/dev/zero")
    one_line(cli(command, "/dev/zero"), "/dev/zero", "character device")
    one_line(cli(command, str(link)), "a link to /dev/zero", "character device")


@pytest.mark.parametrize("command", ["run", "predict"])
def test_a_fifo_as_a_scenario(command, fifo):
    one_line(cli(command, str(fifo)), "FIFO")


def test_a_gzip_bomb_is_refused_before_it_inflates(tmp_path):
    bomb = tmp_path / "rank0.pt.trace.json.gz"
    with gzip.open(bomb, "wb", compresslevel=9) as fh:
        for _ in range(512):  # 512 MiB of zeros, about 0.5 MB on disk
            fh.write(b"\0" * (1 << 20))
    with open(bomb, "ab") as fh:  # a last member whose trailer says 1 byte: the size check passes
        fh.write(gzip.compress(b" "))
    one_line(cli("detect", str(bomb)), "inflates more than 200 times")


@pytest.mark.parametrize("name", ["gen/clean/manifest.json", "gen/manifest.json"])
def test_scope_serve_on_a_run_whose_file_is_a_link_to_dev_zero(run_dir, tmp_path, name):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run, symlinks=True)
    target = run / name
    if target.exists():
        target.unlink()
    target.symlink_to("/dev/zero")
    line = one_line(cli("scope", "serve", str(run / "gen"), "--port", "0"), "character device")
    assert "/dev/zero" in line


def test_a_fifo_beside_a_served_capture_leaves_the_server_answering(run_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run, symlinks=True)
    os.mkfifo(run / "gen" / "clean" / "lens-0123456789ab.json")  # a result's name
    with ViewServer(run / "gen") as srv, client(srv) as ws:
        info = json.loads(ws.recv(timeout=30))
        assert info["kind"] == "info" and "FIFO" in info["analyses"]["lens-0123456789ab"]
        ws.send(json.dumps({"type": "analysis", "name": "lens-0123456789ab"}))
        answer = json.loads(ws.recv(timeout=30))
        assert answer["kind"] in ("refused", "error") and srv.alive()
