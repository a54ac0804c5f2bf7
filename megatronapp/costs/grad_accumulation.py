"""Gradient accumulation outside the weight-gradient GEMM: a memory-bound pass
after each microbatch's backward that folds its gradients into the
accumulated ones, where the engine does not accumulate inside the GEMM.

- **Megatron, fused** (``training.gradient_accumulation_fusion``, Megatron-LM's
  default since February 2022, commit 83b1e42f "gradient accumulation
  fusion"): the weight-gradient GEMM accumulates into the main gradient
  (``fused_weight_gradient_mlp_cuda``): no pass.
- **Megatron, unfused** (``--no-gradient-accumulation-fusion``, and every
  Megatron-LM before it, such as the 2021 code of Narayanan et al.):
  ``megatron/model/distributed.py``. Without fp32 main gradients autograd's
  AccumulateGrad adds each microbatch's gradient into ``param.grad`` in place
  from the second microbatch on; with them (``accumulate_allreduce_grads_in_fp32``,
  forced for bf16) ``_make_param_hook`` runs ``param.main_grad.add_(param.grad.data)``
  after every backward and frees ``param.grad``.
- **DeepSpeed's pipeline engine** (``deepspeed_pipe.py``): with bf16,
  ``BF16_Optimizer.update_hp_grads`` after every backward
  (``hp_grad.add_(lp.grad.to(float32))``); with fp16 or fp32, AccumulateGrad
  as above.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..scenario.config import Scenario

# Bytes read and written per parameter by the pass. AccumulateGrad's in-place
# add reads the new and the old gradient and writes the sum: 3 × the gradient's
# bytes. Megatron's hook reads the 16-bit gradient and reads and writes the
# fp32 main gradient (2 + 4 + 4). DeepSpeed's bf16 cast reads 2 and writes a
# 4-byte fp32 temporary, its add reads that and the fp32 accumulator and
# writes the accumulator (2 + 4 + 4 + 4 + 4).
AUTOGRAD_BYTES_PER_PARAM = {"bf16": 6, "fp16": 6, "fp32": 12}
MEGATRON_MAIN_GRAD_BYTES_PER_PARAM = 10
DEEPSPEED_BF16_BYTES_PER_PARAM = 18


@dataclass(frozen=True)
class Accumulation:
    """The pass on one rank: its time, and the first microbatch that pays it
    (AccumulateGrad keeps the first microbatch's gradient as it is: the step
    left ``param.grad`` None; a hook into a separate buffer pays from the first)."""

    pass_s: float
    first_microbatch: int

    def after_backward_s(self, microbatch: int) -> float:
        """The pass after microbatch ``microbatch``'s backward."""
        return self.pass_s if microbatch >= self.first_microbatch else 0.0


def _bytes_and_first(s: Scenario) -> tuple[int, int] | None:
    """Bytes per parameter and the first microbatch paying them; None where the
    GEMM accumulates (Megatron with gradient accumulation fusion)."""
    t = s.training
    if s.parallel.pipeline_engine == "deepspeed":
        if t.precision == "bf16":
            return DEEPSPEED_BF16_BYTES_PER_PARAM, 0
        return AUTOGRAD_BYTES_PER_PARAM[t.precision], 1
    if t.gradient_accumulation_fusion:
        return None
    if t.precision == "bf16" or s.grad_reduce_in_fp32:
        return MEGATRON_MAIN_GRAD_BYTES_PER_PARAM, 0
    return AUTOGRAD_BYTES_PER_PARAM[t.precision], 1


def accumulation(s: Scenario, params: int, hbm_bytes_per_s: float) -> Accumulation | None:
    """A rank folding ``params`` parameters' gradients after each backward, at
    the device's HBM bandwidth; None where no pass runs."""
    found = _bytes_and_first(s)
    if found is None or params == 0:
        return None
    per_param, first = found
    return Accumulation(per_param * params / hbm_bytes_per_s, first)
