"""Published measurements the simulator is checked against.

Narayanan et al. 2021 (SC21), Table 1: TFLOP/s per GPU of GPT models on up to
3072 A100 GPUs (peak 312), FLOPs counted with the paper's Eq. 3, recomputation
included. The rows' scenarios are ``scenarios/narayanan2021/rowNN.yaml``.
"""
from __future__ import annotations

from ..scenario.config import Scenario
from ..costs.flops import hardware_flops_per_iteration
from .fit import Knob

NARAYANAN_TABLE1_TFLOPS: dict[int, float] = {
    1: 137, 2: 138, 3: 142, 4: 135, 5: 138, 6: 140, 7: 148, 8: 155, 9: 163, 10: 163}

# The two constants fitted on two rows: the GEMMs' share of peak, and HBM
# bytes moved per stored activation byte (elementwise work).
TABLE1_KNOBS = (Knob("cluster.gpu.efficiency", 0.6, 0.05, 1.0),
                Knob("cluster.gpu.elementwise_traffic", 1.0, 0.0, 20.0))


def iteration_s_from_tflops(s: Scenario, tflops_per_gpu: float) -> float:
    """A published throughput back to an iteration time (Eq. 3 FLOPs)."""
    return hardware_flops_per_iteration(s) / s.world_size / (tflops_per_gpu * 1e12)
