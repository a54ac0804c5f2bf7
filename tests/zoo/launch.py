"""What every job of the zoo shares: its command line, N gloo ranks on
127.0.0.1, torch.profiler as users run it, and the injected faults.

Nothing here (or anywhere in ``tests/zoo``) imports megatronapp: the zoo
stands for the ordinary PyTorch jobs users profile. A job module defines
``build(rank, opts) -> step`` and calls ``main(build, description)``; the
launcher runs ``step(i)`` once per iteration under the profiler and marks
each one with ``prof.step()``, so the trace holds ``ProfilerStep#N`` ranges.

Faults, all real (no sleep stands in for compute), each on one rank or
several at once (several ranks after the option):

- ``--slow-rank R [R ...] --factor F``: rank R's own matmuls are F times
  bigger (``grow`` adds (F-1)x rows of extra input to what it computes on);
- ``--slow-link A B --delay-ms D``: wherever the job has point-to-point
  between A and B, the receiver sleeps D ms before ``wait()`` (``receive``);
- ``--extra-rank R --extra-factor F``: rank R calls each of its matmuls,
  convolutions and attentions F times, same shapes (``injection.ExtraCalls``);
- ``--loader-rank R --loader-ms D``: rank R's data loader spends D ms in
  CPU-bound Python reading each batch, before the step's forward (a job
  without a data loader of its own gets one that the launcher reads before
  each step, on every rank);
- ``--step-stall-rank R --step-stall-ms D``: rank R blocks D ms (sleeps)
  before each ``optimizer.step()`` (a job without an optimizer is untouched);
- ``--noisy-rank R``: a thread in rank R's process burns CPU (Python and
  torch) while it trains;
- ``--shaped-link S D --link-mbit M`` (repeatable): the kernel passes what
  rank S sends rank D at M Mbit/s (``shaping``; needs root); the job runs in
  a network namespace of its own, as ``--private-network`` runs any job.

``--every K`` makes every fault of the run intermittent: it acts only in the
steps i (0-based, ``ProfilerStep#i``) with ``i % K == K - 1``.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import (ProfilerActivity, profile, record_function, schedule,
                            tensorboard_trace_handler)
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

import shaping
from injection import (Clock, ExtraCalls, NoisyNeighbour, StalledDataset, forever,
                       stall_before_optimizer_step)

# the profiler's schedule: one step skipped, one warm-up step, then the traced steps
WAIT_STEPS, WARMUP_STEPS = 1, 1
UNSHAPED_MBIT = 100_000.0  # a shaped link's rate in the steps an intermittent fault spares

Step = Callable[[int], None]
Link = tuple[int, int]


@dataclass(frozen=True)
class Options:
    out: str
    world: int
    steps: int
    slow_ranks: tuple[int, ...]
    factor: float
    slow_link: Link | None
    delay_ms: float
    record_shapes: bool
    annotate: bool
    profiler_steps: bool
    extra_ranks: tuple[int, ...] = ()
    extra_factor: float = 1.0
    loader_ranks: tuple[int, ...] = ()
    loader_ms: float = 0.0
    step_stall_ranks: tuple[int, ...] = ()
    step_stall_ms: float = 0.0
    noisy_ranks: tuple[int, ...] = ()
    shaped_links: tuple[Link, ...] = ()
    link_mbit: float = 0.0
    every: int = 1
    gzip: bool = False
    private_network: bool = False
    # the step this process is in (each forked rank has its own copy)
    clock: Clock = field(default_factory=Clock)

    def scale(self, rank: int) -> float:
        return self.factor if rank in self.slow_ranks and self.clock.hit() else 1.0

    def link_delay_s(self, receiver: int, sender: int) -> float:
        slowed = self.slow_link is not None and {receiver, sender} == set(self.slow_link)
        return self.delay_ms / 1e3 if slowed and self.clock.hit() else 0.0


def grow(x: torch.Tensor, rank: int, opts: Options) -> torch.Tensor:
    """``x`` with (F-1)x extra rows on the slowed rank: every matmul on it
    (forward and backward) is F times bigger; callers slice the first
    ``len(x)`` rows back out where shapes must match their peers'."""
    extra = round(x.shape[0] * (opts.scale(rank) - 1.0))
    if extra <= 0:
        return x
    return torch.cat([x, torch.randn(extra, *x.shape[1:])])


def stalled(dataset: Dataset[Any], rank: int, opts: Options, batch_size: int) -> Dataset[Any]:
    """The dataset a job's data loader reads: on a rank with a slow loader,
    each item costs its share of ``--loader-ms`` per batch in Python."""
    if rank not in opts.loader_ranks:
        return dataset
    return StalledDataset(dataset, opts.loader_ms / batch_size, opts.clock)


class Rows(TensorDataset):
    """A ``TensorDataset`` a ``DataLoader`` reads a batch at a time
    (``__getitems__``: one indexing per tensor, not one per sample)."""

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        return tuple(t[indices] for t in self.tensors)


def as_read(batch: Any) -> Any:
    """The collate function of a dataset that reads whole batches."""
    return batch


