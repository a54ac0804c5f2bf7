"""Nothing listens beyond this machine: the listening sockets of a whole
process tree (the command and every process it started), sampled while a real
torch-backend run and a real ``scope serve`` with live generation run, are
all on a loopback address. ``scope serve`` binds another address only when
asked (``--allow-remote``), and then says so."""
from __future__ import annotations

import ipaddress
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from .scope_view_support import ViewServer, run_dir  # noqa: F401 (a fixture)
from .support import ROOT, TINY_MODEL

pytestmark = pytest.mark.slow

PIPE = {"name": "pipe", "seed": 1, "iterations": 3, "schedule": "1f1b",
        "parallel": {"pp": 2, "microbatches": 2}, "model": {"layers": 2, **TINY_MODEL}}


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket listening in ``pid``'s process tree."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return set()
    found = set()
    for proc in tree:
        try:
            found |= {(c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="tcp")
                      if c.status == psutil.CONN_LISTEN}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def reachable_from_elsewhere(sockets: set[tuple[str, int]]) -> set[tuple[str, int]]:
    return {(ip, port) for ip, port in sockets if not ipaddress.ip_address(ip).is_loopback}


def test_a_torch_run_listens_on_loopback_only(tmp_path: Path) -> None:
    scenario = tmp_path / "pipe.yaml"
    scenario.write_text(yaml.safe_dump(PIPE))
    proc = subprocess.Popen([sys.executable, "-m", "megatronapp.cli", "run", str(scenario),
                             "--backend", "torch", "--out", str(tmp_path / "run"), "--quiet"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set[tuple[str, int]] = set()
    ranks_seen = 0
    while proc.poll() is None:
        seen |= listening(proc.pid)
        try:
            ranks_seen = max(ranks_seen, len(psutil.Process(proc.pid).children(recursive=True)))
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.05)
    _, err = proc.communicate()
    assert proc.returncode == 0, err
    assert ranks_seen >= 2  # the sampling saw the ranks themselves
    assert reachable_from_elsewhere(seen) == set(), seen


def test_scope_serve_with_live_generation_listens_on_loopback_only(run_dir: Path) -> None:
    assert (run_dir / "checkpoint").is_dir()  # so the server joins a process group to decode
    with ViewServer(run_dir / "gen") as srv:
        assert srv.proc is not None
        seen = listening(srv.proc.pid)
        assert ("127.0.0.1", srv.port) in seen  # the view itself
        assert reachable_from_elsewhere(seen) == set(), seen


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "example.org"])
def test_another_address_needs_the_opt_in(run_dir: Path, host: str) -> None:
    # a subprocess: a server that starts (as one did before the opt-in) fails the test by time
    result = subprocess.run([sys.executable, "-m", "megatronapp.cli", "scope", "serve",
                             str(run_dir / "gen"), "--host", host, "--port", "0"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--allow-remote" in result.stderr
    assert result.stdout == ""


def test_with_the_opt_in_the_server_warns_and_keeps_its_token(run_dir: Path) -> None:
    with ViewServer(run_dir / "gen", ("--host", "0.0.0.0", "--allow-remote")) as srv:
        assert srv.logged(0, "warning: listening on every interface", 30)
        assert srv.token and "127.0.0.1" not in srv.url.split("?")[0]
