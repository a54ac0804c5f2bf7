"""A small real gloo job profiled with torch.profiler, one Kineto trace per rank.

Four processes: a 2-stage pipeline x 2 data-parallel replicas (rank = dp +
2·stage). Each iteration every stage runs its microbatches: stage 0
computes and sends activations to stage 1, which computes, and sends a
gradient back; then each stage all-reduces a gradient buffer over its
data-parallel pair. Compute is wrapped in ``record_function`` annotations
(``forward``/``backward``), as Megatron-LM's profiling does.

``--slow-rank R --factor F`` makes rank R do F times the work per op (the
same matmuls, repeated). Usage::

    python tests/kineto_job.py OUT_DIR [--slow-rank R] [--factor F] [--gzip]
"""
from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile, record_function

WORLD, STAGES, HIDDEN, BATCH, MICROBATCHES, ITERATIONS, MATMULS = 4, 2, 128, 32, 4, 3, 12


def _work(x: torch.Tensor, weight: torch.Tensor, repeats: int) -> torch.Tensor:
    for _ in range(repeats):
        y = torch.tanh(x @ weight)
    return y


def _rank_main(rank: int, port: int, out: str, slow_rank: int, factor: float, gzip: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    stage, dp = divmod(rank, WORLD // STAGES)
    peer = rank + 2 if stage == 0 else rank - 2
    dp_group = [dist.new_group([0, 1]), dist.new_group([2, 3])][stage]
    torch.manual_seed(rank)
    weight = torch.randn(HIDDEN, HIDDEN) / HIDDEN ** 0.5
    repeats = round(MATMULS * (factor if rank == slow_rank else 1.0))
    grad = torch.zeros(HIDDEN, HIDDEN)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(ITERATIONS):
            for _mb in range(MICROBATCHES):
                x = torch.randn(BATCH, HIDDEN)
                if stage == 1:
                    dist.recv(x, src=peer)
                with record_function("forward"):
                    y = _work(x, weight, repeats)
                if stage == 0:
                    dist.send(y, dst=peer)
                    dist.recv(y, src=peer)
                with record_function("backward"):
                    g = _work(y, weight.T, repeats)
                if stage == 1:
                    dist.send(g, dst=peer)
                grad += g.T @ x / MICROBATCHES
            dist.all_reduce(grad, group=dp_group)
            with record_function("optimizer"):
                weight -= 1e-3 * grad
    suffix = ".pt.trace.json.gz" if gzip else ".pt.trace.json"
    prof.export_chrome_trace(os.path.join(out, f"rank{rank}{suffix}"))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--factor", type=float, default=1.0)
    parser.add_argument("--gzip", action="store_true")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    mp.spawn(_rank_main, args=(_free_port(), args.out, args.slow_rank, args.factor, args.gzip),
             nprocs=WORLD, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