def batches(dataset: Rows, rank: int, opts: Options, batch_size: int,
            replicas: int | None = None, replica: int | None = None) -> Iterator[Any]:
    """A ``DataLoader``'s batches, epoch after epoch, as users read data:
    in process, each data-parallel replica its ``DistributedSampler`` share
    (``replicas`` / ``replica``: the world and the rank unless given)."""
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=replicas or opts.world,
        rank=rank if replica is None else replica, seed=0)
    return forever(DataLoader(stalled(dataset, rank, opts, batch_size), batch_size=batch_size,
                              sampler=sampler, drop_last=True, collate_fn=as_read))


def annotated(opts: Options, name: str) -> AbstractContextManager[object]:
    """A ``record_function`` range where the job is run with ``--annotate``."""
    return record_function(name) if opts.annotate else nullcontext()


def train_step(loss: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer,
               opts: Options) -> None:
    """One ordinary training step: forward (``loss()``), backward, optimizer."""
    with annotated(opts, "forward"):
        value = loss()
    with annotated(opts, "backward"):
        value.backward()
    with annotated(opts, "optimizer"):
        optimizer.step()
        optimizer.zero_grad()


def random_batch_training(model: torch.nn.Module, shape: tuple[int, int], rank: int,
                          opts: Options) -> Step:
    """Training steps of ``model`` on random batches of ``shape`` (mean-square
    loss, SGD); the slowed rank's batches are ``grow``-n."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def loss() -> torch.Tensor:
        return model(grow(torch.randn(*shape), rank, opts)).square().mean()
    return lambda _: train_step(loss, optimizer, opts)


def average_gradients(parameters: Iterable[torch.nn.Parameter],
                      group: dist.ProcessGroup | None = None) -> None:
    """All-reduce each gradient over ``group`` and divide by its size, as
    the "Writing Distributed Applications" tutorial does by hand."""
    size = dist.get_world_size(group)
    for p in parameters:
        assert p.grad is not None
        dist.all_reduce(p.grad, group=group)
        p.grad /= size


def receive(tensor: torch.Tensor, src: int, opts: Options) -> torch.Tensor:
    """Receive into ``tensor`` from ``src`` with ``irecv``; on a slowed link
    the receiver sleeps before ``wait()``."""
    work = dist.irecv(tensor, src=src)
    assert work is not None  # None only for a rank outside the group
    delay = opts.link_delay_s(dist.get_rank(), src)
    if delay:
        time.sleep(delay)
    work.wait()
    return tensor


def send(tensor: torch.Tensor, dst: int) -> dist.Work:
    """``isend``; the caller waits on the returned work."""
    work = dist.isend(tensor, dst)
    assert work is not None  # None only for a rank outside the group
    return work


def parse_options(description: str, argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", required=True, help="directory for one trace JSON per rank")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6, help="traced iterations")
    parser.add_argument("--slow-rank", type=int, nargs="+", default=[],
                        help="ranks whose matmuls are --factor times bigger")
    parser.add_argument("--factor", type=float, default=1.0)
    parser.add_argument("--slow-link", type=int, nargs=2, metavar=("A", "B"))
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--extra-rank", type=int, nargs="+", default=[],
                        help="ranks that call each matmul/convolution --extra-factor times")
    parser.add_argument("--extra-factor", type=float, default=1.0)
    parser.add_argument("--loader-rank", type=int, nargs="+", default=[],
                        help="ranks whose data loader spends --loader-ms of Python per batch")
    parser.add_argument("--loader-ms", type=float, default=0.0)
    parser.add_argument("--step-stall-rank", type=int, nargs="+", default=[],
                        help="ranks that block --step-stall-ms before each optimizer step")
    parser.add_argument("--step-stall-ms", type=float, default=0.0)
    parser.add_argument("--noisy-rank", type=int, nargs="+", default=[],
                        help="ranks with a CPU-burning thread beside their training")
    parser.add_argument("--shaped-link", type=int, nargs=2, action="append", default=[],
                        metavar=("SENDER", "RECEIVER"),
                        help="a channel the kernel passes at --link-mbit (repeatable; root)")
    parser.add_argument("--link-mbit", type=float, default=100.0)
    parser.add_argument("--private-network", action="store_true",
                        help="run in a network namespace of its own, as shaped links do "
                             "(so that healthy runs match shaped ones; root)")
    parser.add_argument("--every", type=int, default=1,
                        help="faults act only in the steps i with i %% K == K-1")
    parser.add_argument("--record-shapes", action="store_true")
    parser.add_argument("--gzip", action="store_true", help="write the traces gzipped")
    parser.add_argument("--annotate", action="store_true",
                        help="record_function ranges around the job's phases")
    parser.add_argument("--no-profiler-steps", dest="profiler_steps", action="store_false",
                        help="profile every step without a schedule or prof.step(), "
                             "so the trace has no ProfilerStep#N ranges")
    args = parser.parse_args(argv)
    if args.every < 1:
        parser.error("--every: must be at least 1")
    link = tuple(args.slow_link) if args.slow_link else None
    return Options(args.out, args.world, args.steps, tuple(args.slow_rank), args.factor, link,
                   args.delay_ms, args.record_shapes, args.annotate, args.profiler_steps,
                   tuple(args.extra_rank), args.extra_factor, tuple(args.loader_rank),
                   args.loader_ms, tuple(args.step_stall_rank), args.step_stall_ms,
                   tuple(args.noisy_rank), tuple(map(tuple, args.shaped_link)), args.link_mbit,
                   args.every, args.gzip, args.private_network, Clock(args.every))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launcher_loader(rank: int, opts: Options) -> Iterator[Any] | None:
    """For a job without a data loader of its own, run with a slow loader:
    a small one the launcher reads before each step, on every rank."""
    if not opts.loader_ranks:
        return None
    return batches(Rows(torch.randn(128, 16)), rank, opts, batch_size=8)


def injected(rank: int, opts: Options, stack: ExitStack) -> None:
    """Enter the faults that live inside rank ``rank``'s process."""
    if rank in opts.extra_ranks:
        stack.enter_context(ExtraCalls(opts.extra_factor, opts.clock))
    if rank in opts.step_stall_ranks:
        stack.callback(stall_before_optimizer_step(opts.step_stall_ms / 1e3, opts.clock).remove)
    if rank in opts.noisy_ranks:
        neighbour = NoisyNeighbour(opts.clock)
        neighbour.start()
        stack.callback(neighbour.stop.set)


