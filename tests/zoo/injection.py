"""Faults injected inside one rank's process, each a real effect (no sleep
stands in for compute), each active only in the steps a ``Clock`` says:

- ``ExtraCalls``: the rank repeats each of its matmuls and convolutions,
  same shapes, (F-1)x more calls (forward, and through autograd backward);
- ``StalledDataset``: a dataset whose ``__getitem__`` does CPU-bound Python
  work (as decoding or augmenting samples does) before it returns, for a
  set wall time (on a loaded machine it gets less CPU in it, not longer);
- ``stall_before_optimizer_step``: the rank blocks (sleeps, as a synchronous
  write to a slow file system does) before every ``optimizer.step()``;
- ``NoisyNeighbour``: a background thread in the rank's process that burns
  CPU with Python arithmetic (holding the GIL) and torch work (releasing it).

Nothing here imports megatronapp or the launcher: it is importable alone.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sized

import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader, Dataset
from torch.utils.hooks import RemovableHandle


@dataclass
class Clock:
    """The step a rank is in and which steps a fault hits: with ``every`` K,
    only the steps i with ``i % K == K - 1`` (every step when K is 1)."""
    every: int = 1
    step: int = 0

    def hit(self, step: int | None = None) -> bool:
        i = self.step if step is None else step
        return i % self.every == self.every - 1


def steps_hit(every: int, first: int, count: int) -> list[int]:
    """The steps among ``first`` .. ``first + count - 1`` that ``every`` hits."""
    clock = Clock(every)
    return [i for i in range(first, first + count) if clock.hit(i)]


# the calls whose work a rank repeats: its matmuls, convolutions, attention
# and LSTMs (whole: a call's insides are not seen by the mode, so attention
# is repeated with the projections it makes itself)
REPEATED: frozenset[Callable[..., Any]] = frozenset({
    F.linear, F.conv1d, F.conv2d, F.conv_transpose2d, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__,
    torch.mm, torch.bmm, torch.addmm, torch.baddbmm, F.scaled_dot_product_attention,
    F.multi_head_attention_forward, torch.lstm})


class ExtraCalls(TorchFunctionMode):
    """While entered, each matmul, convolution or attention the rank calls
    is called again, on the same inputs, so that F times as many calls of
    the same shapes run (a fractional F repeats every so many calls). The
    copies' results are added with weight 0 to the real result: the values
    stay the same, and autograd runs each copy's backward too. (The mode
    itself costs about 2 µs of Python per torch call on this rank.)"""

    def __init__(self, factor: float, clock: Clock) -> None:
        super().__init__()
        self.extra_per_call, self.clock = factor - 1.0, clock
        self.owed = 0.0

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func not in REPEATED or not self.clock.hit():
            return result
        self.owed += self.extra_per_call
        while self.owed >= 1.0:
            self.owed -= 1.0
            result = joined(result, func(*args, **kwargs))
        return result


def joined(result: Any, copy: Any) -> Any:
    """``result`` with ``copy`` added at weight 0 (to the first tensor of a
    tuple, as attention returns its output and its weights)."""
    if isinstance(result, tuple):
        return (joined(result[0], copy[0]), *result[1:])
    return torch.add(result, copy, alpha=0.0)


@dataclass
class StalledDataset(Dataset[Any]):
    """``dataset`` whose items each cost ``ms_per_item`` of CPU-bound Python
    before they are returned, in the steps ``clock`` hits (read one at a
    time or a batch at a time, as ``dataset`` is)."""
    dataset: Dataset[Any]
    ms_per_item: float
    clock: Clock

    def __len__(self) -> int:
        assert isinstance(self.dataset, Sized)
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        self.stall(1)
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> Any:
        self.stall(len(indices))
        read = getattr(self.dataset, "__getitems__", None)
        return read(indices) if read else [self.dataset[i] for i in indices]

    def stall(self, items: int) -> None:
        if self.clock.hit():
            busy_python(self.ms_per_item * items / 1e3)


def busy_python(seconds: float) -> int:
    """Pure-Python arithmetic (it holds the GIL) for ``seconds``: the thread
    keeps a core busy whenever the machine gives it one."""
    end, total = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        for i in range(200):
            total += i * i % 7
    return total


def forever(loader: DataLoader[Any]) -> Iterator[Any]:
    """The loader's batches, epoch after epoch."""
    while True:
        yield from loader


def stall_before_optimizer_step(seconds: float, clock: Clock) -> RemovableHandle:
    """Before every ``optimizer.step()`` of this process, in the steps
    ``clock`` hits, block for ``seconds``."""
    def hook(_optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if clock.hit():
            time.sleep(seconds)
    return register_optimizer_step_pre_hook(hook)


@dataclass
class NoisyNeighbour:
    """A daemon thread that, in the steps ``clock`` hits, alternates about a
    millisecond of Python arithmetic (it holds the GIL) with a sort of a
    random 64 k vector (torch releases the GIL); otherwise it naps."""
    clock: Clock
    stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name="noisy-neighbour", daemon=True)
        thread.start()
        return thread

    def run(self) -> None:
        values = torch.empty(1 << 16)
        while not self.stop.is_set():
            if not self.clock.hit():
                time.sleep(1e-3)
                continue
            busy_python(1e-3)
            values.uniform_().sort()
