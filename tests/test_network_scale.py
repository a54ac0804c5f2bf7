"""What grows with scale in the network: a collective's per-step latency taken
hierarchically (NVLink steps within a node, one step per further node), and
pods whose uplinks are oversubscribed, so traffic between pods gets a share
of its NIC while traffic within a pod does not."""
from __future__ import annotations

from typing import Any

import pytest

from megatronapp.scenario.config import parse_scenario
from sim.cluster import build_cluster
from sim.network import Network, gbps_to_bytes_per_s

INTRA_US, INTER_US = 2.0, 10.0
LINKS = {"intra_node_gbps": 2400, "inter_node_gbps": 200,
         "intra_node_latency_us": INTRA_US, "inter_node_latency_us": INTER_US}


def network(dp: int, **cluster: Any) -> Network:
    data = {"parallel": {"dp": dp}, "cluster": {"gpus_per_node": 8, "links": LINKS, **cluster}}
    return build_cluster(parse_scenario(data)).network


@pytest.mark.parametrize("per_node,nodes", [(1, 2), (1, 16), (8, 1), (4, 4), (2, 8)])
def test_a_collectives_latency_is_one_nvlink_step_per_local_member_and_one_step_per_node(
        per_node: int, nodes: int) -> None:
    """k members on each of N nodes: (k-1)·α_intra + (N-1)·α_inter per ring
    pass (a flat ring of k·N members at the inter-node latency would pay
    (k·N-1)·α_inter)."""
    net = network(8 * nodes)
    group = tuple(node * 8 + i for node in range(nodes) for i in range(per_node))
    one_pass = ((per_node - 1) * INTRA_US + (nodes - 1) * INTER_US) * 1e-6
    assert net.ring_collective_s("all_gather", group, 0) == pytest.approx(one_pass, rel=1e-12)
    assert net.ring_collective_s("all_reduce", group, 0) == pytest.approx(2 * one_pass, rel=1e-12)


def test_a_rings_latency_grows_with_its_nodes_at_a_fixed_buffer() -> None:
    """The data-parallel group of a larger job: same bytes per member, more steps."""
    times = [network(8 * n).ring_collective_s("reduce_scatter", tuple(range(0, 8 * n, 8)), 10**8)
             for n in (4, 16, 64)]
    assert times[0] < times[1] < times[2]
    assert times[2] - times[1] == pytest.approx(48 * INTER_US * 1e-6 + 10**8 * (1 / 16 - 1 / 64)
                                                / gbps_to_bytes_per_s(200), rel=1e-9)


def test_oversubscribed_uplinks_slow_only_the_traffic_between_pods() -> None:
    pods = {"network": {"pod_nodes": 2, "oversubscription": 7}}
    flat, podded = network(32), network(32, **pods)
    within, across = tuple(range(0, 16, 8)), tuple(range(0, 32, 8))  # nodes 0-1; nodes 0-3
    nbytes = 10**9
    assert podded.ring_collective_s("all_reduce", within, nbytes) == \
        flat.ring_collective_s("all_reduce", within, nbytes)
    bandwidth_s = 2 * 3 / 4 * nbytes / gbps_to_bytes_per_s(200)
    latency_s = flat.ring_collective_s("all_reduce", across, nbytes) - bandwidth_s
    assert podded.ring_collective_s("all_reduce", across, nbytes) - latency_s == pytest.approx(
        7 * bandwidth_s, rel=1e-12)
    assert podded.bandwidth(0, 8) == flat.bandwidth(0, 8)
    assert podded.bandwidth(0, 16) == pytest.approx(flat.bandwidth(0, 16) / 7)
    assert podded.bandwidth(0, 1) == flat.bandwidth(0, 1)  # NVLink


def test_without_pods_no_link_is_oversubscribed() -> None:
    net = network(1024, network={"oversubscription": 7})
    assert net.bandwidth(0, 1023) == gbps_to_bytes_per_s(200)
