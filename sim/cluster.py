"""The simulated cluster of a scenario: devices, network and clocks, with faults."""
from __future__ import annotations

import math
from dataclasses import dataclass

import simpy

from megatronapp.scenario import seeds
from megatronapp.scenario.config import ClockSkew, LinkJitter, Scenario, SlowLink, Throttle
from megatronapp.program.layout import topology_of
from megatronapp.parallel.topology import Topology
from megatronapp.trace.events import RankClock

from .devices import Device, ThrottleWindow
from .network import LinkFaults, Network, pair


@dataclass
class Cluster:
    env: simpy.Environment
    topo: Topology
    devices: dict[int, Device]
    network: Network
    clocks: dict[int, RankClock]


def _devices(s: Scenario) -> dict[int, Device]:
    windows: dict[int, list[ThrottleWindow]] = {}
    for f in s.faults:
        if isinstance(f, Throttle):
            end = math.inf if f.end_s is None else f.end_s
            windows.setdefault(f.rank, []).append(ThrottleWindow(f.start_s, end, f.factor))
    sigma = s.cluster.jitter.compute_sigma
    return {r: Device(r, tuple(windows.get(r, ())), sigma,
                      seeds.rng(s.seed, 3, r) if sigma > 0 else None)
            for r in range(s.world_size)}


def link_faults(s: Scenario) -> LinkFaults:
    lf = LinkFaults()
    for f in s.faults:
        if isinstance(f, SlowLink):
            p = pair(*f.ranks)
            if f.start_s > 0 or f.end_s is not None:  # slow only inside its window
                end = math.inf if f.end_s is None else f.end_s
                lf.timed[p] = (*lf.timed.get(p, ()), ThrottleWindow(f.start_s, end, f.factor))
            else:
                lf.slow[p] = lf.slow.get(p, 1.0) * f.factor
        elif isinstance(f, LinkJitter):
            lf.jitter[pair(*f.ranks)] = f.sigma
    return lf


def clocks_of(s: Scenario) -> dict[int, RankClock]:
    clocks = {r: RankClock() for r in range(s.world_size)}
    for f in s.faults:
        if isinstance(f, ClockSkew):
            clocks[f.rank] = RankClock(f.offset_us, f.drift_ppm)
    return clocks


def _latency_s(per_class_us: float | None, default_us: float) -> float:
    return (default_us if per_class_us is None else per_class_us) * 1e-6


def build_cluster(s: Scenario, env: simpy.Environment | None = None) -> Cluster:
    env = env or simpy.Environment()
    topo = topology_of(s)
    links = s.cluster.links
    network = Network(env, topo, links.intra_node_gbps, links.inter_node_gbps,
                      _latency_s(links.intra_node_latency_us, links.latency_us), link_faults(s), s.cluster.jitter.link_sigma,
                      s.seed, s.costs.p2p_s, s.costs.allreduce_s,
                      _latency_s(links.inter_node_latency_us, links.latency_us),
                      links.nics_per_node, s.cluster.network.pod_nodes,
                      s.cluster.network.oversubscription)
    return Cluster(env, topo, _devices(s), network, clocks_of(s))
