"""MegaScan and its baselines on the tuning set and, beside it, on the frozen
held-out set; MegaScan's thresholds and confidence fitted on the tuning set
alone (``--fit``), its calibration on both.

The tuning set: simulated trials (``--sim-trials``, and of the newer fault
kinds ``--sim-new-trials``), recorded sets of real traces (``--tuning-zoo``:
the tuning zoo, ``experiments.zoo_tuning``, and the first held-out set,
``tests/data/heldout``, which was looked at once and is tuning data since)
and kept torch-backend trials (``--real``). The held-out sets (``--heldout``,
each scored apart, named after its folder): ``tests/data/heldout2``, frozen
before the model was changed again; nothing is chosen by looking at it.

    python -m experiments.scan_accuracy --tuning-zoo tests/data/heldout \\
        [--real runs/real-trials] [--sim-trials 150] [--sim-new-trials 100] [--fit]
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from experiments import results
from experiments.render import markdown_table
from megatronapp.scan.eval import sets
from megatronapp.scan.eval.sets import LabelledRun
from megatronapp.scan.eval.trials import SIM_NEW
from megatronapp.scan.eval.tuning import (Case, Outcome, Scores, calibration_points,
                                          fit_calibration, fit_chance, fit_thresholds, outcome,
                                          outcome_of, reliability, scores)
from megatronapp.scan.evidence.detect import Detector, calibrated, op_members
from megatronapp.scan.evidence.params import Params
from megatronapp.scan.methods import DETECTORS, detector

NAME = "scan_accuracy"
FIT_NAME = "scan_fit"  # --fit: the thresholds and confidence the defaults were set to
CHANCE_NAME = "scan_chance"  # --fit-chance: chance_count, the other thresholds held
CALIBRATION_NAME = "scan_calibration"  # --fit-calibration: the confidence alone
BASELINES = tuple(m for m in DETECTORS if m != "megascan")
FIGURE = results.ROOT / "docs" / "img" / "scan_reliability.png"


@dataclass
class Scored:
    """One set's runs: MegaScan's cases, and every baseline's outcomes."""

    cases: list[Case]
    baselines: dict[str, list[Outcome]]


def score_set(runs: Iterable[LabelledRun], methods: Sequence[str], say: Any,
              megascan: bool = True) -> Scored:
    out = Scored([], {m: [] for m in methods})
    for i, run in enumerate(runs, 1):
        start = time.process_time()
        scan = run.load()
        _, pairs = op_members(scan)
        evidence: tuple = ()
        if megascan:
            detector_ = Detector(scan.gpus_per_node, scan.scenario)
            detector_.feed(scan)
            evidence = tuple(detector_.evidence())
        out.cases.append(Case(run, evidence, frozenset(pairs)))
        for m in methods:
            found = detector(m)(scan)
            out.baselines[m].append(outcome_of(run, found.root_causes, frozenset(pairs),
                                               found.slow_without_cost))
        say(f"{run.source} {i}: {run.name} ({time.process_time() - start:.1f} CPU s)")
    return out


def summary(s: Scores) -> dict[str, Any]:
    return {**asdict(s), "named_rate": s.named_rate, "false_alarm_rate": s.false_alarm_rate}


def by_category(outcomes: Sequence[Outcome]) -> dict[str, dict[str, int]]:
    """Per category of fault: runs the goals count, and each verdict's count."""
    table: dict[str, dict[str, int]] = {}
    for o in outcomes:
        if not (o.run.eligible or o.run.healthy):  # straggled healthy runs: shown, not counted
            continue
        row = table.setdefault(o.run.category, {"runs": 0})
        row["runs"] += 1
        row[o.verdict] = row.get(o.verdict, 0) + 1
        if o.wrong_link:
            row["wrong link"] = row.get("wrong link", 0) + 1
    return table


