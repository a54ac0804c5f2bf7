"""The view's test support: a tiny run directory and a real server process.

``make_run`` writes a checkpoint of an untrained character-level model (the
tiny model's vocabulary, over CPython's own text) and a generation capture
beside it; ``ViewServer`` starts ``megatronapp scope serve`` on a free port in
a subprocess and reads the URL (with its token) that it prints.
"""
from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = {"layers": 2, "hidden": 64, "heads": 4, "seq_len": 64, "vocab": 96}


def make_run(out: Path, model: dict[str, Any] = TINY, steps: int = 4) -> Path:
    """``out/checkpoint`` (untrained, seeded) and ``out/gen/clean`` (a capture
    of ``steps`` decoding steps with a perturbed run beside it)."""
    from backends.torch.scope_generate import generate, initial_state, one_rank
    from megatronapp.scenario.checkpoint import read_checkpoint, write_checkpoint
    from megatronapp.scenario.config import Data, parse_scenario
    from megatronapp.scope.cli import generation_scope

    with one_rank():
        s = parse_scenario({"seed": 3, "model": model, "data": {"kind": "random"}})
        write_checkpoint(out / "checkpoint", initial_state(s), s.model, Data(kind="text"),
                         {"iterations": 0})
        ckpt = read_checkpoint(out / "checkpoint")
        scope = generation_scope(ckpt, None, ['{kind: act_noise, site: resid_post, layers: [1], '
                                              'sigma: 0.3}'], 0)
        for _ in generate(ckpt, "def f(x):", steps, scope, out=out / "gen"):
            pass
    return out / "gen"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A module's run directory: a checkpoint and a three-step capture."""
    out = tmp_path_factory.mktemp("run")
    make_run(out, steps=3)
    return out


