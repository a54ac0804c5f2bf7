"""Injected faults acting on a real run, priced by the simulator's own models
(the torch backend asks here how long each real operation must last, and
what else its faults do to it).

A throttled rank's compute is stretched the way ``sim.devices.Device`` would
stretch it (windows, partial windows pro rata, device variation); its host
waits what the device's host delays say before the op they precede. A slow,
jittered or flapping link adds the time the simulator's link model says the
transfer would lose, over a fault-free network of the same scenario. A
fail-stop fault names the wall second the rank's process dies. Background
noise (``cluster.jitter``) is left out: a real machine brings its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import simpy

from megatronapp.scenario.config import Jitter, Scenario
from megatronapp.fbd.run import fbd_layout

from .cluster import Cluster, build_cluster
from .devices import Device
from .fbd import device_cluster, fbd_slots
from .network import Network

__all__ = ["InjectedFaults", "fbd_device_faults", "injected_faults"]


@dataclass
class InjectedFaults:
    """One rank's view of the scenario's faults."""

    device: Device
    faulty: Network
    nominal: Network
    links: bool = True  # any link fault: False skips pricing every transfer
    stop_s: float | None = None  # this rank's process dies at its first op from then on

    @property
    def compute(self) -> bool:
        """Its computes are priced (a throttle, device variation)."""
        return not self.device.speed.plain

    def compute_extra_s(self, start_s: float, work_s: float, iteration: int = -1) -> float:
        """Extra seconds a compute started at ``start_s`` that did ``work_s`` of
        real work must last."""
        return self.device.duration(start_s, work_s, iteration) - work_s

    def host_delay_s(self, name: str, iteration: int) -> float:
        """Host time before the op (called for every op, in program order)."""
        return self.device.host_delay_s(name, iteration)

    def transfer_extra_s(self, src: int, dst: int, nbytes: int, at: float = 0.0) -> float:
        link = self.faulty.link(src, dst)
        slowdown = link.slowdown(at)
        net = self.nominal
        base = net.fixed_p2p_s if net.fixed_p2p_s is not None else (
            nbytes / net.bandwidth(src, dst) + net.latency_s)
        slowed = (slowdown - 1.0) * base if slowdown > 1.0 else 0.0  # jitter cannot speed it up
        return slowed + link.delay_s(at, nbytes, max(slowdown, 1.0))

    def allreduce_extra_s(self, group: tuple[int, ...], nbytes: int, at: float = 0.0) -> float:
        return max(0.0, self.faulty.ring(group).seconds(nbytes, 2, at)
                   - self.nominal.ring(group).seconds(nbytes, 2, at))


def calm(s: Scenario, keep_faults: bool) -> Scenario:
    cluster = s.cluster.model_copy(update={"jitter": Jitter()})
    return s.model_copy(update={"cluster": cluster, "faults": s.faults if keep_faults else ()})


def _injected(faulty: Cluster, nominal: Cluster, rank: int) -> InjectedFaults:
    stop = faulty.effects.stop
    return InjectedFaults(faulty.devices[rank], faulty.network, nominal.network,
                          faulty.effects.has_links,
                          stop[1] if stop is not None and stop[0] == rank else None)


def injected_faults(s: Scenario, rank: int) -> InjectedFaults:
    return _injected(build_cluster(calm(s, keep_faults=True)),
                     build_cluster(calm(s, keep_faults=False)), rank)


def fbd_device_faults(s: Scenario, device: int) -> InjectedFaults:
    """One physical device's faults in a decoupled (MegaFBD) run: its class speed
    and throttles, and the links between devices (background jitter a real
    machine brings itself)."""
    quiet = calm(s, keep_faults=True)
    slots = fbd_slots(quiet, fbd_layout(quiet))
    faulty = device_cluster(quiet, slots, simpy.Environment())
    nominal = device_cluster(quiet, slots, simpy.Environment(), faults=False)
    return _injected(faulty, nominal, device)