def link_goals(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Slow links named first where the trace records peers; wrong links where it does not."""
    links = [o for o in outcomes if o.run.eligible and o.run.category == "link"]
    peered = [o for o in links if o.run.records_peers]
    blind = [o for o in links if not o.run.records_peers]
    return {"with_peers": len(peered), "named_first": sum(o.verdict == "right" for o in peered),
            "flagged_first": sum(o.flagged_first for o in peered),
            "without_peers": len(blind), "wrong_link": sum(o.wrong_link for o in blind)}


def flag_goals(outcomes: Sequence[Outcome]) -> dict[str, int]:
    """With the slow-at-no-cost list after the causes: faults first in it, healthy runs flagged."""
    counted = [o for o in outcomes if o.run.eligible]
    return {"faulted_flagged_first": sum(o.flagged_first for o in counted if o.faulted),
            "healthy_flagged": sum(o.flagged for o in counted if not o.faulted)}


def calibration(cases: Sequence[Case], p: Params) -> dict[str, Any]:
    units, right = calibration_points(cases, p)
    confidence = np.array([calibrated(float(u), p) for u in units])
    ece, bins = reliability(confidence, right) if len(units) else (float("nan"), [])
    return {"ece": ece, "bins": bins, "named": int(len(units))}


def evaluate(scored: dict[str, Scored], p: Params | None) -> dict[str, Any]:
    """Per set and method, the scores (MegaScan's at ``p``; None: baselines only)."""
    out: dict[str, Any] = {}
    for name, s in scored.items():
        out[name] = {m: {**summary(scores(o)), "categories": by_category(o),
                         "links": link_goals(o), "flags": flag_goals(o)}
                     for m, o in s.baselines.items()}
        if p is not None:
            mine = [outcome(c, p) for c in s.cases]
            out[name] = {"megascan": {**summary(scores(mine)), "categories": by_category(mine),
                                      "links": link_goals(mine), "flags": flag_goals(mine),
                                      "calibration": calibration(s.cases, p)}, **out[name]}
    return out


def fit(tuning: list[Case]) -> Params:
    thresholds = fit_thresholds(tuning)
    units, right = calibration_points(tuning, thresholds.params)
    return fit_calibration(units, right, thresholds.params)


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 4.2))
    ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--", label="perfectly calibrated")
    for (name, per_set), marker in zip(data["sets"].items(), "os^v"):
        bins = per_set["megascan"]["calibration"]["bins"]
        if bins:
            conf, acc, count = zip(*bins)
            ax.plot(conf, acc, marker=marker, label=f"{name} (ECE "
                    f"{per_set['megascan']['calibration']['ece']:.3f})")
    ax.set_xlabel("confidence of a named root cause")
    ax.set_ylabel("share of them that were injected faults")
    ax.set_xlim(0, 1.02)
    ax.set_ylim(0, 1.02)
    ax.set_title("MegaScan's confidence, tuning and held-out")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def collect(args: argparse.Namespace) -> dict[str, list[LabelledRun]]:
    from backends.registry import run_function

    tuning: list[LabelledRun] = list(sets.simulated(args.sim_seed, args.sim_trials,
                                                    run_function("sim")))
    tuning += sets.simulated(args.sim_seed, args.sim_new_trials, run_function("sim"), SIM_NEW)
    for folder in args.tuning_zoo:
        tuning += sets.recorded(folder, "tuning-zoo")
    for corpus in args.real:
        tuning += sets.kept_trials(corpus)
    chosen = {"tuning": tuning}
    if not args.tuning_only:
        for folder in args.heldout:
            chosen[heldout_name(folder, len(args.heldout))] = sets.recorded(folder, "heldout")
    return chosen


def heldout_name(folder: Path, count: int) -> str:
    """A held-out set's name in the results: "held-out" when it is the only
    one, else after its folder."""
    return "held-out" if count == 1 else f"held-out {folder.name}"


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m experiments.{NAME}",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--heldout", type=Path, nargs="+", default=[Path("tests/data/heldout2")],
                        help="held-out sets (recorded folders), each scored apart")
    parser.add_argument("--tuning-zoo", type=Path, nargs="*", default=[],
                        help="recorded sets (a folder with manifest.json each) to tune on")
    parser.add_argument("--real", type=Path, nargs="*", default=[])
    parser.add_argument("--sim-trials", type=int, default=300)
    parser.add_argument("--sim-new-trials", type=int, default=0,
                        help="simulated trials of the newer fault kinds (host stalls, "
                             "intermittent throttles, link flaps, device variation)")
    parser.add_argument("--sim-seed", type=int, default=0)
    parser.add_argument("--fit", action="store_true",
                        help="fit the thresholds and the confidence on the tuning set")
    parser.add_argument("--fit-chance", action="store_true",
                        help="fit chance_count alone on the tuning set (the other "
                             "parameters held at their defaults)")
    parser.add_argument("--fit-calibration", action="store_true",
                        help="fit the confidence's calibration alone on the tuning set (the "
                             "thresholds held at their defaults)")
    parser.add_argument("--methods", nargs="*", default=list(BASELINES))
    parser.add_argument("--tuning-only", action="store_true",
                        help="leave the held-out set out (while the model is being changed)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from megatronapp.io.text import one_line_errors

    args = parser().parse_args(argv)
    return one_line_errors(f"experiments.{NAME}", lambda: run_experiment(NAME, args, True))


def run_experiment(name: str, args: argparse.Namespace, megascan: bool) -> int:
    if args.fit_chance and megascan:
        return run_chance_fit(args)
    if args.fit_calibration and megascan:
        return run_calibration_fit(args)
    fitting = args.fit and megascan
    run = results.start(FIT_NAME if fitting else name)  # the fit's record stays beside the scores

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)
    scored = {k: score_set(runs, args.methods, say, megascan) for k, runs in collect(args).items()}
    params = (fit(scored["tuning"].cases) if args.fit else Params()) if megascan else None
    data = {"params": asdict(params) if params else {}, "fitted": bool(args.fit and megascan),
            "runs": {k: len(v.cases) for k, v in scored.items()},
            "sets": evaluate(scored, params)}
    path = run.record(data)
    if megascan and not fitting:
        plot(data, FIGURE)
    print(f"wrote {path}" + (f" and {FIGURE}" if megascan and not fitting else ""))
    return 0


