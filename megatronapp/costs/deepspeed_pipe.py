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
- **Gradient accumulation.** ``torch.autograd.backward`` per microbatch: the
  gradients are folded into the accumulated ones by a separate, memory-bound
  pass (``grad_accumulation.py``: bf16's ``BF16_Optimizer.update_hp_grads``
  after every backward, DeepSpeed #1801; fp16's AccumulateGrad).
- **Gradient reduction** after the flush (``ReduceTiedGrads``, ``ReduceGrads``,
  ``OptimizerStep`` on the last step), not overlapped, and always an
  all-reduce of the whole gradient, twice a reduce-scatter's traffic. bf16
  runs ZeRO stage 0 with ``BF16_Optimizer`` sharding the fp32 state itself:
  ``_bf16_reduce_grads`` all-reduces (``buffered_allreduce_fallback``). fp16
  with ZeRO stage 1 (DeepSpeed 0.4 and 0.5; ``FP16_DeepSpeedZeroOptimizer``,
  stage 1 since #1042, May 2021) has ``contiguous_gradients`` forced off for
  stage 1 (#1246, July 2021), so ``reduce_gradients`` → ``reduce_ipg_grads``
  takes ``buffered_reduce_fallback`` → ``allreduce_bucket``: ``dist.all_reduce``
  of each flattened bucket, not the per-owner ``dist.reduce`` of
  ``average_tensor``. Each rank then steps its own partition and
  ``all_gather_partitions`` gathers the fp16 weights, as a distributed
  optimizer does.
"""
from __future__ import annotations

from ..parallel.schedules import Order, PipeShape, Task


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
