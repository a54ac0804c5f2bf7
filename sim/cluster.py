"""The simulated cluster of a scenario: devices, network and clocks, with the
faults' effects (``megatronapp.faults``) on each."""
from __future__ import annotations

from dataclasses import dataclass

import simpy

from megatronapp.faults import JobEffects, effects_of
from megatronapp.scenario import seeds
from megatronapp.scenario.config import Scenario, fault_job
from megatronapp.program.layout import topology_of
from megatronapp.parallel.topology import Topology
from megatronapp.trace.events import RankClock

from .devices import Device
from .network import Network


@dataclass
class Cluster:
    env: simpy.Environment
    topo: Topology
    devices: dict[int, Device]
    network: Network
    clocks: dict[int, RankClock]
    effects: JobEffects


def scenario_effects(s: Scenario) -> JobEffects:
    return effects_of(s.faults, fault_job(s))


def device_of(s: Scenario, effects: JobEffects, rank: int, jitter: bool = True,
              slowdown: float = 1.0) -> Device:
    """A device with its faults, background jitter (``jitter``) and a class
    slowdown (a heterogeneous cluster's device class)."""
    sigma = s.cluster.jitter.compute_sigma if jitter else 0.0
    speed = effects.speed(rank)
    if slowdown != 1.0:
        speed = type(speed)(speed.windows, speed.scale * slowdown)
    return Device(rank, speed, sigma, seeds.rng(s.seed, 3, rank) if sigma > 0 else None,
                  effects.host(rank))


def clocks_of(s: Scenario, count: int | None = None,
              effects: JobEffects | None = None) -> dict[int, RankClock]:
    effects = effects or scenario_effects(s)
    out = {}
    for r in range(s.world_size if count is None else count):
        skew = effects.clock(r)
        out[r] = RankClock() if skew is None else RankClock(*skew)
    return out


def _latency_s(per_class_us: float | None, default_us: float) -> float:
    return (default_us if per_class_us is None else per_class_us) * 1e-6


def build_cluster(s: Scenario, env: simpy.Environment | None = None) -> Cluster:
    env = env or simpy.Environment()
    topo = topology_of(s)
    links = s.cluster.links
    effects = scenario_effects(s)
    network = Network(env, topo, links.intra_node_gbps, links.inter_node_gbps,
                      _latency_s(links.intra_node_latency_us, links.latency_us), effects,
                      s.cluster.jitter.link_sigma, s.seed, s.costs.p2p_s, s.costs.allreduce_s,
                      _latency_s(links.inter_node_latency_us, links.latency_us),
                      links.nics_per_node, s.cluster.network.pod_nodes,
                      s.cluster.network.oversubscription)
    devices = {r: device_of(s, effects, r) for r in range(s.world_size)}
    return Cluster(env, topo, devices, network, clocks_of(s, effects=effects), effects)
