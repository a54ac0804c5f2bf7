"""The model object split over pipeline stages and tensor-parallel ranks: one
worker process per rank, kept while the model is open.

The workers (``python -m backends.torch.scope_pool``: nothing of the caller's
script is imported again) each listen on a Unix socket with a random key,
form a gloo group through a file store (nothing listens on the network) and
each build its stage of the checkpoint's model. A forward pass is a command to
every worker; the stages pass activations stage to stage; at a hooked point
the TP ranks of the stage that holds it join their heads or channels, TP rank
0 sends the whole tensor to the caller, whose hook functions run there, and
what they return is cut back to each rank's slice. The last stage's TP rank 0
sends the logits (its TP ranks' vocabulary slices joined).

A worker that fails or dies ends every worker; the model must be loaded again.
"""
from __future__ import annotations

import json
import os
import pickle
import secrets
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener, wait
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from megatronapp.errors import UserError
from megatronapp.io import gate
from megatronapp.io.outdirs import discard, own_folder
from megatronapp.io.progress import Say
from megatronapp.io.text import TextError
from megatronapp.scenario.checkpoint import Checkpoint, read_checkpoint
from megatronapp.scenario.config import Scenario, ScenarioError, parse_scenario
from megatronapp.scope.names import TP_SPLIT, site_of

from .scope_points import Visit, attached

Tensor = torch.Tensor
EXIT_WAIT_S = 10.0
ACCEPT_WAIT_S = 300.0  # workers import torch and megatron-core before they listen
POLL_S = 0.05
LOG_BYTES = 16 << 20  # a rank's log read back for its last line


class PoolFailed(UserError):
    """A worker failed or died: one line; the model's processes are gone."""


def split_scenario(ckpt: Checkpoint, pp: int, tp: int) -> Scenario:
    """The checkpoint's model split ``pp`` × ``tp`` (checked like a scenario's
    ``parallel:``, named by the options that set it)."""
    try:
        s = parse_scenario({"seed": 0, "model": ckpt.model.model_dump(mode="json"),
                            "data": {"kind": "random"},
                            "parallel": {"tp": tp, "pp": pp, "dp": 1, "microbatches": 1}})
    except ScenarioError as err:
        raise UserError(f"--pp/--tp: {err}") from None
    if s.model.vocab % tp:
        raise UserError(f"--tp: the vocabulary ({s.model.vocab}) does not split over {tp} ranks")
    return s


def _send(conn: Connection, obj: Any) -> None:
    """Plain pickle (tensors by value): multiprocessing's own pickler would
    share tensors through a helper process that only its own children may
    reach."""
    conn.send_bytes(pickle.dumps(obj))


def _received(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())  # from our own workers, over an authenticated socket


