"""What megatron-core 0.16 needs to run on CPU (gloo); nothing else lives here.

Megatron-core assumes CUDA in two places our stages reach, and one more is
avoided by how the stages call the model:

(a) ``GlobalMemoryBuffer.get_tensor`` allocates on ``torch.cuda.current_device()``
    (used by the TP all-gather / reduce-scatter helpers): allocate on the CPU.
(b) ``CudaRNGStatesTracker`` stores and swaps CUDA RNG states
    (``torch.cuda.get_rng_state``); on CPU we track named CPU generator states
    and fork the CPU RNG instead.
(c) Attention needs an explicit mask on CPU: the stages always pass one (see
    ``causal_mask``), so no patch is needed for it.
(d) Activation recomputation (``CheckpointFunction``) saves and restores the
    CUDA RNG state beside the CPU one: on CPU there is none to save (an empty
    state; restoring it is a no-op, queued by ``torch.cuda._lazy_call``).

``apply()`` is idempotent and a no-op when CUDA is available, so GPU runs use
megatron-core unchanged.
"""
from __future__ import annotations

import contextlib
import operator
from functools import reduce
from typing import Any, Iterator

import torch


class CpuRNGStatesTracker:
    """Named CPU RNG states with megatron's tracker interface (add/fork/...)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._initialized = False

    def is_initialized(self) -> bool:
        return self._initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"rng state {name!r} / seed {seed} already added")
        self._initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"rng state {name!r} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _cpu_get_tensor(self: Any, tensor_shape: Any, dtype: torch.dtype, name: str,
                    mem_alloc_context: Any = None) -> torch.Tensor:
    required = reduce(operator.mul, tensor_shape, 1)
    buffer = self.buffer.get((name, dtype))
    if buffer is None or buffer.numel() < required:
        buffer = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype)
    return buffer[:required].view(*tensor_shape)


def _no_cuda_rng_state(*_args: Any, **_kw: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def apply() -> None:
    """Patch megatron-core for CPU execution (only when CUDA is absent)."""
    if torch.cuda.is_available():
        return
    from megatron.core import utils
    from megatron.core.tensor_parallel import random

    utils.GlobalMemoryBuffer.get_tensor = _cpu_get_tensor  # (a)
    random._get_cuda_rng_state = _no_cuda_rng_state  # (d)
    if not isinstance(random._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker):  # (b)
        random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def seed_model_parallel_rng(seed: int, tp_rank: int) -> None:
    """Megatron's ``model_parallel_cuda_manual_seed`` for the CPU tracker."""
    from megatron.core.tensor_parallel import random

    if torch.cuda.is_available():
        random.model_parallel_cuda_manual_seed(seed)
        return
    tracker = random.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(1, 1, s, s) boolean mask, True where attention is not allowed (c)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device),
                      diagonal=1)[None, None]
