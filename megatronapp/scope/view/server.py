"""The view's server: a Starlette application on uvicorn, local and guarded.

- Binds 127.0.0.1 unless told otherwise; the HTTP Host must be one it serves
  (an IPv6 literal in brackets, as in its URL).
- Local clients cannot starve it: a connection must send its
  request headers within ``header_timeout`` (slow or silent ones are closed),
  at most ``max_connections`` are open at once (more are closed as they come),
  and when descriptors run out new connections are accepted and closed at once
  with a spare descriptor (logged once) instead of asyncio's retry loop, which
  spins logging a traceback per attempt.
- The websocket needs the session token (from the URL the server prints) and
  an Origin in the allow-list (the server's own origins); anything else is
  closed before it is accepted, and logged.
- Every client message is size-checked and validated (``protocol``); a
  refused one is answered with a ``refused`` record, logged, and the
  connection and the server go on. Nothing received is ever evaluated.
- Arrays travel as binary frames; perturbations only with ``allow_perturb``.
- One generation runs at a time, in a worker thread, so the server keeps
  answering while a model decodes; it is free again before its ``done`` is
  sent, so the next ``generate`` after ``done`` is always accepted.
- Following a run (``follower``), every connection polls the capture's files
  (at most one read per ``POLL_S`` for all connections) and is sent a
  ``training`` record whenever new steps' statistics have arrived.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import json
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket, WebSocketDisconnect

from ...errors import UserError
from ...host.listen import host_names
from ..generate import GenerationStep
from . import analyses
from .protocol import (MAX_FRAME_BYTES, Analysis, Generate, Refused, Series, Stop,
                       encode_frame, parse_message)
from .follow import PartsFollower
from .source import TrainingSeries, ViewSource
from .steps import step_message

log = logging.getLogger("megatronapp.scope.view")
STATIC = Path(__file__).parent / "static"
POLICY_CLOSE = 1008  # websocket close code: policy violation
POLL_S = 1.0  # a followed capture is read at most this often
_GONE = (WebSocketDisconnect, RuntimeError, OSError)  # sending to a page that went away


@dataclass(frozen=True)
class LiveModel:
    """A checkpoint that can decode: ``run(prompt, tokens, top_k, perturb)``
    yields one ``GenerationStep`` per token (the CLI builds it on a backend)."""

    layers: int
    heads: int
    seq_len: int
    run: Callable[[str, int, int, list[dict[str, Any]]], Iterator[GenerationStep]]
    decode: Callable[[list[int]], str]


def url_host(host: str) -> str:
    """A host as it appears in a URL and a Host header: an IPv6 literal in brackets."""
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]"
    return host


@dataclass(frozen=True)
class ServerConfig:
    token: str
    origins: frozenset[str]
    hosts: tuple[str, ...]
    allow_perturb: bool

    @classmethod
    def local(cls, host: str, port: int, allow_perturb: bool) -> "ServerConfig":
        names = list(dict.fromkeys([*host_names(host), "127.0.0.1", "localhost"]))
        origins = frozenset(f"http://{url_host(n)}:{port}" for n in names)
        return cls(secrets.token_urlsafe(24), origins, tuple(url_host(n) for n in names),
                   allow_perturb)


def _headers(response: Response) -> Response:
    """No script, style or connection but the server's own; the token stays in the URL bar."""
    response.headers["Content-Security-Policy"] = (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Cache-Control"] = "no-store"
    return response


class _GuardedStatic(StaticFiles):
    async def get_response(self, path: str, scope: Any) -> Response:
        return _headers(await super().get_response(path, scope))


class Connection:
    """One accepted websocket: its messages, and the generation it may run."""

    def __init__(self, ws: WebSocket, app: "ViewApp"):
        self.ws, self.app = ws, app
        self.stop = threading.Event()
        self.task: asyncio.Task[None] | None = None
        self.peer = f"{ws.client.host}:{ws.client.port}" if ws.client else "?"

    async def refuse(self, reason: str) -> None:
        log.warning("refused a message from %s: %s", self.peer, reason)
        await self.ws.send_json({"kind": "refused", "reason": reason})

    async def watch(self) -> None:
        """Following a run: tell the page whenever new statistics have arrived,
        and what is wrong when a file of the run cannot be read."""
        seen, said = -1, None
        while True:
            version = await self.app.refresh()
            if version != seen:
                seen = version
                await self.ws.send_json({"kind": "training",
                                         **self.app.source.training_info()})
            if self.app.problem != said:
                said = self.app.problem
                if said is not None:
                    await self.ws.send_json({"kind": "error", "message": said})
            await asyncio.sleep(POLL_S)

    async def serve(self) -> None:
        await self.ws.send_json({"kind": "info", **self.app.info()})
        watcher = asyncio.create_task(self.watch()) if self.app.follower else None
        try:
            while True:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                if msg.get("text") is None:
                    await self.refuse("binary messages are not accepted")
                    continue
                try:
                    await self.handle(parse_message(msg["text"]))
                except Refused as err:
                    await self.refuse(str(err))
        except WebSocketDisconnect:
            pass
        finally:
            self.stop.set()
            if watcher is not None:
                watcher.cancel()

    async def handle(self, m: Generate | Stop | Series | Analysis) -> None:
        if isinstance(m, Stop):
            self.stop.set()
        elif isinstance(m, Series):
            await self.send_series(m)
        elif isinstance(m, Analysis):
            await self.send_analysis(m)
        else:
            await self.start_generation(m)

    async def send_series(self, m: Series) -> None:
        series = self.app.source.series
        values = series.values.get((m.site, m.stat))
        if values is None:
            raise Refused(f"series: the capture has no statistic {m.stat!r} at {m.site!r}")
        ridges = series.ridges(m.site, m.stat)
        header = {"kind": "series", "site": m.site, "stat": m.stat, "layers": series.layers}
        await self.ws.send_bytes(encode_frame(header, {
            "steps": series.steps, "values": values, "ridge_edges": ridges.edges,
            "ridge_counts": ridges.counts}))

    async def send_analysis(self, m: Analysis) -> None:
        """A stored lens, patching or attribution result, if it is one of those listed."""
        capture_dir = self.app.source.capture_dir
        if m.name not in await asyncio.to_thread(analyses.listed, capture_dir):
            raise Refused(f"analysis: the capture has no result {m.name!r}")
        try:
            view = await asyncio.to_thread(analyses.read, capture_dir / f"{m.name}.json")
        except UserError as err:
            await self.ws.send_json({"kind": "error", "message": str(err)})
            return
        result = json.loads(view.model_dump_json())  # non-finite numbers become null
        await self.ws.send_json({"kind": "analysis", "name": m.name, "result": result})

    async def start_generation(self, m: Generate) -> None:
        live = self.app.live
        if live is None:
            raise Refused("generate: no checkpoint next to this capture: live generation is off")
        if m.perturb is not None and not self.app.config.allow_perturb:
            raise Refused("perturb: perturbations are off (start the server with --allow-perturb)")
        if m.perturb is not None and m.perturb.layer > live.layers:
            raise Refused(f"perturb.layer: the model has {live.layers} layers")
        if not self.app.generation_lock.acquire(blocking=False):
            raise Refused("generate: a generation is already running")
        self.stop = threading.Event()
        self.task = asyncio.create_task(self.generation(m, live))

    async def generation(self, m: Generate, live: LiveModel) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        perturb = [m.perturb.scope_entry()] if m.perturb is not None else []
        worker = threading.Thread(target=_decode, daemon=True, name="megascope-decode",
                                  args=(live, m, perturb, self.stop, loop, queue))
        last: dict[str, Any] | None = None
        try:
            worker.start()
            last = await self.stream(queue)
        except _GONE:  # the page went away
            self.stop.set()
        finally:
            await asyncio.to_thread(worker.join)
            self.app.generation_lock.release()
        if last is not None:  # sent once the next generation may start
            with contextlib.suppress(*_GONE):
                await self.ws.send_json(last)

    async def stream(self, queue: asyncio.Queue[Any]) -> dict[str, Any] | None:
        """Send the worker's frames as they come; its last record (``done`` or
        ``error``) is returned, not sent."""
        last = None
        while (item := await queue.get()) is not None:
            if isinstance(item, bytes):
                await self.ws.send_bytes(item)
            else:
                last = item
        return last


def _decode(live: LiveModel, m: Generate, perturb: list[dict[str, Any]], stop: threading.Event,
            loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Any]) -> None:
    """The worker thread: decode, encode each step as a frame, hand it to the loop."""
    def put(item: Any) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, item)

    steps = 0
    try:
        it = live.run(m.prompt, m.tokens, m.top_k, perturb)
        try:
            while not stop.is_set():
                cpu, wall = time.thread_time(), time.perf_counter()
                rec = next(it, None)
                if rec is None:
                    break
                decoded_at = time.time()
                header, arrays = step_message(rec, live.layers, live.decode, decoded_at)
                header.update(decode_cpu_s=time.thread_time() - cpu,
                              decode_wall_s=time.perf_counter() - wall)
                put(encode_frame(header, arrays))
                steps += 1
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()
        put({"kind": "done", "steps": steps, "stopped": stop.is_set()})
    except UserError as err:
        put({"kind": "error", "message": str(err)})
    except Exception as err:  # noqa: BLE001 - the server must go on; the page says what failed
        log.exception("generation failed")
        put({"kind": "error", "message": f"generation failed: {type(err).__name__}: {err}"})
    finally:
        put(None)


