"""DeepSpeed's pipeline engine (Megatron-DeepSpeed, which trained MT-NLG and
BLOOM): its schedule, and what it does around the schedule that Megatron's
engine does not (``parallel.pipeline_engine: deepspeed``).

Read from microsoft/DeepSpeed, ``deepspeed/runtime/pipe/``:

- **Schedule.** ``schedule.py``'s ``TrainSchedule`` runs 2·(m + p − 1) steps;
  on each, a stage runs the forward (even stages on even steps) or backward
  of the microbatch ``_step_to_micro_batch`` maps it to, or idles. Stripped of
  its idle steps this is Megatron's non-interleaved 1F1B order, task for task
  (``train_schedule_order``; a test checks it): the schedule costs nothing
  more. Its messages are blocking ``p2p.send``/``p2p.recv`` (``dist.send`` /
  ``recv``, or ``dist.broadcast`` in two-rank groups before torch 1.8), one
  at a time, never under compute: a send returns once the message is moved.
- **Gradient accumulation.** Megatron's weight-gradient GEMM accumulates into
  the fp32 main gradient (``gradient_accumulation_fusion``): no extra pass.
  DeepSpeed runs ``torch.autograd.backward`` per microbatch, so each
  microbatch's gradients are folded into the accumulated ones by a separate,
  memory-bound pass over the stage's gradients
  (``ACCUMULATE_BYTES_PER_PARAM``). With bf16, ``engine.py``'s
  ``_exec_backward_pass`` calls ``BF16_Optimizer.update_hp_grads`` after every
  backward (DeepSpeed #1801, April 2022, the bf16 pipeline BLOOM trained
  with): ``hp_grad.add_(lp.grad.to(float32))``. With fp16 (the engine had no
  bf16 path before #1801) autograd's AccumulateGrad adds in place into
  ``param.grad`` from the second microbatch on.
- **Gradient reduction** after the flush (``ReduceTiedGrads``, ``ReduceGrads``,
  ``OptimizerStep`` on the last step), not overlapped. bf16 runs ZeRO stage 0
  with ``BF16_Optimizer`` sharding the fp32 state itself, and
  ``_bf16_reduce_grads`` all-reduces the whole gradient
  (``buffered_allreduce_fallback``) before the sharded step all-gathers the
  weights: twice a reduce-scatter's traffic. fp16 with ZeRO stage 1 reduces
  each shard to its owner (``reduce_gradients``), as a reduce-scatter.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..parallel.schedules import Order, PipeShape, Task
from ..scenario.config import Scenario

# Bytes read and written per parameter when one microbatch's gradient is folded
# into the accumulated one. bf16: the cast reads 2 and writes a 4-byte fp32
# temporary, the add reads it and the fp32 accumulator and writes the
# accumulator (2 + 4 + 4 + 4 + 4). fp16 / fp32: AccumulateGrad's in-place add
# reads the new and the old gradient and writes the sum (3 × 2, 3 × 4).
ACCUMULATE_BYTES_PER_PARAM = {"bf16": 18, "fp16": 6, "fp32": 12}
# bf16 folds every microbatch into the fp32 copy; AccumulateGrad keeps the
# first microbatch's gradient as it is (the step left param.grad None).
FIRST_ACCUMULATING_MICROBATCH = {"bf16": 0, "fp16": 1, "fp32": 1}


@dataclass(frozen=True)
class DeepSpeedCosts:
    """What a rank of DeepSpeed's engine pays that Megatron's does not."""

    grad_accumulate_s: float  # after a backward, folding its gradients in
    first_accumulating_microbatch: int
    all_reduce_grads: bool  # the whole gradient all-reduced, not reduce-scattered

    def accumulate_s(self, microbatch: int) -> float:
        """The accumulation pass after microbatch ``microbatch``'s backward."""
        return self.grad_accumulate_s if microbatch >= self.first_accumulating_microbatch else 0.0


def deepspeed_costs(s: Scenario, params: int, hbm_bytes_per_s: float) -> DeepSpeedCosts | None:
    """A rank holding ``params`` parameters under DeepSpeed's engine; None under Megatron's."""
    if s.parallel.pipeline_engine != "deepspeed":
        return None
    precision = s.training.precision
    return DeepSpeedCosts(
        grad_accumulate_s=ACCUMULATE_BYTES_PER_PARAM[precision] * params / hbm_bytes_per_s,
        first_accumulating_microbatch=FIRST_ACCUMULATING_MICROBATCH[precision],
        all_reduce_grads=precision == "bf16")


def _step_task(step: int, stage: int, stages: int) -> Task:
    """``TrainSchedule._step_to_micro_batch``: forward on steps of the stage's
    parity, backward on the others; the microbatch may be out of range (idle)."""
    half = step // 2
    if step % 2 == stage % 2:
        return Task("F", half - stage // 2)
    if step % 2 == 0:  # an odd stage's backward
        return Task("B", half - stages + (stage + 1) // 2)
    return Task("B", half - stages + 1 + stage // 2)  # an even stage's backward


def train_schedule_order(pp_rank: int, shape: PipeShape) -> Order:
    """The tasks DeepSpeed's TrainSchedule runs on stage ``pp_rank``, idle steps left out."""
    m = shape.microbatches
    steps = (_step_task(step, pp_rank, shape.pp) for step in range(2 * (m + shape.pp - 1)))
    return [task for task in steps if 0 <= task.microbatch < m]
