"""A decoupled training run on torch.distributed, and its co-located reference.

The stages are small float64 MLPs (tanh layers, MSE loss on the last stage)
so that the decoupled step can be compared with the co-located one exactly:
same initial weights, same data, same SGD step. ``run_decoupled`` spawns one
gloo process per device of an ``FbdLayout`` (tp = 1); ``colocated_reference``
trains the same model in one process with ordinary forward + backward.
"""
from __future__ import annotations

import os
import resource
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatronapp.costs import StageCosts
from megatronapp.fbd.ranks import FbdLayout, collective_groups
from megatronapp.fbd.workers import worker_programs
from megatronapp.seeds import torch_seed
from megatronapp.topology import Topology
from megatronapp.tracer import Event, Tracer

from .fbd import DeviceRuntime, coordinator_table
from .launch import TorchRunError, free_port


@dataclass(frozen=True)
class MlpSpec:
    hidden: int = 8
    layers_per_stage: int = 2
    pp: int = 2
    dp: int = 2
    microbatches: int = 3
    batch: int = 4  # samples per microbatch
    iterations: int = 2
    lr: float = 0.05
    seed: int = 0

    @property
    def topo(self) -> Topology:
        return Topology(tp=1, pp=self.pp, dp=self.dp)


def build_stage(spec: MlpSpec, pp_rank: int) -> torch.nn.Sequential:
    torch.manual_seed(torch_seed(spec.seed * 1000 + pp_rank))
    layers: list[torch.nn.Module] = []
    for _ in range(spec.layers_per_stage):
        layers += [torch.nn.Linear(spec.hidden, spec.hidden, dtype=torch.float64), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def sample(spec: MlpSpec, iteration: int, dp: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and regression targets of one microbatch of one dp replica."""
    gen = torch.Generator().manual_seed(hash((spec.seed, iteration, dp, microbatch)) % 2**31)
    shape = (spec.batch, spec.hidden)
    return (torch.randn(shape, generator=gen, dtype=torch.float64),
            torch.randn(shape, generator=gen, dtype=torch.float64))


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@dataclass
class StageLog:
    losses: dict[int, dict[int, float]] = field(default_factory=dict)
    grads: dict[int, np.ndarray] = field(default_factory=dict)  # iteration -> flat dp-mean grads


class MlpDecoupledStage:
    """One virtual rank's stage behind the ``DecoupledStage`` protocol."""

    def __init__(self, spec: MlpSpec, vrank: int):
        self.spec = spec
        c = spec.topo.coord(vrank)
        self.pp_rank, self.dp_rank = c.pp, c.dp
        self.model = build_stage(spec, c.pp)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=spec.lr)
        self.log = StageLog()
        self.iteration = 0
        self._saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self._flat: torch.Tensor | None = None

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.spec.pp - 1

    def _data(self, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        return sample(self.spec, self.iteration, self.dp_rank, mb)

    def forward_no_grad(self, microbatch: int, x: Any) -> torch.Tensor:
        with torch.no_grad():
            return self.model(self._data(microbatch)[0] if self.is_first else x)

    def recompute(self, microbatch: int, x: Any) -> None:
        inp = None if self.is_first else x.detach().requires_grad_()
        data, target = self._data(microbatch)
        out = self.model(data if inp is None else inp)
        if self.is_last:
            loss = torch.nn.functional.mse_loss(out, target)
            self.log.losses.setdefault(self.iteration, {})[microbatch] = loss.item()
            out = loss / self.spec.microbatches
        self._saved[microbatch] = (inp, out)

    def backward(self, microbatch: int, grad: Any) -> torch.Tensor | None:
        inp, out = self._saved.pop(microbatch)
        torch.autograd.backward(out, grad_tensors=None if self.is_last else grad)
        return None if inp is None else inp.grad

    def grad_buffer(self) -> torch.Tensor:
        self._flat = torch.cat([p.grad.reshape(-1) for p in self.model.parameters()])
        return self._flat

    def optimizer_step(self) -> None:
        flat = self.grad_buffer() if self._flat is None else self._flat
        flat = flat / self.spec.dp
        offset = 0
        for p in self.model.parameters():
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.log.grads[self.iteration] = flat.numpy().copy()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        self._flat = None
        self.iteration += 1

    def weights(self) -> torch.Tensor:
        return flat_params(self.model)

    def load_weights(self, weights: torch.Tensor) -> None:
        torch.nn.utils.vector_to_parameters(weights, self.model.parameters())
        self.iteration += 1  # the forward worker's copy follows the backward one

    def recv_like(self, tag: Hashable) -> torch.Tensor:
        if isinstance(tag, tuple) and tag[0] == "weights":
            return flat_params(self.model)
        return torch.empty(self.spec.batch, self.spec.hidden, dtype=torch.float64)


NO_COSTS = StageCosts(0.0, 0.0, 0.0, 0.0, 0, 0, 0, 0, 0, None, None)


@dataclass(frozen=True)
class DeviceResult:
    device: int
    logs: dict[str, StageLog]  # "F3" / "B3" -> that worker's stage log
    rounds: int
    events: dict[int, list[Event]] = field(default_factory=dict)  # worker id -> events (traced)
    peak_rss_bytes: int = 0  # this process's peak resident memory


FaultsFor = Callable[[int], Any]  # device -> InjectedFaults (picklable: spawned processes)


def shared_origin_ns() -> int:
    """Rank 0's monotonic clock after a barrier: CLOCK_MONOTONIC is host-wide
    and the spawn launcher keeps every device process on one host."""
    dist.barrier()
    origin = [time.perf_counter_ns()]
    dist.broadcast_object_list(origin, src=0)
    return int(origin[0])


def run_device(spec: MlpSpec, layout: FbdLayout, device: int, encoding: str,
               faults_for: FaultsFor | None = None, trace: bool = False) -> DeviceResult:
    """This process's part; torch.distributed must be initialised."""
    table = coordinator_table(layout, collective_groups(layout))
    local = layout.workers_by_device[device]
    # Each worker gets its own copy of its stage: the forward copy is refreshed
    # by the weights the backward worker sends after every step.
    stages = {w: MlpDecoupledStage(spec, layout.worker(w).vrank) for w in local}
    origin = shared_origin_ns()

    def now() -> float:
        return (time.perf_counter_ns() - origin) * 1e-9

    tracers = {w: Tracer(w, now=now) for w in local} if trace else None
    runtime = DeviceRuntime(layout, device, table, lambda w, tag: stages[w].recv_like(tag),
                            encoding, tracers, faults_for(device) if faults_for else None,
                            now)  # type: ignore[arg-type]
    programs = {}
    for w in local:  # each worker's program over its own stage copy (generators are lazy)
        every = worker_programs(layout, NO_COSTS, spec.microbatches, spec.iterations,
                                lambda v, s=stages[w]: s)
        programs[w] = every[w]
    runtime.run(programs)
    events = {w: tr.events for w, tr in tracers.items()} if tracers else {}
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return DeviceResult(device, {str(layout.worker(w)): stages[w].log for w in local},
                        runtime.rounds, events, peak_rss)


def _spawned(device: int, spec: MlpSpec, layout: FbdLayout, port: int, encoding: str,
             out: Any, faults_for: FaultsFor | None = None, trace: bool = False) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=device, world_size=layout.num_devices)
        out.put(("done", device, run_device(spec, layout, device, encoding, faults_for, trace)))
    except BaseException:
        out.put(("error", device, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_decoupled(spec: MlpSpec, layout: FbdLayout, encoding: str = "bits",
                  timeout_s: float = 120.0, faults_for: FaultsFor | None = None,
                  trace: bool = False) -> list[DeviceResult]:
    """Spawn one process per device and gather their results (``trace``: with
    every worker's events; ``faults_for``: injected faults per device)."""
    if layout.topo != spec.topo:
        raise ValueError("layout and spec disagree on the virtual topology")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_spawned,
                         args=(d, spec, layout, port, encoding, out, faults_for, trace))
             for d in range(layout.num_devices)]
    for p in procs:
        p.start()
    results: dict[int, DeviceResult] = {}
    try:
        while len(results) < len(procs):
            kind, device, payload = out.get(timeout=timeout_s)
            if kind == "error":
                raise TorchRunError(f"device {device} failed:\n{payload}")
            results[device] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join()
    return [results[d] for d in sorted(results)]


def colocated_reference(spec: MlpSpec) -> tuple[dict[int, dict[int, dict[int, float]]],
                                                dict[int, dict[int, np.ndarray]]]:
    """Ordinary training in one process: (iteration -> dp -> mb -> loss,
    iteration -> pp rank -> flat dp-mean gradient)."""
    stages = [build_stage(spec, r) for r in range(spec.pp)]
    params = [p for st in stages for p in st.parameters()]
    optimizer = torch.optim.SGD(params, lr=spec.lr)
    losses: dict[int, dict[int, dict[int, float]]] = {}
    grads: dict[int, dict[int, np.ndarray]] = {}
    for it in range(spec.iterations):
        optimizer.zero_grad(set_to_none=False)
        for dp in range(spec.dp):
            for mb in range(spec.microbatches):
                x, target = sample(spec, it, dp, mb)
                for st in stages:
                    x = st(x)
                loss = torch.nn.functional.mse_loss(x, target)
                losses.setdefault(it, {}).setdefault(dp, {})[mb] = loss.item()
                (loss / spec.microbatches / spec.dp).backward()
        grads[it] = {r: torch.cat([p.grad.reshape(-1) for p in st.parameters()]).numpy().copy()
                     for r, st in enumerate(stages)}
        optimizer.step()
    return losses, grads
