"""Links with bandwidth, latency, jitter and intra/inter-node topology.

Point-to-point transfers are fluid flows: each flow crosses its sender's
egress port and its receiver's ingress port (NVLink within a node, the NIC
between nodes) and gets an equal share of the most crowded port it crosses.
A flow's rate is recomputed whenever a flow sharing one of its ports starts
or ends. Collectives cost the α-β ring formula over the group's slowest edge,
with NCCL's per-step latency taken hierarchically (the ring visits a node's
members over NVLink, then crosses to the next node). Nodes may sit in pods:
traffic between pods crosses uplinks oversubscribed ``oversubscription``:1,
so a flow between pods gets that share of its NIC's bandwidth.
"""
from __future__ import annotations

from collections import Counter
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import simpy

from megatronapp.faults import JobEffects, Outage, Window
from megatronapp.scenario import seeds
from megatronapp.parallel.topology import Topology

from .draws import NormalStream, exact_exp

Pair = tuple[int, int]
EdgeWindows = tuple[tuple[Window, ...], ...]  # a ring's slow-link windows, edge by edge


def factor_at(windows: tuple[Window, ...], t: float) -> float:
    """The product of the factors of the windows that hold ``t``."""
    factor = 1.0
    for w in windows:
        factor *= w.factor_at(t)
    return factor


def outage_delay(outages: tuple[Outage, ...], t: float, nominal_s: float) -> float:
    """Seconds a use of a link starting at ``t`` waits out its outages."""
    return sum(o.delay_s(t, nominal_s) for o in outages)


def gbps_to_bytes_per_s(gbps: float) -> float:
    return gbps * 1e9 / 8


@dataclass(eq=False, slots=True)
class Port:
    bandwidth: float  # bytes/s
    flows: set["Flow"] = field(default_factory=set)


@dataclass(eq=False, slots=True)
class Flow:
    remaining: float  # bytes, already scaled by the pair's slowdown
    ports: tuple[Port, Port]
    on_done: Callable[[], None] | None = None
    tag: Any = None  # the scheduler's own note (the compiled engine's message)
    rate: float = 0.0
    last_s: float = 0.0
    version: int = 0


class FluidPorts:
    """Max-min-free fair sharing of ports, without a scheduler: ``start`` and
    ``finish`` return the flows whose completion must be (re)scheduled at
    ``now + flow.eta`` for ``flow.version`` (older versions are stale). Both
    simulation engines drive this one piece of arithmetic."""

    @staticmethod
    def _settle(flows: set[Flow], now: float) -> None:
        for f in flows:
            f.remaining -= f.rate * (now - f.last_s)
            f.last_s = now

    @staticmethod
    def _rates(flows: set[Flow]) -> list[tuple[Flow, float]]:
        out = []
        for f in flows:
            f.rate = min(p.bandwidth / len(p.flows) for p in f.ports)
            f.version += 1
            out.append((f, max(f.remaining, 0.0) / f.rate))
        return out

    @staticmethod
    def start_alone(flow: Flow, now: float) -> float:
        """``start`` for a flow alone on its ports: its seconds to completion."""
        a, b = flow.ports
        flow.last_s = now
        a.flows.add(flow)
        b.flows.add(flow)
        flow.rate = min(a.bandwidth, b.bandwidth)
        flow.version += 1
        return max(flow.remaining, 0.0) / flow.rate

    def start(self, flow: Flow, now: float) -> list[tuple[Flow, float]]:
        """Add ``flow``; returns (flow, seconds to completion) to schedule."""
        a, b = flow.ports
        if not a.flows and not b.flows:  # no one to settle or slow down
            return [(flow, self.start_alone(flow, now))]
        flow.last_s = now
        self._settle(a.flows | b.flows, now)
        a.flows.add(flow)
        b.flows.add(flow)
        return self._rates(a.flows | b.flows)

    def finish(self, flow: Flow, version: int, now: float) -> list[tuple[Flow, float]] | None:
        """Remove a completed flow; None if this wake-up is stale."""
        if version != flow.version:
            return None
        a, b = flow.ports
        a.flows.discard(flow)
        b.flows.discard(flow)
        if not a.flows and not b.flows:
            return []
        others = a.flows | b.flows
        self._settle(others, now)
        return self._rates(others)


