"""Everything about what a scenario costs lives here: FLOPs, memory, per-operation times
(per_op) and the task plans of tensor-parallel layers (taskplan)."""

__all__ = ["flops", "memory", "per_op", "taskplan"]