def tuning_cases(args: argparse.Namespace) -> list[Case]:
    """MegaScan's evidence on the tuning set alone (a fit of one part)."""
    runs = collect(argparse.Namespace(**{**vars(args), "tuning_only": True}))["tuning"]
    return score_set(runs, [], lambda text: print(text, file=sys.stderr, flush=True)).cases


def run_chance_fit(args: argparse.Namespace) -> int:
    """``--fit-chance``: chance_count fitted on the tuning set's MegaScan evidence."""
    run = results.start(CHANCE_NAME)
    cases = tuning_cases(args)
    params, rows = fit_chance(cases)
    path = run.record({"params": asdict(params), "fitted": "chance_count",
                       "runs": {"tuning": len(cases)},
                       "grid": [dict(zip(("chance_count", "named_rate", "false_alarm_rate"), r))
                                for r in rows]})
    print(f"wrote {path}")
    return 0


def run_calibration_fit(args: argparse.Namespace) -> int:
    """``--fit-calibration``: the confidence's slope and offset fitted on the
    causes MegaScan names on the tuning set, its thresholds held; the
    expected calibration error there before and after."""
    run = results.start(CALIBRATION_NAME)
    cases, before = tuning_cases(args), Params()
    params = fit_calibration(*calibration_points(cases, before), before)
    path = run.record({"params": asdict(params), "fitted": "confidence_slope, confidence_offset",
                       "runs": {"tuning": len(cases)},
                       "before": calibration(cases, before), "after": calibration(cases, params)})
    print(f"wrote {path}")
    return 0


# ------------------------------------------------------------------ tables
def _pct(k: int, n: int) -> str:
    return f"{k}/{n} ({100 * k / n:.0f}%)" if n else "-"


def tables(doc: dict[str, Any]) -> dict[str, str]:
    d = doc["data"]
    rows = []
    for set_name, per_set in d["sets"].items():
        for method, s in per_set.items():
            links = s["links"]
            rows.append([set_name, method, _pct(s["named_first"], s["faulted"]),
                         _pct(links["named_first"], links["with_peers"]),
                         str(links["wrong_link"]), _pct(s["multi_all"], s["multi"]),
                         _pct(s["false_alarms"], s["healthy"]), str(s["phantoms"])])
    accuracy = markdown_table(["set", "method", "faults named first", "slow links named first "
                               "(peers recorded)", "wrong links (no peers)",
                               "two faults: both named", "false alarms", "phantom links"],
                              rows, "llrrrrrr")
    out = {"accuracy": accuracy}
    flags = [[name, _pct(s["megascan"]["flags"]["faulted_flagged_first"], s["megascan"]["faulted"]),
              _pct(s["megascan"]["links"]["flagged_first"], s["megascan"]["links"]["with_peers"]),
              _pct(s["megascan"]["flags"]["healthy_flagged"], s["megascan"]["healthy"])]
             for name, s in d["sets"].items() if "flags" in s.get("megascan", {})]
    if flags:
        out["flags"] = markdown_table(["set", "faults first (causes, then slow at no cost)",
                                       "slow links first (peers recorded)",
                                       "healthy runs with anything listed"], flags, "lrrr")
    cal = [[name, f"{s['megascan']['calibration']['ece']:.3f}",
            str(s["megascan"]["calibration"]["named"])] for name, s in d["sets"].items()
           if "megascan" in s]
    if cal:
        out["calibration"] = markdown_table(["set", "expected calibration error",
                                             "causes named"], cal, "lrr")
    if d["params"]:
        out["params"] = markdown_table(["parameter", "value"],
                                       [[k, f"{v:.4g}" if isinstance(v, float) else str(v)]
                                        for k, v in d["params"].items()], "lr")
    return out


if __name__ == "__main__":
    sys.exit(main())