def succeeds(event: simpy.Event) -> Callable[[simpy.Event], None]:
    """A callback that succeeds ``event`` (for another event's ``callbacks``)."""
    def callback(_fired: simpy.Event) -> None:
        event.succeed()
    return callback


def pair(a: int, b: int) -> Pair:
    return (a, b) if a < b else (b, a)


class Link:
    """One direction of a rank pair: its ports, bandwidth and slowdown."""

    __slots__ = ("ports", "bandwidth", "factor", "windows", "sigma", "noise", "outages")

    def __init__(self, ports: tuple[Port, Port], bandwidth: float, factor: float, sigma: float,
                 noise: NormalStream | None, windows: tuple[Window, ...] = (),
                 outages: tuple[Outage, ...] = ()):
        self.ports = ports
        self.bandwidth = bandwidth
        self.factor = factor  # slow_link faults for the whole run
        self.windows = windows  # slow_link faults with an onset or an end
        self.sigma = sigma  # lognormal jitter: the pair's fault and the background
        self.noise = noise
        self.outages = outages  # link_flap faults: drops a transfer waits out

    def delays_s(self, at: np.ndarray, nbytes: np.ndarray, slowdown: np.ndarray | float = 1.0
                 ) -> np.ndarray:
        """``delay_s`` over arrays of transfers."""
        at = np.asarray(at, dtype=float)
        out = np.zeros(at.shape)
        nominal = np.asarray(nbytes, dtype=float) * slowdown / self.bandwidth
        for o in self.outages:
            out = out + o.delays_s(at, nominal)
        return out

    def delay_s(self, at: float, nbytes: int, slowdown: float = 1.0) -> float:
        """What a transfer of ``nbytes`` starting at ``at`` waits out of the
        link's outages (none: 0 at once)."""
        if not self.outages:
            return 0.0
        return outage_delay(self.outages, at, nbytes * slowdown / self.bandwidth)

    def slowdown(self, at: float = 0.0) -> float:
        """Time multiplier of one use starting at ``at``: the fault factor
        (the windows holding ``at`` too) times this use's jitter."""
        factor = self.factor * factor_at(self.windows, at) if self.windows else self.factor
        if self.noise is None:
            return factor
        return factor * math.exp(self.sigma * self.noise.draw())

    @property
    def timed(self) -> bool:
        """Whether a use's slowdown depends on when it starts (slow-link windows)."""
        return bool(self.windows)

    def slowdowns(self, starts: np.ndarray) -> np.ndarray:
        """``slowdown`` of uses starting at ``starts``, in this direction's order,
        in bulk (the jitter drawn at once: the numbers one call each would give)."""
        starts = np.asarray(starts, np.float64)
        factor = np.full(starts.shape, self.factor)
        if self.windows:
            inside = np.ones(starts.shape)  # multiplied in ``factor_at``'s order
            for w in self.windows:
                inside = inside * w.factors(starts)
            factor = factor * inside
        if self.noise is None:
            return factor
        return factor * exact_exp(self.sigma * self.noise.take(starts.size)).reshape(starts.shape)


