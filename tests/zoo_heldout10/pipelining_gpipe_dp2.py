"""Pipeline and data parallelism together with ``torch.distributed.pipelining``,
as its documentation combines them on a two-dimensional ``DeviceMesh``: two
pipeline stages times two data-parallel replicas (mesh dimensions ``dp``
and ``pp``: rank = 2 x replica + stage, so ranks 0 -> 1 and 2 -> 3 are the
two pipelines). Each stage is a pre-norm feed-forward block (as in a
Transformer: LayerNorm, a linear layer four times wider, GELU, a linear
layer back, the residual); the first stage also projects the input
features, the last normalises and classifies them (cross-entropy).
``ScheduleGPipe`` runs all four microbatches forward, then all backward,
on the mesh's ``pp`` process group; the schedule does the point-to-point
itself (``batch_isend_irecv``): activations from stage 0 to stage 1 of
each replica, their gradients back. Then each stage averages its
gradients with the same stage of the other replica (``all_reduce`` on the
mesh's ``dp`` process group) and steps AdamW (fused). Both stages of a
replica read the same batches, the replica's share (a DataLoader with a
DistributedSampler): the first stage uses the features, the last the
labels.

    PYTHONPATH=tests/zoo python tests/zoo_heldout10/pipelining_gpipe_dp2.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from launch import Options, Rows, Step, average_gradients, batches, grow, main
from job_parts import clustered_samples

FEATURES, CLASSES, WIDTH = 64, 16, 256
REPLICAS, STAGES = 2, 2
BATCH, MICROBATCHES, SAMPLES = 256, 4, 8192
# floats in one message: a microbatch's activations (or their gradients)
MESSAGE = BATCH // MICROBATCHES * WIDTH


class Block(nn.Module):
    """A pre-norm feed-forward block; on the slowed rank it runs on extra samples."""

    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                 nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(grow(x, self.rank, self.opts)))[:len(x)]


class Stage(nn.Module):
    def __init__(self, stage: int, rank: int, opts: Options) -> None:
        super().__init__()
        self.inputs = nn.Linear(FEATURES, WIDTH) if stage == 0 else None
        self.block = Block(rank, opts)
        self.classifier = (nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, CLASSES))
                           if stage == STAGES - 1 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inputs is not None:
            x = self.inputs(x)
        x = self.block(x)
        return x if self.classifier is None else self.classifier(x)


def samples() -> Rows:
    return clustered_samples(CLASSES, SAMPLES, FEATURES)


def build(rank: int, opts: Options) -> Step:
    mesh = init_device_mesh("cpu", (REPLICAS, STAGES), mesh_dim_names=("dp", "pp"))
    replica, stage = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    torch.manual_seed(stage)  # both replicas of a stage start from the same parameters
    module = Stage(stage, rank, opts)
    pipeline = PipelineStage(module, stage, STAGES, torch.device("cpu"),
                             group=mesh.get_group("pp"))
    schedule = ScheduleGPipe(pipeline, n_microbatches=MICROBATCHES, loss_fn=F.cross_entropy)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.01,
                                  fused=True)
    data = batches(samples(), rank, opts, BATCH, REPLICAS, replica)
    replicas = mesh.get_group("dp")

    def step(_: int) -> None:
        optimizer.zero_grad()
        features, labels = next(data)
        if stage == 0:
            schedule.step(features)
        else:
            schedule.step(target=labels)
        average_gradients(module.parameters(), replicas)
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
