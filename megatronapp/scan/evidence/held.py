"""Point-to-point waiting as evidence: a pipeline stage that holds up the
others, a link that holds up its own receives.

A slowed stage of a pipeline is the one the others wait for: its
neighbours sit in their receives for its activations (downstream) and
gradients (upstream), and it rarely waits for anyone. So a stage is named
when it spent far less time in its receives than the other stages did
and its main op is slower than theirs in its fast runs (its lower quartile)
and its typical ones (a stage that is only descheduled now and then is not). No peer is needed: a trace without
``record_shapes`` says how long each rank sat in its receives, not whom
from. Like is compared with like: the first and the last stage receive
from one side only (half a middle stage's receives) and do work the middle
stages do not (the loss; in Megatron the embedding and the output layer),
so neither their receive time nor their main op says anything against the
middle stages'. Only middle stages are judged, each against the others.

A slow link delays every message over it, both ways: even the fastest
receive from posting to done takes long, where on a healthy link some
message is already there when its receive is posted. A stage that is slow
makes its receivers wait in one direction only; the other way its own
receives find their data waiting. So a link is named when its faster
direction's fastest receive is several times its link class's. This needs
peers (``record_shapes``, or a trace that records them): a link is never
named between ranks that exchanged no message.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import numpy as np

from megatronapp.scan.diagnosis import RootCause
from megatronapp.scan.evidence.judge import link_class, medians_without_each
from megatronapp.scan.evidence.waits import Compute, WaitScores, best_ratio

Pair = tuple[int, int]


@dataclass(frozen=True)
class HeldThresholds:
    min_stages: int = 2  # middle stages to compare
    middle_share: float = 0.75  # a middle stage posts at least this share of the most receives
    held_share: float = 0.9  # its receive time at most this share of the others' median
    # its main op's fast runs (the lower quartile: with two middle stages one
    # other's 10th percentile is too thin a tail to judge by) and typical
    # run, each this many times the others'
    best_quantiles: tuple[float, ...] = (25.0, 50.0)
    best_ratio: float = 1.2
    min_transfers: int = 4  # receives per direction to judge a link
    hold_ratio: float = 3.0  # a link's fastest receive this many times its class's
    min_hold_s: float = 1e-3  # ... and at least this long


@dataclass(frozen=True)
class StageHold:
    rank: int
    receive_s: float
    others_receive_s: float  # the median of the other stages'
    best_ratio: float


def holding_stages(scores: WaitScores, compute: Compute, peers: Mapping[int, Sequence[int]],
                   th: HeldThresholds = HeldThresholds()) -> list[StageHold]:
    """Middle stages the other middle stages waited for (see the module's
    docstring), among the stages alone in their stage (``peers``: rank ->
    the ranks doing its work; a rank with such peers is compared with them)."""
    stages = middle_stages(scores, peers, th)
    if len(stages) < th.min_stages:
        return []
    receiving = scores.receiving
    out = []
    for r in stages:
        others = float(np.median([receiving[o] for o in stages if o != r]))
        ratio = min(best_ratio(r, stages, compute, q) for q in th.best_quantiles)
        if receiving[r] <= th.held_share * others and ratio >= th.best_ratio:
            out.append(StageHold(r, receiving[r], others, ratio))
    return out


def middle_stages(scores: WaitScores, peers: Mapping[int, Sequence[int]],
                  th: HeldThresholds = HeldThresholds()) -> list[int]:
    """Stages alone in their stage that receive from both sides: they post
    nearly as many receives as any stage (an end stage, about half)."""
    alone = [r for r, s in scores.receiving.items() if s > 0 and len(peers.get(r, (r,))) == 1]
    most = max((scores.receives.get(r, 0) for r in alone), default=0)
    return sorted(r for r in alone if scores.receives.get(r, 0) >= th.middle_share * most)


def held_links(scores: WaitScores, gpus_per_node: int,
               th: HeldThresholds = HeldThresholds()) -> list[RootCause]:
    """Links whose fastest receive, in the faster direction, is slow against
    the other links of its class (see the module's docstring)."""
    floors = _pair_floors(scores, th)
    centres = _class_centres(floors, gpus_per_node)
    causes = []
    for pair, (floor, transfers) in sorted(floors.items()):
        if pair not in centres:
            continue  # a class needs others to judge against
        centre = centres[pair]
        if floor >= th.min_hold_s and floor >= th.hold_ratio * centre:
            ratio = floor / max(centre, 1e-9)
            causes.append(RootCause(pair[0], "link", pair[1], ratio / (ratio + th.hold_ratio), {
                "problem": "slow", "transfers": transfers, "receive_floor_s": round(floor, 6),
                "class_receive_floor_s": round(centre, 6)}))
    return causes


def _class_centres(floors: Mapping[Pair, tuple[float, int]], gpus_per_node: int
                   ) -> dict[Pair, float]:
    """Per pair of a link class with two others or more, the median of the
    others' floors (one sort per class, not one pass over every pair per pair)."""
    classes: dict[bool, list[Pair]] = {}
    for pair in floors:
        classes.setdefault(link_class(pair, gpus_per_node), []).append(pair)
    out: dict[Pair, float] = {}
    for pairs in classes.values():
        if len(pairs) > 2:
            others = medians_without_each(np.array([floors[p][0] for p in pairs]))
            out.update(zip(pairs, others.tolist()))
    return out


def _pair_floors(scores: WaitScores, th: HeldThresholds) -> dict[Pair, tuple[float, int]]:
    """Unordered pair -> (its faster direction's fastest receive, its
    transfers both ways), for pairs with enough receives each way."""
    by_pair: dict[Pair, list[tuple[float, int]]] = {}
    for c in scores.channels:
        if c.transfers >= th.min_transfers:
            pair = (min(c.sender, c.receiver), max(c.sender, c.receiver))
            by_pair.setdefault(pair, []).append((c.fastest_receive_s, c.transfers))
    return {p: (min(f for f, _ in ways), sum(n for _, n in ways))
            for p, ways in by_pair.items() if len(ways) == 2}


def with_held(causes: Sequence[RootCause], scores: WaitScores, compute: Compute,
              peers: Mapping[int, Sequence[int]], gpus_per_node: int,
              th: HeldThresholds = HeldThresholds(), name_stages: bool = True) -> list[RootCause]:
    """``causes`` with the links that held their receives (in place of an
    erratic verdict on the same link, which its waits' spread gave; not of a
    slow one) and the stages the others waited for (unless a named link of
    theirs explains it): a compute cause already on such a stage gains the
    evidence, else (``name_stages``) the stage is one on the waits and its
    main op. Where the run says what work each stage models, the detector
    compares stages by speed per modelled work and passes ``name_stages``
    False: on real runs of this project's pipelines a middle stage's main op
    alone swung 1.24-1.39x on healthy runs under load, and named none that
    the other rules missed."""
    held = {frozenset((c.rank, c.peer)): c for c in held_links(scores, gpus_per_node, th)}
    named = {frozenset((c.rank, c.peer)) for c in causes if c.kind == "link"}
    out = [held.get(frozenset((c.rank, c.peer)), c)
           if c.kind == "link" and c.evidence.get("problem") != "slow" else c for c in causes]
    out += [c for pair, c in held.items() if pair not in named]
    holds = holding_stages(scores, compute, peers, th)
    if name_stages and holds:  # a held stage paces every receive after it
        out = [c for c in out if not _rests_on_waiting(c)]
    linked = {r for c in out if c.kind == "link" for r in (c.rank, c.peer)}
    for hold in holds:
        if hold.rank in linked:
            continue
        evidence = {"held_stages": {"receive_s": round(hold.receive_s, 6),
                                    "others_receive_s": round(hold.others_receive_s, 6),
                                    "best_ratio": round(hold.best_ratio, 3)},
                    "rests_on": ["compute", "waits"]}
        confidence = hold.best_ratio / (hold.best_ratio + th.best_ratio)
        mine = [i for i, c in enumerate(out) if c.kind == "compute" and c.rank == hold.rank]
        if mine:
            c = out[mine[0]]
            out[mine[0]] = replace(c, confidence=max(c.confidence, confidence),
                                   evidence={**c.evidence, **evidence})
        elif name_stages:
            out.append(RootCause(hold.rank, "compute", None, confidence, evidence))
    return out


def _rests_on_waiting(cause: RootCause) -> bool:
    """A link named from how its receives waited (its deliveries, or its
    fastest receive), not from how long its transfers took per byte."""
    return cause.kind == "link" and "bandwidth_ratio" not in cause.evidence
