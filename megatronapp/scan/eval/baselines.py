"""Baseline detectors, each with the detector signature ``(ScanInput) -> Diagnosis``.
They read the input's per-event view (``ScanInput.events`` / ``ScanInput.ops``)."""
from __future__ import annotations

from collections import defaultdict
from typing import Hashable, Iterable

import numpy as np

from megatronapp.trace.events import Event
from megatronapp.trace.kinds import event_kind

from megatronapp.scan.align.components import classes_of
from megatronapp.scan.diagnosis import Diagnosis, RootCause, ranked
from megatronapp.scan.align.inputs import ScanInput

NVIDIA_THRESHOLD = 0.75  # relative performance score below which a rank is a straggler
HTA_MIN_SHARE = 0.5  # a "consistent" latest arrival: last at more than half the instances
ORIG_SLOW, ORIG_FAST = 1.1, 0.9  # MegatronApp's thresholds against the peer mean
ORIG_MIN_FLAGS = 5
ORIG_SLOW_COLLECTIVE_SHARE = 0.4


def compute_table(events: Iterable[Event]) -> dict[tuple[Hashable, ...], float]:
    """op key (name, iteration, microbatch, chunk, occurrence) -> duration."""
    seen: dict[tuple[Hashable, ...], int] = defaultdict(int)
    table: dict[tuple[Hashable, ...], float] = {}
    for e in events:
        if e.dur_s <= 0 or event_kind(e.name, e.args) != "compute":
            continue
        base = (e.name, e.args.get("iteration"), e.args.get("microbatch"), e.args.get("chunk"))
        table[base + (seen[base],)] = e.dur_s
        seen[base] += 1
    return table


def slowest_mean(scan: ScanInput) -> Diagnosis:
    """Naive: the rank whose ops take longest on average is the culprit."""
    means = {r: float(np.mean([e.dur_s for e in ev])) for r, ev in scan.events.items() if ev}
    if not means:
        return Diagnosis()
    worst = max(means, key=lambda r: means[r])
    ratio = means[worst] / float(np.median(list(means.values())))
    return Diagnosis((RootCause(worst, "compute", None, min(1.0, ratio - 1.0),
                                {"mean_op_s": means[worst]}),))


def nvidia_relative(scan: ScanInput) -> Diagnosis:
    """NVIDIA straggler-detector style: compute kernels only, each rank's
    per-kernel time against the best rank's; score < 0.75 is a straggler."""
    per_name: dict[str, dict[int, float]] = defaultdict(dict)
    for r, ev in scan.events.items():
        durations: dict[str, list[float]] = defaultdict(list)
        for key, dur in compute_table(ev).items():
            durations[str(key[0])].append(dur)
        for name, ds in durations.items():
            per_name[name][r] = float(np.median(ds))
    scores: dict[int, list[float]] = defaultdict(list)
    for by_rank in per_name.values():
        best = min(by_rank.values())
        for r, d in by_rank.items():
            scores[r].append(best / d if d > 0 else 1.0)
    causes = [RootCause(r, "compute", None, 1.0 - float(np.mean(s)),
                        {"relative_score": round(float(np.mean(s)), 3)})
              for r, s in scores.items() if np.mean(s) < NVIDIA_THRESHOLD]
    return Diagnosis(ranked(causes))


def hta_latest_arrival(scan: ScanInput) -> Diagnosis:
    """HTA style: at the collective that takes the most time, the rank that
    most often arrives last (if it does so at most instances) is the straggler."""
    total: dict[str, float] = defaultdict(float)
    collectives = [op for op in scan.ops if op.kind == "collective" and len(op.members) > 1]
    for op in collectives:
        total[op.name] += sum(scan.events[r][i].dur_s for r, i in op.members)
    if not total:
        return Diagnosis()
    dominant = max(total, key=lambda n: total[n])
    last: dict[int, int] = defaultdict(int)
    joined: dict[int, int] = defaultdict(int)
    for op in collectives:
        if op.name != dominant:
            continue
        last[max((scan.events[r][i].start_s, r) for r, i in op.members)[1]] += 1
        for r in op.ranks:
            joined[r] += 1
    worst = max(last, key=lambda r: last[r] / joined[r])
    share = last[worst] / joined[worst]
    if share <= HTA_MIN_SHARE:
        return Diagnosis()
    return Diagnosis((RootCause(worst, "compute", None, share,
                                {"collective": dominant, "last_share": round(share, 3)}),))


STAGE_PEER_WORDS = ("tp", "dp", "tensor", "data")  # collectives among ranks doing identical work


def stage_peers(scan: ScanInput) -> dict[int, tuple[int, ...]]:
    """rank -> the ranks its TP and DP collectives (by name) join it with."""
    a: list[int] = []
    b: list[int] = []
    for op in scan.ops:
        if op.kind == "collective" and op.name.lower().split("_")[0] in STAGE_PEER_WORDS:
            ranks = op.ranks
            a += ranks[:-1]
            b += ranks[1:]
    return classes_of(sorted(scan.events), np.array(a, np.int64), np.array(b, np.int64))


def _slow_flags(scan: ScanInput) -> dict[int, int]:
    """Compute ops slower than 1.1x the mean of the same op on the stage peers."""
    tables = {r: compute_table(ev) for r, ev in scan.events.items()}
    peers = stage_peers(scan)
    lonely = tuple(sorted(r for r, p in peers.items() if len(p) == 1))
    flags: dict[int, int] = defaultdict(int)
    for r, table in tables.items():
        group = peers[r] if len(peers[r]) > 1 else lonely
        for key, dur in table.items():
            others = [tables[p][key] for p in group if p != r and key in tables[p]]
            if others and dur > ORIG_SLOW * float(np.mean(others)):
                flags[r] += 1
    return flags


def _fast_collective_share(scan: ScanInput) -> dict[int, float]:
    """Share of a rank's collectives it spent under 0.9x the group mean: it
    arrived late, so it waited least."""
    fast: dict[int, int] = defaultdict(int)
    joined: dict[int, int] = defaultdict(int)
    for op in scan.ops:
        if op.kind != "collective" or len(op.members) < 2:
            continue
        durs = {r: scan.events[r][i].dur_s for r, i in op.members}
        mean = float(np.mean(list(durs.values())))
        for r, d in durs.items():
            joined[r] += 1
            fast[r] += d < ORIG_FAST * mean
    return {r: fast[r] / n for r, n in joined.items()}


def megatronapp_original(scan: ScanInput) -> Diagnosis:
    """The released thresholds: more than 5 slow ops (1.1x the peer mean) make
    a candidate; it is a root cause if over 40% of its collectives are short."""
    share = _fast_collective_share(scan)
    causes = [RootCause(r, "compute", None, min(1.0, n / 100),
                        {"slow_ops": n, "late_collective_share": round(share.get(r, 1.0), 3)})
              for r, n in _slow_flags(scan).items()
              if n > ORIG_MIN_FLAGS and share.get(r, 1.0) > ORIG_SLOW_COLLECTIVE_SHARE]
    return Diagnosis(ranked(causes))