# ------------------------------------------------------------------ caller
@dataclass
class PoolRunner:
    conns: list[Connection]
    procs: list[subprocess.Popen]
    workdir: Path  # private (0700), marked as ours, discarded when the pool stops
    warnings: list[str] = field(default_factory=list)
    stop: Any = None

    @classmethod
    def start(cls, ckpt: Checkpoint, pp: int, tp: int, say: Say) -> "PoolRunner":
        split_scenario(ckpt, pp, tp)  # refused here, before any process starts
        world = pp * tp
        workdir = own_folder(Path(tempfile.mkdtemp(prefix="megascope-")))
        key = secrets.token_bytes(32)
        say(f"starting {world} processes (pp {pp} × tp {tp}) for {ckpt.path}")
        procs = [_spawn(rank, world, pp, tp, ckpt.path, key, workdir)
                 for rank in range(world)]
        pool = cls([], procs, workdir)
        pool.stop = weakref.finalize(pool, _stop_all, procs, pool.conns, workdir)
        try:
            pool._connect(key)
        except BaseException:
            pool.close()
            raise
        return pool

    def _connect(self, key: bytes) -> None:
        """Each worker listens on its own socket in the work directory, once it
        has imported what it needs; connect to each, then wait for its stage."""
        deadline = time.monotonic() + ACCEPT_WAIT_S
        for rank, proc in enumerate(self.procs):
            address = str(self.workdir / f"rank{rank}.socket")
            while True:
                try:
                    self.conns.append(Client(address, family="AF_UNIX", authkey=key))
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise PoolFailed(self._died("did not start")) from None
                    time.sleep(POLL_S)
        for rank, conn in enumerate(self.conns):
            kind, payload = self._recv(rank, conn)
            if kind != "ready":
                raise PoolFailed(f"rank {rank} could not build its stage: {payload}")
            self.warnings += payload

    def _died(self, what: str) -> str:
        dead = [(r, p.returncode) for r, p in enumerate(self.procs) if p.poll() is not None]
        tail = _last_line(self.workdir / "rank0.log")
        return (f"the model's processes {what}" + (f" (rank {dead[0][0]} exited with "
                                                   f"{dead[0][1]})" if dead else "")
                + (f": {tail[0]}" if tail else ""))

    def _recv(self, rank: int, conn: Connection) -> tuple[Any, ...]:
        try:
            msg: tuple[Any, ...] = _received(conn)
        except (EOFError, OSError):
            self.close()
            raise PoolFailed(self._died(f"stopped: rank {rank} is gone; load the model "
                                        "again")) from None
        return msg

    def forward(self, tokens: Tensor, names: Sequence[str], visit: Visit) -> Tensor:
        if self.stop is None or not self.stop.alive:
            raise PoolFailed("the model is closed; load it again")
        for conn in self.conns:
            _send(conn, ("forward", tokens, list(names)))
        logits, failure = None, None
        pending = dict(enumerate(self.conns))
        try:
            while pending:
                for ready in wait(list(pending.values())):
                    rank = next(r for r, c in pending.items() if c is ready)
                    conn = pending[rank]
                    kind, *payload = self._recv(rank, conn)
                    if kind == "visit":
                        result = None
                        if failure is None:
                            try:
                                result = visit(*payload)
                            except BaseException as err:  # re-raised once the pass is over
                                failure = err
                        _send(conn, result)
                    elif kind == "done":
                        pending.pop(rank)
                        logits = payload[0] if payload[0] is not None else logits
                    else:
                        raise PoolFailed(f"rank {rank} failed: {payload[0]}; load the model "
                                         "again")
        except BaseException:
            self.close()  # ranks may be left waiting on each other
            raise
        if failure is not None:
            raise failure
        assert logits is not None
        return logits

    def close(self) -> None:
        if self.stop is not None:
            self.stop()


def _spawn(rank: int, world: int, pp: int, tp: int, checkpoint: Path, key: bytes,
           workdir: Path) -> subprocess.Popen:
    root = str(Path(__file__).resolve().parents[2])  # where ``backends`` is imported from
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])]),
        "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    log = open(workdir / f"rank{rank}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "backends.torch.scope_pool"], env=env,
                            stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                            text=True)
    log.close()
    assert proc.stdin is not None
    proc.stdin.write(json.dumps({"rank": rank, "world": world, "pp": pp, "tp": tp,
                                 "checkpoint": str(checkpoint),
                                 "address": str(workdir / f"rank{rank}.socket"),
                                 "key": key.hex(), "store": str(workdir / "store"),
                                 "parent": os.getpid()}) + "\n")
    proc.stdin.close()
    return proc


def _last_line(log: Path) -> list[str]:
    """The last line rank 0 logged (what it died of), if it logged anything readable."""
    try:
        return gate.read_text(log, "rank 0's log", LOG_BYTES).strip().splitlines()[-1:]
    except TextError:  # not there, too long or not text: the exit status alone is said
        return []


