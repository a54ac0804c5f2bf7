"""Communication priced inside a layer's time, where Megatron overlaps it with
compute (context parallelism's K/V ring, tp_comm_overlap's collectives): a
group's link, a ring collective over it, and what the compute leaves exposed."""
from __future__ import annotations

from dataclasses import dataclass

from ..scenario.config import Scenario


def span_link(s: Scenario, span: int) -> tuple[float, float]:
    """(bytes per second, latency in seconds) of the slowest hop of a group over
    ``span`` consecutive ranks: NVLink while they fit a node, else the NIC."""
    links = s.cluster.links
    if span <= s.cluster.gpus_per_node:
        gbps, latency = links.intra_node_gbps, links.intra_node_latency_us
    else:
        gbps, latency = links.inter_node_gbps, links.inter_node_latency_us
    return gbps * 1e9 / 8, (links.latency_us if latency is None else latency) * 1e-6


def ring_pass_s(nbytes: float, members: int, link: tuple[float, float]) -> float:
    """One ring pass (an all-gather or a reduce-scatter of ``nbytes`` in all):
    (n−1)/n·S/B + (n−1)·α, as the simulator's network prices it."""
    rate, latency = link
    return (members - 1) / members * nbytes / rate + (members - 1) * latency


@dataclass(frozen=True)
class Exposed:
    """Communication time per layer and microbatch that overlapping leaves visible."""

    forward_s: float = 0.0
    backward_s: float = 0.0

    def __add__(self, other: "Exposed") -> "Exposed":
        return Exposed(self.forward_s + other.forward_s, self.backward_s + other.backward_s)


def beyond(transfer_s: float, compute_s: float) -> float:
    """What a transfer overlapped with ``compute_s`` adds."""
    return max(0.0, transfer_s - compute_s)