class Ring:
    """A collective group's ring: the α-β cost over its slowest edge.

    A ring all-reduce is a reduce-scatter then an all-gather (``steps`` 2),
    each (n-1)/n·S/B + A for a buffer of S bytes; B is the slowest edge's
    bandwidth (NIC-shared between nodes), A the latency of one pass: n-1 steps
    of the edge latency within a node, (k-1)·α_intra + (N-1)·α_inter for k
    members on each of N nodes."""

    __slots__ = ("n", "min_bandwidth", "edges", "latency_s", "fixed_s", "alike", "windows",
                 "outages")

    def __init__(self, n: int, min_bandwidth: float, edges: list[tuple[float, float]],
                 noise: NormalStream | None, latency_s: float, fixed_s: float | None,
                 windows: list[tuple[Window, ...]] | None = None,
                 outages: tuple[Outage, ...] = ()):
        self.n = n
        self.min_bandwidth = min_bandwidth
        # (factor, sigma) per edge; every edge with jitter draws from the group's stream
        self.edges = [(f, s, noise if s > 0 else None) for f, s in edges]
        # the timed slow-link windows of each edge (in ring order), if any edge has one
        self.windows = windows if windows and any(windows) else None
        self.latency_s = latency_s  # one pass
        self.fixed_s = fixed_s
        self.outages = outages  # of any edge: the ring waits out each it meets
        # Every edge jittered alike (the usual background): f·exp(s·z) grows with z,
        # so the worst edge is the one with the largest draw, one exp in all.
        self.alike: tuple[float, float, NormalStream] | None = None
        if (noise is not None and edges and edges[0][1] > 0 and len(set(edges)) == 1
                and self.windows is None):
            self.alike = (edges[0][0], edges[0][1], noise)

    def seconds(self, nbytes: int, steps: int = 2, at: float = 0.0) -> float:
        """``steps`` (2: all-reduce, 1: reduce-scatter or all-gather) ring
        passes of a collective starting at ``at``."""
        n = self.n
        if n == 1:
            return 0.0
        if self.alike is not None:
            factor, sigma, stream = self.alike
            worst = factor * math.exp(sigma * stream.max_of(n))
        else:
            worst = 0.0
            timed = self.windows or [()] * n
            for (f, s, z), w in zip(self.edges, timed):  # every edge's draw, in ring order
                if w:
                    f *= factor_at(w, at)
                use = f if z is None else f * math.exp(s * z.draw())
                if use > worst:
                    worst = use
        if self.fixed_s is not None:
            seconds = self.fixed_s * worst
        else:
            bw = self.min_bandwidth / worst  # as the compiled loop prices it (sim/kernel.py)
            seconds = steps * ((n - 1) / n * nbytes / bw + self.latency_s)
        return seconds + outage_delay(self.outages, at, seconds) if self.outages else seconds

    @property
    def timed(self) -> bool:
        """Whether a collective's cost depends on when it starts (slow-link windows)."""
        return self.windows is not None

    def worsts(self, count: int) -> np.ndarray:
        """The slowest edge's time multiplier of each of the next ``count``
        collectives (what ``seconds`` draws, in bulk; untimed rings only)."""
        if self.n == 1:
            return np.ones(count)
        if self.alike is not None:
            factor, sigma, stream = self.alike
            largest = stream.take(count * self.n).reshape(count, self.n).max(axis=1)
            return factor * exact_exp(sigma * largest)
        noisy = [k for k, (_f, _s, z) in enumerate(self.edges) if z is not None]
        use = np.tile(np.array([f for f, _s, _z in self.edges], np.float64), (count, 1))
        shared = self.edges[noisy[0]][2] if noisy else None  # every noisy edge draws from it
        if shared is not None and count:
            draws = shared.take(count * len(noisy)).reshape(count, len(noisy))
            sigmas = np.array([self.edges[k][1] for k in noisy])
            use[:, noisy] = use[:, noisy] * exact_exp(sigmas * draws)
        return use.max(axis=1) if self.edges else np.zeros(count)

    @property
    def random(self) -> bool:
        return any(z is not None for _f, _s, z in self.edges)

    def signature(self) -> tuple[int, float, float, float, EdgeWindows, tuple[Outage, ...]
                                 ] | None:
        """What the cost depends on, or None when it draws jitter."""
        if self.random:
            return None
        return (self.n, self.min_bandwidth, max((f for f, _s, _z in self.edges), default=1.0),
                self.latency_s, tuple(self.windows or ()), self.outages)


STEPS = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}


