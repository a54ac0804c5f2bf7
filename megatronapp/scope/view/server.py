"""The view's server: a Starlette application on uvicorn, local and guarded.

- Binds 127.0.0.1 unless told otherwise; the HTTP Host must be one it serves.
- The websocket needs the session token (from the URL the server prints) and
  an Origin in the allow-list (the server's own origins); anything else is
  closed before it is accepted, and logged.
- Every client message is size-checked and validated (``protocol``); a
  refused one is answered with a ``refused`` record, logged, and the
  connection and the server go on. Nothing received is ever evaluated.
- Arrays travel as binary frames; perturbations only with ``allow_perturb``.
- One generation runs at a time, in a worker thread, so the server keeps
  answering while a model decodes.
- Following a run (``follower``), every connection polls the capture's files
  (at most one read per ``POLL_S`` for all connections) and is sent a
  ``training`` record whenever new steps' statistics have arrived.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket, WebSocketDisconnect

from ...errors import UserError
from ..generate import GenerationStep
from .protocol import (MAX_FRAME_BYTES, Generate, Refused, Series, Stop, encode_frame,
                       parse_message)
from .follow import PartsFollower
from .source import TrainingSeries, ViewSource
from .steps import step_message

log = logging.getLogger("megatronapp.scope.view")
STATIC = Path(__file__).parent / "static"
POLICY_CLOSE = 1008  # websocket close code: policy violation
POLL_S = 1.0  # a followed capture is read at most this often


@dataclass(frozen=True)
class LiveModel:
    """A checkpoint that can decode: ``run(prompt, tokens, top_k, perturb)``
    yields one ``GenerationStep`` per token (the CLI builds it on a backend)."""

    layers: int
    heads: int
    seq_len: int
    run: Callable[[str, int, int, list[dict[str, Any]]], Iterator[GenerationStep]]
    decode: Callable[[list[int]], str]


@dataclass(frozen=True)
class ServerConfig:
    token: str
    origins: frozenset[str]
    hosts: tuple[str, ...]
    allow_perturb: bool

    @classmethod
    def local(cls, host: str, port: int, allow_perturb: bool) -> "ServerConfig":
        names = [host] if host in ("127.0.0.1", "localhost") else [host, "127.0.0.1", "localhost"]
        names += [n for n in ("127.0.0.1", "localhost") if n not in names]
        origins = frozenset(f"http://{n}:{port}" for n in names if n not in ("0.0.0.0", "::"))
        return cls(secrets.token_urlsafe(24), origins, tuple(names), allow_perturb)


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
        """Following a run: tell the page whenever new statistics have arrived."""
        seen = -1
        while True:
            version = await self.app.refresh()
            if version != seen:
                seen = version
                await self.ws.send_json({"kind": "training",
                                         **self.app.source.training_info()})
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

    async def handle(self, m: Generate | Stop | Series) -> None:
        if isinstance(m, Stop):
            self.stop.set()
        elif isinstance(m, Series):
            await self.send_series(m)
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
        try:
            worker.start()
            while (item := await queue.get()) is not None:
                if isinstance(item, bytes):
                    await self.ws.send_bytes(item)
                else:
                    await self.ws.send_json(item)
        except (WebSocketDisconnect, RuntimeError, OSError):  # the page went away
            self.stop.set()
        finally:
            await asyncio.to_thread(worker.join)
            self.app.generation_lock.release()


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
        self._polled = -POLL_S
        self._poll_lock = asyncio.Lock()

    async def refresh(self) -> int:
        """Read the followed capture if the last read is ``POLL_S`` old; the version."""
        async with self._poll_lock:
            if self.follower is not None and time.monotonic() - self._polled >= POLL_S:
                self._polled = time.monotonic()
                snap = await asyncio.to_thread(self.follower.poll)
                if snap is not None:
                    self.source = replace(self.source, manifest=snap.manifest,
                                          series=TrainingSeries.of(snap.stats))
                    self.version += 1
        return self.version

    def info(self) -> dict[str, Any]:
        live = self.live
        return {**self.source.info(), "allow_perturb": self.config.allow_perturb,
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
        hosts = ["*"] if any(h in ("0.0.0.0", "::") for h in self.config.hosts) else list(
            self.config.hosts)
        return Starlette(routes=routes,
                         middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=hosts)])


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, or a one-line error (a port in use, a bad host)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
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


def run_server(app: ViewApp, sock: socket.socket) -> None:
    import uvicorn

    config = uvicorn.Config(app.starlette(), log_level="warning", ws="websockets",
                            ws_max_size=MAX_FRAME_BYTES, lifespan="off")
    uvicorn.Server(config).run(sockets=[sock])