def shape_links(rank: int, store_port: int, opts: Options) -> shaping.RateSwitch | None:
    """Once every process group is connected, put each shaped channel's
    connections into its class (rank 0 runs ``tc`` for all)."""
    if not opts.shaped_links:
        return None
    connections: list[list[shaping.Connection]] = [[] for _ in range(opts.world)]
    dist.all_gather_object(connections, shaping.own_connections(exclude_port=store_port))
    switch = None
    if rank == 0:
        classes = [shaping.channel_class(i) for i in range(len(opts.shaped_links))]
        for classid, (sender, receiver) in zip(classes, opts.shaped_links):
            ports = shaping.channel_ports(connections[sender], connections[receiver])
            if not shaping.filter_into(classid, ports):
                raise shaping.ShapingUnavailable(f"no connection from {sender} to {receiver}")
        if opts.every > 1:
            switch = shaping.RateSwitch(classes, opts.link_mbit, UNSHAPED_MBIT)
    dist.barrier()
    return switch


def _rank_main(rank: int, build: Callable[[int, Options], Step], port: int,
               opts: Options, own_loader: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=opts.world)
    step = build(rank, opts)
    switch = shape_links(rank, port, opts)
    loader = None if own_loader else launcher_loader(rank, opts)
    untraced = WAIT_STEPS + WARMUP_STEPS
    first_profiled = 0 if opts.profiler_steps else untraced

    def run(i: int) -> None:
        opts.clock.step = i
        if switch:
            switch.set(opts.clock.hit())
        if loader:
            next(loader)
        step(i)
    with ExitStack() as stack:
        injected(rank, opts, stack)
        for i in range(first_profiled):  # without a schedule: the same warm-up, unprofiled
            run(i)
        plan = schedule(wait=WAIT_STEPS, warmup=WARMUP_STEPS, active=opts.steps, repeat=1)
        with profile(activities=[ProfilerActivity.CPU],
                     schedule=plan if opts.profiler_steps else None,
                     record_shapes=opts.record_shapes,
                     on_trace_ready=tensorboard_trace_handler(opts.out,
                                                              use_gzip=opts.gzip)) as prof:
            for i in range(first_profiled, untraced + opts.steps):
                run(i)
                if opts.profiler_steps:
                    prof.step()
    dist.barrier()
    dist.destroy_process_group()


def enter_shaped_network(opts: Options) -> None:
    """A network namespace of the job's own with one class per shaped link
    (if any); gloo's device on its loopback."""
    shaping.enter_private_network()
    for index, _ in enumerate(opts.shaped_links):
        shaping.add_channel_class(index, opts.link_mbit)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"


def main(build: Callable[[int, Options], Step], description: str,
         argv: list[str] | None = None, own_loader: bool = False) -> int:
    """Run the job; ``own_loader``: it reads its data through a
    ``DataLoader`` over ``stalled(...)`` (so ``--loader-rank`` slows that)."""
    opts = parse_options(description, argv)
    if opts.shaped_links or opts.private_network:
        try:
            enter_shaped_network(opts)
        except shaping.ShapingUnavailable as error:
            option = "--shaped-link" if opts.shaped_links else "--private-network"
            print(f"{option}: {error}", file=sys.stderr)
            return 2
    os.makedirs(opts.out, exist_ok=True)
    # forked, not spawned: on a loaded 2-core machine importing torch again in
    # every rank costs more than the job itself
    mp.start_processes(_rank_main, args=(build, _free_port(), opts, own_loader),
                       nprocs=opts.world, join=True, start_method="fork")
    return 0


if __name__ == "__main__":
    sys.exit("launch.py is imported by the zoo's jobs, not run")