class Network:
    def __init__(self, env: simpy.Environment, topo: Topology, intra_gbps: float,
                 inter_gbps: float, latency_s: float, faults: JobEffects,
                 background_sigma: float, seed: int,
                 fixed_p2p_s: float | None = None, fixed_allreduce_s: float | None = None,
                 inter_latency_s: float | None = None, nics_per_node: int | None = None,
                 pod_nodes: int | None = None, oversubscription: float = 1.0):
        self.env = env
        self.topo = topo
        self.intra_bw = gbps_to_bytes_per_s(intra_gbps)
        self.inter_bw = gbps_to_bytes_per_s(inter_gbps)
        self.latency_s = latency_s  # within a node
        self.inter_latency_s = latency_s if inter_latency_s is None else inter_latency_s
        self.nics_per_node = nics_per_node
        self.pod_nodes = pod_nodes  # None: one pod, no uplinks crossed
        self.oversubscription = oversubscription
        self.faults = faults
        self.background_sigma = background_sigma
        self.seed = seed
        self.fixed_p2p_s = fixed_p2p_s
        self.fixed_allreduce_s = fixed_allreduce_s
        self._ports: dict[tuple[str, int], Port] = {}
        self._streams: dict[tuple[int, ...], NormalStream] = {}
        self._links: dict[Pair, Link] = {}
        self._rings: dict[tuple[int, ...], Ring] = {}
        self.fluid = FluidPorts()

    # ----------------------------------------------------------- pair factors
    def stream(self, stream: tuple[int, ...]) -> NormalStream:
        # One random stream per sender->receiver direction (and per collective
        # group): draws follow that stream's own program order, so timing
        # changes elsewhere never reshuffle them.
        if stream not in self._streams:
            self._streams[stream] = NormalStream(seeds.rng(self.seed, 7, *stream))
        return self._streams[stream]

    def factor_and_sigma(self, a: int, b: int) -> tuple[float, float]:
        """The a-b pair's slow-link factor and jitter sigma (fault and background)."""
        link = self.faults.link(a, b)
        return link.factor, math.hypot(link.sigma, self.background_sigma)

    def windows(self, a: int, b: int) -> tuple[Window, ...]:
        """The a-b pair's slow-link windows with an onset or an end."""
        return self.faults.link(a, b).windows

    def outages(self, a: int, b: int) -> tuple[Outage, ...]:
        """The a-b pair's drops (link flaps)."""
        return self.faults.link(a, b).outages

    def slowdown(self, a: int, b: int, stream: tuple[int, ...] | None = None,
                 at: float = 0.0) -> float:
        """Time multiplier of one use of the a-b link starting at ``at``:
        fault factor x jitter."""
        if stream is None:
            return self.link(a, b).slowdown(at)
        factor, sigma = self.factor_and_sigma(a, b)
        factor *= factor_at(self.windows(a, b), at)
        return factor * math.exp(sigma * self.stream(stream).draw()) if sigma > 0 else factor

    def link(self, src: int, dst: int) -> Link:
        """The src -> dst direction (its own jitter stream), cached."""
        key = (src, dst)
        link = self._links.get(key)
        if link is None:
            factor, sigma = self.factor_and_sigma(src, dst)
            link = self._links[key] = Link(self.ports(src, dst), self.bandwidth(src, dst),
                                           factor, sigma,
                                           self.stream(key) if sigma > 0 else None,
                                           self.windows(src, dst), self.outages(src, dst))
        return link

    def bandwidth(self, a: int, b: int) -> float:
        if self.topo.same_node(a, b):
            return self.intra_bw
        return self.inter_bw / self.oversubscription if self.crosses_pods(a, b) else self.inter_bw

    def crosses_pods(self, a: int, b: int) -> bool:
        if self.pod_nodes is None:
            return False
        return self.topo.node(a) // self.pod_nodes != self.topo.node(b) // self.pod_nodes

    def pass_latency(self, group: tuple[int, ...]) -> float:
        """One ring pass's latency: (k-1) NVLink steps and (N-1) node-to-node steps."""
        per_node = Counter(self.topo.node(r) for r in group)
        members = max(per_node.values(), default=1)
        return (members - 1) * self.latency_s + (len(per_node) - 1) * self.inter_latency_s

    def latency(self, a: int, b: int) -> float:
        return self.latency_s if self.topo.same_node(a, b) else self.inter_latency_s

    def _port(self, kind: str, rank: int, bandwidth: float) -> Port:
        key = (kind, rank)
        if key not in self._ports:
            self._ports[key] = Port(bandwidth)
        return self._ports[key]

    def ports(self, src: int, dst: int) -> tuple[Port, Port]:
        """The sender's egress and the receiver's ingress port of a transfer."""
        kind = "nvlink" if self.topo.same_node(src, dst) else "nic"
        bw = self.bandwidth(src, dst)
        return self._port(kind + "_out", src, bw), self._port(kind + "_in", dst, bw)

    # ------------------------------------------------------------- transfers
    def transfer(self, src: int, dst: int, nbytes: int) -> simpy.Event:
        """An event that fires when ``nbytes`` from src have reached dst."""
        done = self.env.event()
        link = self.link(src, dst)
        slow = link.slowdown(self.env.now)
        if self.fixed_p2p_s is not None:
            seconds = self.fixed_p2p_s * slow + link.delay_s(self.env.now, nbytes, slow)
            self.env.timeout(seconds).callbacks.append(succeeds(done))
            return done
        wait = link.delay_s(self.env.now, nbytes, slow)
        if wait > 0:  # the link is down: the flow starts once it is back (and retried)
            self.env.timeout(wait).callbacks.append(
                lambda _e: self._start_flow(link, nbytes * slow, done, src, dst))
            return done
        self._start_flow(link, nbytes * slow, done, src, dst)
        return done

    def _start_flow(self, link: Link, size: float, done: simpy.Event, src: int, dst: int) -> None:
        """``size`` bytes (slowdown applied) from src to dst; ``done`` fires on delivery."""
        latency = self.latency(src, dst)

        def delivered() -> None:
            self.env.timeout(latency).callbacks.append(succeeds(done))

        if size <= 0:
            delivered()
            return
        self._schedule(self.fluid.start(Flow(size, link.ports, delivered), self.env.now))

    def _schedule(self, etas: list[tuple[Flow, float]]) -> None:
        for f, eta in etas:
            self.env.timeout(eta).callbacks.append(self._finisher(f, f.version))

    def _finisher(self, flow: Flow, version: int) -> Callable[[simpy.Event], None]:
        return lambda _fired: self._finish(flow, version)

    def _finish(self, flow: Flow, version: int) -> None:
        etas = self.fluid.finish(flow, version, self.env.now)
        if etas is None:
            return  # a stale wake-up: the flow's rate changed since
        self._schedule(etas)
        assert flow.on_done is not None
        flow.on_done()

    # ------------------------------------------------------------ collectives
    def ring(self, group: tuple[int, ...]) -> Ring:
        """The ring of a collective group (edges in group order), cached."""
        ring = self._rings.get(group)
        if ring is None:
            n = len(group)
            edges = [(group[i], group[(i + 1) % n]) for i in range(n)]
            fs = [self.factor_and_sigma(a, b) for a, b in edges]
            noisy = any(s > 0 for _f, s in fs)
            ring = self._rings[group] = Ring(
                n, min((self._ring_bandwidth(group, a, b) for a, b in edges), default=math.inf),
                fs, self.stream((n, *group)) if noisy else None,
                self.pass_latency(group), self.fixed_allreduce_s,
                [self.windows(a, b) for a, b in edges],
                tuple(o for p in sorted({pair(a, b) for a, b in edges if a != b})
                      for o in self.outages(*p)))
        return ring

    def ring_allreduce_s(self, group: tuple[int, ...], nbytes: int) -> float:
        """2(n-1)/n·S/B + 2(n-1)·α over the ring's slowest edge."""
        return self.ring_collective_s("all_reduce", group, nbytes)

    def ring_collective_s(self, kind: str, group: tuple[int, ...], nbytes: int) -> float:
        """A ``kind`` collective over ``group`` (see ``Ring``)."""
        return self.ring(group).seconds(nbytes, STEPS[kind], self.env.now)

    def _ring_bandwidth(self, group: tuple[int, ...], a: int, b: int) -> float:
        if self.topo.same_node(a, b) or self.nics_per_node is None:
            return self.bandwidth(a, b)
        per_node: dict[int, int] = {}
        for r in group:
            per_node[self.topo.node(r)] = per_node.get(self.topo.node(r), 0) + 1
        return self.bandwidth(a, b) * min(min(per_node.values()), self.nics_per_node)
