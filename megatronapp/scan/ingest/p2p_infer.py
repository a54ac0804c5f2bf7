"""Peers for point-to-point ops a trace recorded without them, only where
the trace leaves one choice.

A trace without peers says when each rank sent and received, not to whom.
Where each rank's sends can go to one receiver only, whole ranks are paired
(``forced_pairs``): a sender and a receiver fit where the receiver has as
many receives and the n-th receive ends after the n-th send began, and the
pairs must be forced, one by one (a rank with one fitting partner left
takes it). Otherwise (a pipeline's middle stage sends both ways) each op
is matched on its own (``forced_peers``). Every send is received by
exactly one receive on another rank, and a receive cannot end before its
send began: the sends and receives form a
perfect matching in the bipartite graph of such causal pairs (per channel,
first in first out costs nothing more: crossed pairs of one channel can be
uncrossed without breaking causality). An op's peer is named only where
every such matching gives it the same peer rank. That is decided exactly
(Dulmage-Mendelsohn): an edge outside one perfect matching lies in another
one if and only if its ends share a strongly connected component of the
graph that points matched edges one way and the others back.

Two properties of training jobs make this strong enough to use. They are
assumed where the trace fits them (a job that broke them while its counts
still balanced could be matched wrongly; none of the zoo's does):

- a message is received in the profiler step (``ProfilerStep#N``) it was
  sent in: where every step's sends and receives balance, each step is
  matched on its own; otherwise the whole trace is one matching;
- the job routes its messages alike in every step: where a rank's thread
  makes as many sends (receives) in every step, its n-th send of each step
  goes to the same peer (order is a thread's program order: two threads'
  ops interleave as their timing falls), so a peer that one step rules out is ruled out for that op
  in every step, until nothing changes. A step that then has no matching
  left, or an op with no peer left, shows the job is not routed alike:
  then each op is matched on its own, in its step.

Then, where some ops still have two peers or more, each is narrowed to
the links that a forced peer proves the job used, if a matching within
them is left: an op may then be settled between two used links, never on
one the job never used, since every proven link is a real one.

A link the job never used carries no message in the true matching, so it
can never be the one peer left. Peers are named by whole messages: a send
and a receive each with one peer left, partners in a matching whose pairs
on each channel are in issue order, as a reader pairs them; so both sides
of a channel name the same messages.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping, Sequence

import networkx as nx

MAX_EDGES = 4_000_000  # causal pairs compared at most; a larger trace names no peer


@dataclass(frozen=True)
class P2POp:
    """One send or receive: its rank, when it began and ended (µs), its
    profiler step (None outside any) and the thread that issued it."""

    rank: int
    start_us: float
    end_us: float
    step: int | None = None
    lane: Hashable = None  # the thread that issued it: program order holds per thread


Peers = list[int | None]  # per op, its peer where it is forced
Key = tuple[str, int, Hashable]  # (side, rank, position): ops that share a peer
# (SEND, send index) or (RECV, receive index): integers, so that the matching
# found (networkx iterates sets of nodes) does not change with the string hash seed
SEND, RECV = 0, 1
Node = tuple[int, int]
Pair = tuple[int, int]  # (sender, receiver)


def forced_pairs(fitting: Iterable[Pair]) -> dict[int, int] | None:
    """sender -> receiver where every sender and every receiver of
    ``fitting`` gets exactly one partner and the choice is forced (then it
    is the only one); None where it is not."""
    left = set(fitting)
    senders = {r for r, _ in left}
    receivers = {s for _, s in left}
    if len(senders) != len(receivers):
        return None
    chosen: dict[int, int] = {}
    while left:
        pair = _forced(left)
        if pair is None:
            return None
        chosen[pair[0]] = pair[1]
        left = {(r, s) for r, s in left if r != pair[0] and s != pair[1]}
    return chosen if len(chosen) == len(senders) and set(chosen.values()) == receivers else None


def _forced(left: set[Pair]) -> Pair | None:
    """A pair whose sender or receiver has no other fitting partner."""
    for side in (0, 1):
        partners: dict[int, list[Pair]] = {}
        for pair in sorted(left):
            partners.setdefault(pair[side], []).append(pair)
        for pairs in partners.values():
            if len(pairs) == 1:
                return pairs[0]
    return None


def forced_peers(sends: Sequence[P2POp], recvs: Sequence[P2POp]) -> tuple[Peers, Peers]:
    """Each send's and each receive's peer where every consistent matching
    of the trace gives the same one and its partner's is named too, else
    None (module docstring)."""
    nothing: tuple[Peers, Peers] = ([None] * len(sends), [None] * len(recvs))
    batches = _batches(sends, recvs)
    if not batches or sum(len(s) * len(r) for s, r in batches) > MAX_EDGES:
        return nothing
    ranks = {op.rank for op in (*sends, *recvs)}
    for alike in (True, False):  # routed alike in every step; else each op alone
        keys = {"s": _keys("s", sends, alike), "r": _keys("r", recvs, alike)}
        allowed = {k: ranks - {k[1]} for side in keys.values() for k in side}
        if _narrow(sends, recvs, batches, keys, allowed):
            _within_proven_links(sends, recvs, batches, keys, allowed)
            return _named_messages(sends, recvs, batches, keys, allowed)
    return nothing


def _named_messages(sends: Sequence[P2POp], recvs: Sequence[P2POp],
                    batches: Sequence[tuple[list[int], list[int]]],
                    keys: Mapping[str, list[Key]], allowed: Mapping[Key, set[int]]
                    ) -> tuple[Peers, Peers]:
    """Peers of whole messages: a send and a receive with one peer each
    (each other's rank), partners once one matching's pairs of each channel
    are put in issue order. A reader pairs a channel's sends and receives
    in that order, so both sides of a channel must name the same messages."""
    send_peers: Peers = [None] * len(sends)
    recv_peers: Peers = [None] * len(recvs)
    for batch in batches:
        _, matching = _matching(sends, recvs, batch, keys, allowed)
        channels: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
        for i in batch[0]:
            j = matching[(SEND, i)][1]
            channels[(sends[i].rank, recvs[j].rank)].append((i, j))
        for (src, dst), pairs in channels.items():
            in_order = zip(sorted((sends[i].start_us, i) for i, _ in pairs),
                           sorted((recvs[j].start_us, j) for _, j in pairs))
            for (_, i), (_, j) in in_order:
                if (allowed[keys["s"][i]] == {dst} and allowed[keys["r"][j]] == {src}
                        and recvs[j].end_us >= sends[i].start_us):
                    send_peers[i], recv_peers[j] = dst, src
    return send_peers, recv_peers


def _batches(sends: Sequence[P2POp], recvs: Sequence[P2POp]) -> list[tuple[list[int], list[int]]]:
    """The ops matched together (indices of sends, of receives): each
    profiler step where every step balances, else all of them."""
    by_step: dict[int | None, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    for i, op in enumerate(sends):
        by_step[op.step][0].append(i)
    for j, op in enumerate(recvs):
        by_step[op.step][1].append(j)
    if len(sends) != len(recvs):
        return []
    if None not in by_step and all(len(s) == len(r) for s, r in by_step.values()):
        return list(by_step.values())
    return [(list(range(len(sends))), list(range(len(recvs))))]


def _keys(side: str, ops: Sequence[P2POp], alike_steps: bool = True) -> list[Key]:
    """Ops routed alike share a key (with ``alike_steps``): the n-th op of a
    rank's thread in each step, where the thread makes as many in every
    step; else each op its own. Order is taken per thread: two threads'
    ops interleave as their timing falls, which differs from step to step
    (a rank that sends one way from its main thread and the other way from
    a thread of its own)."""
    per_step: dict[tuple[int, Hashable], Counter[int | None]] = defaultdict(Counter)
    for op in ops:
        per_step[(op.rank, op.lane)][op.step] += 1
    alike = {lane for lane, counts in per_step.items()
             if alike_steps and None not in counts and len(set(counts.values())) == 1}
    seen: Counter[tuple[int, Hashable, int | None]] = Counter()
    keys: dict[int, Key] = {}
    for i in sorted(range(len(ops)), key=lambda i: (ops[i].rank, ops[i].start_us, i)):
        op = ops[i]
        seen[(op.rank, op.lane, op.step)] += 1
        thread = (op.rank, op.lane)
        position = (op.lane, op.step if thread not in alike else None,
                    seen[(op.rank, op.lane, op.step)])
        keys[i] = (side, op.rank, position)
    return [keys[i] for i in range(len(ops))]


def _within_proven_links(sends: Sequence[P2POp], recvs: Sequence[P2POp],
                         batches: Sequence[tuple[list[int], list[int]]],
                         keys: Mapping[str, list[Key]], allowed: dict[Key, set[int]]) -> None:
    """Narrow ``allowed`` further to the links some op's one peer proves
    the job used, where a matching within them is left (else unchanged):
    an op then takes one of two used links, never an unused one."""
    proven = {frozenset((k[1], next(iter(peers)))) for k, peers in allowed.items()
              if len(peers) == 1}
    within = {k: {p for p in peers if frozenset((k[1], p)) in proven}
              for k, peers in allowed.items()}
    if all(within.values()) and _narrow(sends, recvs, batches, keys, within):
        allowed.update(within)


def _narrow(sends: Sequence[P2POp], recvs: Sequence[P2POp],
            batches: Sequence[tuple[list[int], list[int]]],
            keys: Mapping[str, list[Key]], allowed: dict[Key, set[int]]) -> bool:
    """Rule out, in ``allowed``, every peer no matching of some batch gives
    an op, until nothing changes; False where a batch has no matching left
    or an op no peer."""
    changed = True
    while changed:
        changed = False
        for batch in batches:
            possible = _possible_peers(sends, recvs, batch, keys, allowed)
            if possible is None:
                return False
            for key, peers in possible.items():
                kept = allowed[key] & peers
                if not kept:
                    return False
                changed |= kept != allowed[key]
                allowed[key] = kept
    return True


def _possible_peers(sends: Sequence[P2POp], recvs: Sequence[P2POp],
                    batch: tuple[list[int], list[int]], keys: Mapping[str, list[Key]],
                    allowed: Mapping[Key, set[int]]) -> dict[Key, set[int]] | None:
    """Per key of the batch's ops, the peers some perfect matching of the
    batch gives its ops (None: no perfect matching)."""
    edges, matching = _matching(sends, recvs, batch, keys, allowed)
    if len(matching) != 2 * len(batch[0]):
        return None
    directed = nx.DiGraph()
    directed.add_nodes_from(matching)
    directed.add_edges_from((r, s) if matching[s] == r else (s, r) for s, r in edges)
    component = {n: c for c, nodes in enumerate(nx.strongly_connected_components(directed))
                 for n in nodes}
    possible: dict[Key, set[int]] = defaultdict(set)
    for s, r in edges:
        if matching[s] == r or component[s] == component[r]:
            possible[keys["s"][s[1]]].add(recvs[r[1]].rank)
            possible[keys["r"][r[1]]].add(sends[s[1]].rank)
    return possible


def _matching(sends: Sequence[P2POp], recvs: Sequence[P2POp],
              batch: tuple[list[int], list[int]], keys: Mapping[str, list[Key]],
              allowed: Mapping[Key, set[int]]) -> tuple[list[tuple[Node, Node]], dict[Node, Node]]:
    """The batch's causal pairs that ``allowed`` leaves, and a maximum
    matching of them (both ways: node -> partner)."""
    send_ids, recv_ids = batch
    edges = [((SEND, i), (RECV, j)) for i in send_ids for j in recv_ids
             if _may_pair(sends[i], recvs[j], allowed[keys["s"][i]], allowed[keys["r"][j]])]
    graph = nx.Graph(edges)
    senders: list[Node] = [(SEND, i) for i in send_ids]
    graph.add_nodes_from(senders)
    graph.add_nodes_from((RECV, j) for j in recv_ids)
    return edges, nx.bipartite.hopcroft_karp_matching(graph, top_nodes=senders)


def _may_pair(send: P2POp, recv: P2POp, send_peers: set[int], recv_peers: set[int]) -> bool:
    """The receive ends after the send began, and each side may still have
    the other's rank as its peer."""
    return recv.end_us >= send.start_us and recv.rank in send_peers and send.rank in recv_peers
