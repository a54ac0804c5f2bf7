"""An ordinary one-GPU NCCL job profiled with torch.profiler (CPU and CUDA).

One process (NCCL, world size 1: the lent GPU machines have one GPU and
NCCL refuses two ranks on one device). Each profiled step runs a
``forward`` matmul chain, all-reduces a gradient buffer on the default group
and again on a one-rank subgroup, then an ``optimizer`` update: the shape of
a data-parallel step, with every collective a real NCCL launch. It writes
``OUT_DIR/rank0.pt.trace.json.gz``, the trace kept under
``tests/data/gpu_kineto/nccl_loop/``. Usage (needs a CUDA GPU)::

    python tests/kineto_nccl_job.py OUT_DIR
"""
from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function, schedule

HIDDEN, BATCH, MATMULS, STEPS = 1024, 256, 8, 5


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    sub = dist.new_group([0])
    torch.manual_seed(0)
    weight = torch.randn(HIDDEN, HIDDEN, device="cuda") / HIDDEN ** 0.5
    grad = torch.zeros_like(weight)
    steps = schedule(wait=1, warmup=1, active=STEPS)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=steps) as prof:
        for _ in range(STEPS + 2):
            x = torch.randn(BATCH, HIDDEN, device="cuda")
            with record_function("forward"):
                for _ in range(MATMULS):
                    x = torch.tanh(x @ weight)
            grad.copy_(x.T @ x / BATCH)
            dist.all_reduce(grad)
            dist.all_reduce(grad, group=sub)
            with record_function("optimizer"):
                weight -= 1e-3 * grad
            prof.step()
    torch.cuda.synchronize()
    os.makedirs(out, exist_ok=True)
    prof.export_chrome_trace(os.path.join(out, "rank0.pt.trace.json.gz"))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    run(parser.parse_args(argv).out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
