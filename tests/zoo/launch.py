"""What every job of the zoo shares: its command line, N gloo ranks on
127.0.0.1, torch.profiler as users run it, and the two injected faults.

Nothing here (or anywhere in ``tests/zoo``) imports megatronapp: the zoo
stands for the ordinary PyTorch jobs users profile. A job module defines
``build(rank, opts) -> step`` and calls ``main(build, description)``; the
launcher runs ``step(i)`` once per iteration under the profiler and marks
each one with ``prof.step()``, so the trace holds ``ProfilerStep#N`` ranges.

Faults, both real (no sleep stands in for compute):

- ``--slow-rank R --factor F``: rank R's own matmuls are F times bigger
  (``grow`` adds (F-1)x rows of extra input to what it computes on);
- ``--slow-link A B --delay-ms D``: wherever the job has point-to-point
  between A and B, the receiver sleeps D ms before ``wait()`` (``receive``).
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import (ProfilerActivity, profile, record_function, schedule,
                            tensorboard_trace_handler)

# the profiler's schedule: one step skipped, one warm-up step, then the traced steps
WAIT_STEPS, WARMUP_STEPS = 1, 1

Step = Callable[[int], None]


@dataclass(frozen=True)
class Options:
    out: str
    world: int
    steps: int
    slow_rank: int
    factor: float
    slow_link: tuple[int, int] | None
    delay_ms: float
    record_shapes: bool
    annotate: bool
    profiler_steps: bool

    def scale(self, rank: int) -> float:
        return self.factor if rank == self.slow_rank else 1.0

    def link_delay_s(self, receiver: int, sender: int) -> float:
        slowed = self.slow_link is not None and {receiver, sender} == set(self.slow_link)
        return self.delay_ms / 1e3 if slowed else 0.0


def grow(x: torch.Tensor, rank: int, opts: Options) -> torch.Tensor:
    """``x`` with (F-1)x extra rows on the slowed rank: every matmul on it
    (forward and backward) is F times bigger; callers slice the first
    ``len(x)`` rows back out where shapes must match their peers'."""
    extra = round(x.shape[0] * (opts.scale(rank) - 1.0))
    if extra <= 0:
        return x
    return torch.cat([x, torch.randn(extra, *x.shape[1:])])


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
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--factor", type=float, default=1.0)
    parser.add_argument("--slow-link", type=int, nargs=2, metavar=("A", "B"))
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--record-shapes", action="store_true")
    parser.add_argument("--annotate", action="store_true",
                        help="record_function ranges around the job's phases")
    parser.add_argument("--no-profiler-steps", dest="profiler_steps", action="store_false",
                        help="profile every step without a schedule or prof.step(), "
                             "so the trace has no ProfilerStep#N ranges")
    args = parser.parse_args(argv)
    link = tuple(args.slow_link) if args.slow_link else None
    return Options(args.out, args.world, args.steps, args.slow_rank, args.factor, link,
                   args.delay_ms, args.record_shapes, args.annotate, args.profiler_steps)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_main(rank: int, build: Callable[[int, Options], Step], port: int,
               opts: Options) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=opts.world)
    step = build(rank, opts)
    untraced = WAIT_STEPS + WARMUP_STEPS
    first_profiled = 0 if opts.profiler_steps else untraced
    for i in range(first_profiled):  # without a schedule: the same warm-up, unprofiled
        step(i)
    plan = schedule(wait=WAIT_STEPS, warmup=WARMUP_STEPS, active=opts.steps, repeat=1)
    with profile(activities=[ProfilerActivity.CPU],
                 schedule=plan if opts.profiler_steps else None,
                 record_shapes=opts.record_shapes,
                 on_trace_ready=tensorboard_trace_handler(opts.out)) as prof:
        for i in range(first_profiled, untraced + opts.steps):
            step(i)
            if opts.profiler_steps:
                prof.step()
    dist.barrier()
    dist.destroy_process_group()


def main(build: Callable[[int, Options], Step], description: str,
         argv: list[str] | None = None) -> int:
    opts = parse_options(description, argv)
    os.makedirs(opts.out, exist_ok=True)
    # forked, not spawned: on a loaded 2-core machine importing torch again in
    # every rank costs more than the job itself
    mp.start_processes(_rank_main, args=(build, _free_port(), opts), nprocs=opts.world,
                       join=True, start_method="fork")
    return 0


if __name__ == "__main__":
    sys.exit("launch.py is imported by the zoo's jobs, not run")
