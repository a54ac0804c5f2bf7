"""Injected faults acting on a real run, priced by the simulator's own models
(the torch backend asks here how long each real operation must last).

A throttled rank's compute is stretched the way ``sim.devices.Device`` would
stretch it (``factor`` x inside the window, partial windows pro rata). A slow or
jittered link adds the time the simulator's link model says the transfer would
lose, over a fault-free network of the same scenario. Background noise
(``cluster.jitter``) is left out: a real machine brings its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import simpy

from megatronapp.scenario.config import Jitter, Scenario
from megatronapp.fbd.run import fbd_layout

from .cluster import build_cluster
from .devices import Device
from .fbd import device_cluster, fbd_slots
from .network import Network

LINK_FAULTS = ("slow_link", "link_jitter")


@dataclass
class InjectedFaults:
    """One rank's view of the scenario's faults."""

    device: Device
    faulty: Network
    nominal: Network
    links: bool = True  # any slow or jittered link: False skips pricing every transfer

    def compute_extra_s(self, start_s: float, work_s: float) -> float:
        """Extra seconds a compute started at ``start_s`` that did ``work_s`` of
        real work must last."""
        return self.device.duration(start_s, work_s) - work_s

    def transfer_extra_s(self, src: int, dst: int, nbytes: int) -> float:
        slowdown = self.faulty.slowdown(src, dst)
        if slowdown <= 1.0:
            return 0.0  # jitter cannot make a real link faster than it is
        net = self.nominal
        base = net.fixed_p2p_s if net.fixed_p2p_s is not None else (
            nbytes / net.bandwidth(src, dst) + net.latency_s)
        return (slowdown - 1.0) * base

    def allreduce_extra_s(self, group: tuple[int, ...], nbytes: int) -> float:
        return max(0.0, self.faulty.ring_allreduce_s(group, nbytes)
                   - self.nominal.ring_allreduce_s(group, nbytes))


def calm(s: Scenario, keep_faults: bool) -> Scenario:
    cluster = s.cluster.model_copy(update={"jitter": Jitter()})
    return s.model_copy(update={"cluster": cluster, "faults": s.faults if keep_faults else ()})


def injected_faults(s: Scenario, rank: int) -> InjectedFaults:
    faulty = build_cluster(calm(s, keep_faults=True))
    links = any(f.kind in LINK_FAULTS for f in s.faults)
    return InjectedFaults(faulty.devices[rank], faulty.network,
                          build_cluster(calm(s, keep_faults=False)).network, links)


def fbd_device_faults(s: Scenario, device: int) -> InjectedFaults:
    """One physical device's faults in a decoupled (MegaFBD) run: its class speed
    and throttles, and the links between devices (background jitter a real
    machine brings itself)."""
    quiet = calm(s, keep_faults=True)
    slots = fbd_slots(quiet, fbd_layout(quiet))
    faulty = device_cluster(quiet, slots, simpy.Environment())
    nominal = device_cluster(quiet, slots, simpy.Environment(), faults=False)
    links = any(f.kind in LINK_FAULTS for f in s.faults)
    return InjectedFaults(faulty.devices[device], faulty.network, nominal.network, links)
