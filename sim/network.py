"""Links with bandwidth, latency, jitter and intra/inter-node topology.

Point-to-point transfers are fluid flows: each flow crosses its sender's
egress port and its receiver's ingress port (NVLink within a node, the NIC
between nodes) and gets an equal share of the most crowded port it crosses.
A flow's rate is recomputed whenever a flow sharing one of its ports starts
or ends. Collectives cost the α-β ring formula over the group's slowest edge.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import simpy

from megatronapp import seeds
from megatronapp.topology import Topology

Pair = tuple[int, int]


def gbps_to_bytes_per_s(gbps: float) -> float:
    return gbps * 1e9 / 8


@dataclass(eq=False)
class Port:
    bandwidth: float  # bytes/s
    flows: set["Flow"] = field(default_factory=set)


@dataclass(eq=False)
class Flow:
    remaining: float  # bytes, already scaled by the pair's slowdown
    ports: tuple[Port, Port]
    on_done: Callable[[], None]
    rate: float = 0.0
    last_s: float = 0.0
    version: int = 0


@dataclass
class LinkFaults:
    """Per unordered rank pair: bandwidth slowdown factor and jitter sigma."""

    slow: dict[Pair, float] = field(default_factory=dict)
    jitter: dict[Pair, float] = field(default_factory=dict)


def succeeds(event: simpy.Event) -> Callable[[simpy.Event], None]:
    """A callback that succeeds ``event`` (for another event's ``callbacks``)."""
    def callback(_fired: simpy.Event) -> None:
        event.succeed()
    return callback


def pair(a: int, b: int) -> Pair:
    return (a, b) if a < b else (b, a)


class Network:
    def __init__(self, env: simpy.Environment, topo: Topology, intra_gbps: float,
                 inter_gbps: float, latency_s: float, faults: LinkFaults,
                 background_sigma: float, seed: int,
                 fixed_p2p_s: float | None = None, fixed_allreduce_s: float | None = None,
                 inter_latency_s: float | None = None, nics_per_node: int | None = None):
        self.env = env
        self.topo = topo
        self.intra_bw = gbps_to_bytes_per_s(intra_gbps)
        self.inter_bw = gbps_to_bytes_per_s(inter_gbps)
        self.latency_s = latency_s  # within a node
        self.inter_latency_s = latency_s if inter_latency_s is None else inter_latency_s
        self.nics_per_node = nics_per_node
        self.faults = faults
        self.background_sigma = background_sigma
        self.seed = seed
        self.fixed_p2p_s = fixed_p2p_s
        self.fixed_allreduce_s = fixed_allreduce_s
        self._ports: dict[tuple[str, int], Port] = {}
        self._rngs: dict[tuple[int, ...], np.random.Generator] = {}

    # ----------------------------------------------------------- pair factors
    def _rng(self, stream: tuple[int, ...]) -> np.random.Generator:
        # One random stream per sender->receiver direction (and per collective
        # group): draws follow that stream's own program order, so timing
        # changes elsewhere never reshuffle them.
        if stream not in self._rngs:
            self._rngs[stream] = seeds.rng(self.seed, 7, *stream)
        return self._rngs[stream]

    def slowdown(self, a: int, b: int, stream: tuple[int, ...] | None = None) -> float:
        """Time multiplier of one use of the a-b link: fault factor x jitter."""
        p = pair(a, b)
        factor = self.faults.slow.get(p, 1.0)
        sigma = math.hypot(self.faults.jitter.get(p, 0.0), self.background_sigma)
        if sigma > 0:
            factor *= math.exp(self._rng(stream or (a, b)).normal(0.0, sigma))
        return factor

    def bandwidth(self, a: int, b: int) -> float:
        return self.intra_bw if self.topo.same_node(a, b) else self.inter_bw

    def latency(self, a: int, b: int) -> float:
        return self.latency_s if self.topo.same_node(a, b) else self.inter_latency_s

    def _port(self, kind: str, rank: int, bandwidth: float) -> Port:
        key = (kind, rank)
        if key not in self._ports:
            self._ports[key] = Port(bandwidth)
        return self._ports[key]

    # ------------------------------------------------------------- transfers
    def transfer(self, src: int, dst: int, nbytes: int) -> simpy.Event:
        """An event that fires when ``nbytes`` from src have reached dst."""
        done = self.env.event()
        slow = self.slowdown(src, dst)
        if self.fixed_p2p_s is not None:
            self.env.timeout(self.fixed_p2p_s * slow).callbacks.append(succeeds(done))
            return done
        kind = "nvlink" if self.topo.same_node(src, dst) else "nic"
        bw = self.bandwidth(src, dst)
        ports = (self._port(kind + "_out", src, bw), self._port(kind + "_in", dst, bw))

        latency = self.latency(src, dst)

        def delivered() -> None:
            self.env.timeout(latency).callbacks.append(succeeds(done))

        if nbytes <= 0:
            delivered()
            return done
        self._start(Flow(remaining=nbytes * slow, ports=ports, on_done=delivered))
        return done

    def _neighbours(self, flow: Flow) -> set[Flow]:
        return flow.ports[0].flows | flow.ports[1].flows

    def _settle(self, flows: set[Flow]) -> None:
        now = self.env.now
        for f in flows:
            f.remaining -= f.rate * (now - f.last_s)
            f.last_s = now

    def _reschedule(self, flows: set[Flow]) -> None:
        for f in flows:
            f.rate = min(p.bandwidth / len(p.flows) for p in f.ports)
            f.version += 1
            eta = max(f.remaining, 0.0) / f.rate
            self.env.timeout(eta).callbacks.append(self._finisher(f, f.version))

    def _finisher(self, flow: Flow, version: int) -> Callable[[simpy.Event], None]:
        return lambda _fired: self._finish(flow, version)

    def _start(self, flow: Flow) -> None:
        flow.last_s = self.env.now
        self._settle(self._neighbours(flow))
        for p in flow.ports:
            p.flows.add(flow)
        self._reschedule(self._neighbours(flow))

    def _finish(self, flow: Flow, version: int) -> None:
        if version != flow.version:
            return  # a stale wake-up: the flow's rate changed since
        others = self._neighbours(flow) - {flow}
        self._settle(others)
        for p in flow.ports:
            p.flows.discard(flow)
        self._reschedule(others)
        flow.on_done()

    # ------------------------------------------------------------ collectives
    def ring_allreduce_s(self, group: tuple[int, ...], nbytes: int) -> float:
        """2(n-1)/n·S/B + 2(n-1)·α over the ring's slowest edge."""
        return self.ring_collective_s("all_reduce", group, nbytes)

    def ring_collective_s(self, kind: str, group: tuple[int, ...], nbytes: int) -> float:
        """A ring all-reduce is a reduce-scatter then an all-gather, each
        (n-1)/n·S/B + (n-1)·α for a buffer of S bytes."""
        n = len(group)
        if n == 1:
            return 0.0
        steps = 2 if kind == "all_reduce" else 1
        edges = [(group[i], group[(i + 1) % n]) for i in range(n)]
        stream = (len(group), *group)
        worst = max(self.slowdown(a, b, stream) for a, b in edges)
        if self.fixed_allreduce_s is not None:
            return self.fixed_allreduce_s * worst
        bw = min(self._ring_bandwidth(group, a, b) for a, b in edges) / worst
        alpha = max(self.latency(a, b) for a, b in edges)
        return steps * ((n - 1) / n * nbytes / bw + (n - 1) * alpha)

    def _ring_bandwidth(self, group: tuple[int, ...], a: int, b: int) -> float:
        if self.topo.same_node(a, b) or self.nics_per_node is None:
            return self.bandwidth(a, b)
        per_node: dict[int, int] = {}
        for r in group:
            per_node[self.topo.node(r)] = per_node.get(self.topo.node(r), 0) + 1
        return self.inter_bw * min(min(per_node.values()), self.nics_per_node)