@dataclass
class ViewServer:
    """``megatronapp scope serve`` in a subprocess; stderr is collected in ``log``."""

    target: Path
    args: tuple[str, ...] = ()
    cwd: Path = ROOT  # a relative target is shown as given: the screenshots' neutral paths
    fd_limit: int | None = None  # the server's RLIMIT_NOFILE (soft), when set
    url: str = ""
    proc: subprocess.Popen[str] | None = None
    log: list[str] = field(default_factory=list)

    def __enter__(self) -> "ViewServer":
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "megatronapp.cli", "scope", "serve", str(self.target),
             "--port", "0", *self.args], cwd=self.cwd, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, preexec_fn=self._limit_fds)
        threading.Thread(target=self._drain, daemon=True).start()
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            found = re.search(r"http://\S+", line)
            if found:
                self.url = found.group(0)
                break
        if not self.url:
            self.proc.wait(timeout=30)
            raise RuntimeError(f"the server did not start: {''.join(self.log)[-2000:]}")
        return self

    def _limit_fds(self) -> None:
        if self.fd_limit is not None:
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.fd_limit, hard))

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    @property
    def origin(self) -> str:
        u = urlparse(self.url)
        return f"{u.scheme}://{u.netloc}"

    @property
    def token(self) -> str:
        return parse_qs(urlparse(self.url).query)["token"][0]

    def ws_url(self, token: str | None = None) -> str:
        return (self.origin.replace("http://", "ws://") + "/ws"
                + ("" if token is None else f"?token={token}"))

    def logged(self, since: int, text: str, limit_s: float = 60.0) -> bool:
        """Whether ``text`` shows in the server's stderr after line ``since``,
        waiting for it (the server writes its log line after it answers)."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if text in "".join(self.log[since:]):
                return True
            time.sleep(0.05)
        return False

    @property
    def port(self) -> int:
        return int(urlparse(self.url).port or 0)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def client(srv: ViewServer, token: str | None = "", origin: str | None = "") -> Any:
    """A websocket client of ``srv``: its token and origin unless others are given."""
    from websockets.sync.client import connect

    return connect(srv.ws_url(srv.token if token == "" else token), proxy=None,
                   origin=srv.origin if origin == "" else origin,  # type: ignore[arg-type]
                   open_timeout=20)


CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]


def chromium_path() -> str:
    """Debian's chromium: its launcher script, or the binary behind it where the
    launcher cannot run (it sources /etc/chromium.d, absent on a bare system)."""
    launcher, binary = Path("/usr/bin/chromium"), Path("/usr/lib/chromium/chromium")
    if launcher.exists() and Path("/etc/chromium.d").is_dir():
        return str(launcher)
    if binary.exists():
        return str(binary)
    raise RuntimeError("Debian's chromium is not installed (/usr/bin/chromium): scripts/setup "
                       "installs it")


def page_with_errors(browser: Any, viewport: dict[str, int]) -> tuple[Any, list[str]]:
    """A new page, and the list its console errors and uncaught exceptions go to."""
    errors: list[str] = []
    page = browser.new_page(viewport=viewport)
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    return page, errors


def blank_of(page: Any, width: int, height: int) -> str:
    """What an empty canvas of this size looks like, as a data URL."""
    return page.evaluate(  # type: ignore[no-any-return]
        f"(() => {{ const c = document.createElement('canvas'); c.width = {width}; "
        f"c.height = {height}; return c.toDataURL(); }})()")


def shoot(page: Any, tmp_path: Path, name: str, full_page: bool = False) -> None:
    """A screenshot in ``tmp_path``, copied to ``$MEGASCOPE_SCREENSHOTS`` when set."""
    path = tmp_path / f"megascope-{name}.png"
    page.screenshot(path=str(path), full_page=full_page)
    target = os.environ.get("MEGASCOPE_SCREENSHOTS")
    if target:
        shutil.copyfile(path, Path(target) / path.name)


def launch_chromium(playwright: Any) -> Any:
    return playwright.chromium.launch(executable_path=chromium_path(), headless=True,
                                      args=CHROMIUM_ARGS)


def write_training_step(writer: Any, step: int, layers: int = 2, tokens: int = 8) -> None:
    """One training step's statistics of ``resid_post`` (mean, std per layer and
    token), reduced and written as a run's rank does: partial columns of real
    tensors through ``stats.partials``, then ``PartWriter.write`` and a flush."""
    import numpy as np
    import torch

    from megatronapp.scope import stats
    from megatronapp.scope.storage import HostRecord, RecordKey, Rows
    from megatronapp.scenario.scope_spec import parse_stat

    specs = (parse_stat("mean"), parse_stat("std"))
    gen = torch.Generator().manual_seed(step)
    rows = np.arange(tokens)
    records = []
    for layer in range(1, layers + 1):
        x = torch.randn(tokens, 16, generator=gen) * (1 + step) + layer  # spreads out as it trains
        part = stats.partials(x, specs, stats.Slice(0, 16)).numpy()
        records.append(HostRecord(RecordKey(step, 0, 0, layer, "resid_post"),
                                  Rows(rows * 0, rows * 0 - 1, rows),
                                  tuple(s.label for s in specs), tuple(stats.widths(specs, 16)),
                                  part))
    writer.write(records, [])
    writer.flush()


def start_followed_run(run: Path) -> Any:
    """A run directory as a training run lays it out, its first step written;
    the writer that writes the next ones."""
    from megatronapp.scope.storage import PartWriter

    writer = PartWriter(run / "scope", 0)
    write_training_step(writer, 0)
    return writer


def open_training_view(page: Any, url: str) -> None:
    """The page at ``url`` on its training tab, once it has drawn the series."""
    page.goto(url)
    page.click("#tabs button[data-tab=training]")
    page.wait_for_function("() => window.megascope.series !== null")


def follow_next_step(page: Any, writer: Any, step: int) -> None:
    """Write ``step`` and wait until the followed page has drawn it."""
    write_training_step(writer, step)
    page.wait_for_function(
        f"() => window.megascope.series.arrays.steps.data.length === {step + 1}",
        timeout=60_000)
