"""A 2-rank CPU DDP job profiled exactly as docs/diagnose-your-job.md's how-to says:
the snippet is read from the page and run, unchanged, around an ordinary
training loop (``model``, ``loader``, ``loss_fn``, ``optimizer``).

    python tests/profile_howto_job.py OUT_DIR SNIPPET_FILE

Each rank runs in OUT_DIR, so the snippet's ``traces`` folder lands there.
Ranks meet through a file store on the local disk, gloo on 127.0.0.1.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

WORLD, HIDDEN, BATCH, STEPS = 2, 256, 64, 16


def _rank_main(rank: int, out: str, snippet: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(out, ".store"), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                                                  nn.Linear(HIDDEN, HIDDEN)))
    torch.manual_seed(1 + rank)
    loader = [torch.randn(BATCH, HIDDEN) for _ in range(STEPS)]
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    os.chdir(out)
    exec(compile(snippet, "docs/diagnose-your-job.md snippet", "exec"),  # the page's own code
         {"model": model, "loader": loader, "optimizer": optimizer,
          "loss_fn": lambda y: y.square().mean()})
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    out, snippet = argv[0], Path(argv[1]).read_text()
    os.makedirs(out, exist_ok=True)
    mp.spawn(_rank_main, args=(os.path.abspath(out), snippet), nprocs=WORLD, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
