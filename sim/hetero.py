"""Heterogeneous clusters: device classes with their own speed and memory.

The analytical cost model prices work at ``cluster.gpu`` speed; a device of a
class with ``tflops`` runs it ``gpu.tflops / tflops`` times as long (a
whole-run throttle window of the ordinary ``Device``). Without
``cluster.device_classes`` every device is of one class built from ``gpu``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megatronapp.scenario.config import DeviceClass, Scenario, ScenarioError


@dataclass(frozen=True)
class ClassSlot:
    """One physical device: its class and how much slower than the reference."""

    name: str
    slowdown: float
    memory_bytes: float


def device_classes(s: Scenario, count: int) -> tuple[DeviceClass, ...]:
    if s.cluster.device_classes:
        return s.cluster.device_classes
    gpu = s.cluster.gpu
    return (DeviceClass(name="gpu", count=count, tflops=gpu.tflops, memory_gb=gpu.memory_gb),)


def slot(s: Scenario, cls: DeviceClass) -> ClassSlot:
    return ClassSlot(cls.name, s.cluster.gpu.tflops / cls.tflops, cls.memory_gb * 1e9)


def slots_by_class(s: Scenario, demands: Sequence[tuple[str | None, int]]) -> list[ClassSlot]:
    """Devices for consecutive demands (class name or None = first class, count)."""
    classes = {c.name: c for c in device_classes(s, sum(n for _, n in demands))}
    left = {name: c.count for name, c in classes.items()}
    out: list[ClassSlot] = []
    for name, n in demands:
        name = name or next(iter(classes))
        if left[name] < n:
            raise ScenarioError("cluster.device_classes",
                                f"class {name!r} has {left[name]} devices left, {n} needed")
        left[name] -= n
        out += [slot(s, classes[name])] * n
    return out