class ViewApp:
    """The application's state: what it shows and how it is guarded."""

    def __init__(self, source: ViewSource, live: LiveModel | None, config: ServerConfig,
                 follower: PartsFollower | None = None):
        self.source, self.live, self.config = source, live, config
        self.generation_lock = threading.Lock()
        self.follower = follower
        self.version = 0  # how many times the followed capture has changed
        self.problem: str | None = None  # what the last read of the followed capture could not read
        self._polled = -POLL_S
        self._poll_lock = asyncio.Lock()

    async def refresh(self) -> int:
        """Read the followed capture if the last read is ``POLL_S`` old; the version."""
        async with self._poll_lock:
            if self.follower is not None and time.monotonic() - self._polled >= POLL_S:
                self._polled = time.monotonic()
                try:
                    snap = await asyncio.to_thread(self.follower.poll)
                except UserError as err:
                    if str(err) != self.problem:
                        log.warning("%s", err)
                    self.problem, snap = str(err), None
                else:
                    self.problem = None
                if snap is not None:
                    self.source = replace(self.source, manifest=snap.manifest,
                                          series=TrainingSeries.of(snap.stats))
                    self.version += 1
        return self.version

    def info(self) -> dict[str, Any]:
        live = self.live
        return {**self.source.info(), "allow_perturb": self.config.allow_perturb,
                "analyses": analyses.listed(self.source.capture_dir),
                "following": self.follower is not None,
                "live": None if live is None else {"layers": live.layers, "heads": live.heads,
                                                   "seq_len": live.seq_len}}

    async def index(self, request: Request) -> Response:
        return _headers(FileResponse(STATIC / "index.html"))

    async def websocket(self, ws: WebSocket) -> None:
        token = ws.query_params.get("token", "")
        origin = ws.headers.get("origin", "")
        peer = f"{ws.client.host}:{ws.client.port}" if ws.client else "?"
        if not secrets.compare_digest(token.encode(), self.config.token.encode()):
            log.warning("refused a websocket from %s: missing or wrong token", peer)
            await ws.close(POLICY_CLOSE)
            return
        if origin not in self.config.origins:
            log.warning("refused a websocket from %s: origin %r not allowed", peer, origin[:100])
            await ws.close(POLICY_CLOSE)
            return
        await ws.accept()
        await Connection(ws, self).serve()

    def starlette(self) -> Starlette:
        routes = [Route("/", self.index), WebSocketRoute("/ws", self.websocket),
                  Mount("/static", _GuardedStatic(directory=STATIC), name="static")]
        hosts = ["*"] if any(h in ("0.0.0.0", "[::]") for h in self.config.hosts) else list(
            self.config.hosts)
        return Starlette(routes=routes,
                         middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=hosts)])