def _stop_all(procs: list[subprocess.Popen], conns: list[Connection],
              workdir: Path) -> None:
    for conn in conns:
        try:
            _send(conn, ("close",))
            conn.close()
        except OSError:
            pass
    for p in procs:
        try:
            p.wait(timeout=EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    discard(workdir)


# ------------------------------------------------------------------ worker
@dataclass
class Stage:
    """This worker's stage (and TP slice) of the model."""

    model: Any
    s: Scenario
    rank: int
    conn: Connection

    def __post_init__(self) -> None:
        from megatron.core import parallel_state as ps

        from megatronapp.program.layout import topology_of

        self.topo = topology_of(self.s)
        self.coord = self.topo.coord(self.rank)
        self.tp_group, self.tp_src = (ps.get_tensor_model_parallel_group(),
                                      ps.get_tensor_model_parallel_src_rank())
        self.head_dim = self.s.model.hidden // self.s.model.heads

    @property
    def first(self) -> bool:
        return self.coord.pp == 0

    @property
    def last(self) -> bool:
        return self.coord.pp == self.topo.pp - 1

    def _gathered(self, local: Tensor, axis: int) -> Tensor:
        parts = [torch.empty_like(local) for _ in range(self.topo.tp)]
        dist.all_gather(parts, local.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=axis)

    def visit(self, name: str, local: Tensor) -> Tensor | None:
        """The whole tensor to the caller (from TP rank 0); its answer, cut to ours."""
        split = TP_SPLIT.get(site_of(name)[0]) if self.topo.tp > 1 else None
        whole = self._gathered(local, split[1]) if split else local
        answer = None
        if self.coord.tp == 0:
            _send(self.conn, ("visit", name, whole))
            answer = _received(self.conn)
        if self.topo.tp > 1:
            box = [answer]
            dist.broadcast_object_list(box, src=self.tp_src, group=self.tp_group)
            answer = box[0]
        if answer is None or split is None:
            return answer
        return answer.chunk(self.topo.tp, dim=split[1])[self.coord.tp]

    def forward(self, tokens: Tensor, names: Sequence[str]) -> Tensor | None:
        from .megatron_compat import causal_mask

        b, s = tokens.shape
        if not self.first:
            received = torch.empty(s, b, self.s.model.hidden)
            dist.recv(received, src=self.topo.rank(0, self.coord.pp - 1, self.coord.tp))
            self.model.set_input_tensor(received)
        with attached(self.model, names, self.visit, self.head_dim), torch.no_grad():
            out = self.model(tokens, torch.arange(s).expand(b, s), causal_mask(s))
        if not self.last:
            dist.send(out.contiguous(), dst=self.topo.rank(0, self.coord.pp + 1, self.coord.tp))
            return None
        logits = self._gathered(out, -1) if self.topo.tp > 1 else out
        return logits if self.coord.tp == 0 else None


def _build(spec: dict[str, Any], conn: Connection) -> Stage:
    from megatronapp.scope.quiet import kept_warnings

    from .stages import MegatronStages, TrainOptions
    from .worker import init_megatron

    kept: list[str] = []
    with kept_warnings(kept):
        ckpt = read_checkpoint(spec["checkpoint"])
        s = split_scenario(ckpt, spec["pp"], spec["tp"])
        store = dist.FileStore(spec["store"], spec["world"])
        dist.init_process_group("gloo", store=store, rank=spec["rank"],
                                world_size=spec["world"])
        init_megatron(s)
        stages = MegatronStages(s, spec["rank"], torch.device("cpu"),
                                TrainOptions(initial_state=ckpt.state))
    _send(conn, ("ready", kept if spec["rank"] == 0 else []))
    return Stage(stages.models[0].eval(), s, spec["rank"], conn)


def worker_main() -> int:
    """One rank: build its stage, then run forward passes until told to close
    (or until the caller is gone); its exit status."""
    from .lifetime import die_with_parent

    spec = json.loads(sys.stdin.readline())
    die_with_parent(spec["parent"])
    torch.set_num_threads(1)
    with Listener(spec["address"], family="AF_UNIX",
                  authkey=bytes.fromhex(spec["key"])) as listener:
        conn = listener.accept()
    status = 0
    try:
        stage = _build(spec, conn)
        while (msg := _received(conn))[0] == "forward":
            _send(conn, ("done", stage.forward(msg[1], msg[2])))
    except EOFError:
        pass  # the caller is gone
    except BaseException as err:
        _send(conn, ("error", f"{type(err).__name__}: {err}"))
        status = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return status


if __name__ == "__main__":
    code = worker_main()
    sys.stdout.flush()
    os._exit(code)  # skips the interpreter's teardown (seconds, on a busy machine)
