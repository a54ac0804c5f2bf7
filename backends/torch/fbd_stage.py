"""A MegaFBD worker's megatron-core GPT stage (the ``DecoupledStage`` protocol).

Both workers of a virtual rank build the same ``MegatronStages`` (one chunk:
MegaFBD runs one model chunk per stage) from the same seed or the same
``initial_state``. The forward worker runs it without autograd; the backward
worker recomputes the forward with autograd, runs backward, steps the
optimizer and hands its weights to the forward worker, which loads them
before the next iteration's forwards.
"""
from __future__ import annotations

from typing import Any

import torch

from megatronapp.scenario.config import Scenario
from megatronapp.parallel.ops import Report

from .stages import MegatronStages, TrainOptions

CHUNK = 0


class DecoupledGptStage:
    """One worker's copy of its virtual rank's GPT stage."""

    does_tp_comm = True  # megatron-core's layers run their own TP collectives

    def __init__(self, s: Scenario, vrank: int, device: torch.device,
                 options: TrainOptions = TrainOptions()):
        self.stages = MegatronStages(s, vrank, device, options)
        self.model = self.stages.models[CHUNK]
        self._params = [p for _, p in self.stages.named]

    @property
    def log(self) -> Any:
        return self.stages.log

    def activation_buffer(self) -> torch.Tensor:
        return self.stages.activation_buffer()

    def start_iteration(self, iteration: int) -> None:
        self.stages.start_iteration(iteration)

    def forward_no_grad(self, microbatch: int, x: Any) -> torch.Tensor:
        """The forward worker's pass: nothing is kept for a backward."""
        with torch.no_grad():
            if x is not None:
                self.model.set_input_tensor(x)
            tokens = self.stages._tokens(microbatch)  # the same data as the backward worker
            return self.model(tokens[:, :-1], self.stages.positions, self.stages.mask)

    def recompute(self, microbatch: int, x: Any) -> torch.Tensor:
        return self.stages.forward(CHUNK, microbatch, x)

    def backward(self, microbatch: int, grad: Any) -> torch.Tensor | None:
        return self.stages.backward(CHUNK, microbatch, grad)

    def grad_buffer(self) -> torch.Tensor:
        return self.stages.grad_buffer()

    def optimizer_step(self) -> Report:
        """Step; reports the loss on the last stage (the stage's gradient norm
        is its own share: a decoupled program does not all-reduce it)."""
        report = self.stages.optimizer_step()
        return Report({k: v for k, v in report.values.items() if k != "grad_norm"})

    def weights(self) -> torch.Tensor:
        """Every parameter, flat (what the backward worker hands over)."""
        return torch.cat([p.detach().reshape(-1) for p in self._params])

    def load_weights(self, weights: torch.Tensor) -> None:
        torch.nn.utils.vector_to_parameters(weights, self._params)