@dataclass(frozen=True)
class Limits:
    """The server's bounds on its clients: seconds a connection has to send its
    request headers, and how many connections may be open at once."""

    header_timeout: float
    max_connections: int


class Listener(socket.socket):
    """The listening socket. When the process is out of descriptors, asyncio's
    accept loop retries at once and logs a traceback per try (a busy loop that
    floods stderr); instead, a spare descriptor kept open for the purpose is
    freed to accept each waiting connection and close it, which empties the
    backlog, so the socket is not ready again until a new client comes."""

    def __init__(self, family: int) -> None:
        super().__init__(family, socket.SOCK_STREAM)
        self.spare: int | None = None
        self.exhausted = False  # logged once per spell without descriptors
        self.resting = False  # no spare either: asyncio's one-second pause
        self._reserve()

    def _reserve(self) -> None:
        if self.spare is None:
            with contextlib.suppress(OSError):
                self.spare = os.open(os.devnull, os.O_RDONLY)

    def accept(self) -> tuple[socket.socket, Any]:
        if self.resting:
            raise BlockingIOError(errno.EAGAIN, "resting")
        try:
            conn = super().accept()
        except OSError as err:
            if err.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            self._shed(err)
        self.exhausted = False
        return conn

    def _shed(self, err: OSError) -> NoReturn:
        """Close the waiting connections; ``BlockingIOError`` ends asyncio's accept loop."""
        if not self.exhausted:
            self.exhausted = True
            log.warning("out of file descriptors (%s): closing new connections until "
                        "some close", err.strerror)
        if self.spare is None:
            self._reserve()
        if self.spare is None:  # asyncio pauses accepting for a second; the rest of this turn rests
            # (asyncio's loop goes on calling accept: without the rest, it logs once per call)
            self.resting = True
            asyncio.get_running_loop().call_soon(setattr, self, "resting", False)
            raise err
        os.close(self.spare)
        self.spare = None
        try:
            while True:
                fd, _ = self._accept()  # type: ignore[attr-defined]
                os.close(fd)
        except OSError:
            pass
        finally:
            self._reserve()
        raise BlockingIOError(errno.EAGAIN, "waiting connections closed")

    def close(self) -> None:
        if self.spare is not None:
            os.close(self.spare)
            self.spare = None
        super().close()


