"""Connected components of ranks tied by edges: the one union-find of MegaScan
(stage peers tied by TP/DP collectives, clocks tied by transfers), done by
networkx."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def component_labels(ranks: Sequence[int] | np.ndarray, a: np.ndarray, b: np.ndarray
                     ) -> np.ndarray:
    """Per rank of ``ranks`` (ascending), a label shared by exactly the ranks
    that edges ``a[i] -- b[i]`` (ranks, every one in ``ranks``) tie together:
    the smallest rank of its component."""
    import networkx as nx  # loaded when used: commands that only read traces (query) skip it

    ranks = np.asarray(ranks, np.int64)
    edges = np.unique(np.stack([np.asarray(a, np.int64), np.asarray(b, np.int64)], axis=1),
                      axis=0)  # a collective repeats its edges every call
    graph = nx.Graph()
    graph.add_nodes_from(ranks.tolist())
    graph.add_edges_from(edges.tolist())
    label = {r: min(members) for members in nx.connected_components(graph) for r in members}
    return np.array([label[r] for r in ranks.tolist()], np.int64)


def classes_of(ranks: Sequence[int] | np.ndarray, a: np.ndarray, b: np.ndarray
               ) -> dict[int, tuple[int, ...]]:
    """rank -> every rank of its component, ascending (``component_labels``)."""
    ranks = np.asarray(ranks, np.int64)
    labels = component_labels(ranks, a, b)
    members: dict[int, list[int]] = {}
    for r, label in zip(ranks.tolist(), labels.tolist()):
        members.setdefault(label, []).append(r)
    classes = {label: tuple(m) for label, m in members.items()}
    return {r: classes[label] for r, label in zip(ranks.tolist(), labels.tolist())}