class GuardedConfig(uvicorn.Config):
    """uvicorn's configuration with the per-client limits its protocol reads."""

    def __init__(self, app: Any, limits: Limits, **kwargs: Any) -> None:
        super().__init__(app, http=GuardedH11, **kwargs)
        self.limits = limits
        self.full = False  # logged once per spell at the connection cap


class GuardedH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a header deadline and a connection cap:
    a connection over the cap is closed as it opens; one that has not sent a
    whole request head ``header_timeout`` after it opened (or after its last
    response) is closed, however slowly it keeps sending."""

    def __init__(self, config: uvicorn.Config, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        assert isinstance(config, GuardedConfig)
        self.guarded = config
        self.header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.guarded.limits.max_connections:
            if not self.guarded.full:
                self.guarded.full = True
                log.warning("%d connections open: closing new ones until some close",
                            self.guarded.limits.max_connections)
            transport.close()
            return
        self.guarded.full = False
        self._await_headers()

    def _await_headers(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
        self.header_timer = self.loop.call_later(self.guarded.limits.header_timeout,
                                                 self._headers_late)

    def _headers_late(self) -> None:
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_headers()  # a kept-alive connection's next request head

    def connection_lost(self, exc: Exception | None) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
        super().connection_lost(exc)


def bind(host: str, port: int) -> Listener:
    """The listening socket, or a one-line error (a port in use, a bad host)."""
    sock = Listener(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise UserError(f"--port: cannot listen on {host}:{port}: "
                        f"{err.strerror or err}") from None
    sock.listen(64)
    return sock


def log_to_stderr() -> None:
    """Refusals and failures of the view, one line each, on stderr."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def run_server(app: ViewApp, sock: Listener, limits: Limits) -> None:
    config = GuardedConfig(app.starlette(), limits, log_level="warning", ws="websockets-sansio",
                           ws_max_size=MAX_FRAME_BYTES, lifespan="off", loop="asyncio")
    uvicorn.Server(config).run(sockets=[sock])
