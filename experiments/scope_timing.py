"""How long MegaScope's model object takes to open, and each analysis after it.

    python -m experiments.scope_timing [--run RUN_DIR] [--repeats N]

Without ``--run`` it first trains the tiny model as the notebook page does
(``scenarios/scope_tiny.yaml``, 300 iterations, into a temporary folder).
Then, per split (one process; 2 pipeline stages; 2 stages × 2 TP ranks): the
time from ``ms.load`` to its first ``run_with_cache``, and the median over
``--repeats`` of each analysis on the loaded model — wall seconds, and CPU
seconds of this process and the model's worker processes together. Writes
results/scope_timing.json; ``tables`` renders docs/megascope-notebook.md's table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from . import results
from .render import markdown_table

SPLITS = ((1, 1), (2, 1), (2, 2))
PROMPT = "If the value of the expression is true"
PAIR = {"clean": "the value", "corrupt": "the valve", "clean_answer": " ", "corrupt_answer": "n"}
ITERATIONS = 300


def cpu_seconds(model: Any) -> float:
    """CPU time of this process and of the model's worker processes (if split)."""
    total = time.process_time()
    tick = os.sysconf("SC_CLK_TCK")
    for proc in getattr(model.runner, "procs", []):
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def timed(model: Any, work: Callable[[], Any]) -> dict[str, float]:
    wall, cpu = time.perf_counter(), cpu_seconds(model)
    work()
    return {"wall_s": time.perf_counter() - wall, "cpu_s": cpu_seconds(model) - cpu}


def analyses(ms: Any, model: Any) -> dict[str, Callable[[], Any]]:
    return {"run_with_cache": lambda: model.run_with_cache(PROMPT),
            "logit_lens": lambda: ms.logit_lens(model, PROMPT),
            "patching per position": lambda: ms.activation_patching(model, **PAIR),
            "patching per head": lambda: ms.activation_patching(model, **PAIR, per="head"),
            "direct logit attribution": lambda: ms.direct_logit_attribution(model, PROMPT)}


def measure_split(ms: Any, run: Path, pp: int, tp: int, repeats: int) -> dict[str, Any]:
    wall, cpu = time.perf_counter(), time.process_time()
    model = ms.load(run, pp=pp, tp=tp)
    try:
        model.run_with_cache(PROMPT)
        first = {"wall_s": time.perf_counter() - wall, "cpu_s": cpu_seconds(model) - cpu}
        each = {}
        for name, work in analyses(ms, model).items():
            times = [timed(model, work) for _ in range(repeats)]
            each[name] = {k: statistics.median(t[k] for t in times) for k in times[0]}
            print(f"pp {pp} tp {tp}: {name} {each[name]['wall_s']:.3f} s", flush=True)
    finally:
        model.close()
    print(f"pp {pp} tp {tp}: load to first cache {first['wall_s']:.1f} s", flush=True)
    return {"pp": pp, "tp": tp, "load_to_first_cache": first, "analyses": each}


def trained(folder: Path) -> Path:
    run = folder / "scope_tiny"
    print(f"training the tiny model ({ITERATIONS} iterations) into {run}", flush=True)
    subprocess.run([sys.executable, "-m", "megatronapp.cli", "run", "scenarios/scope_tiny.yaml",
                    "--backend", "torch", "--out", str(run), "--set",
                    f"iterations={ITERATIONS}", "--quiet"], check=True,
                   cwd=results.ROOT)
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.scope_timing",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, help="a run of scenarios/scope_tiny.yaml "
                        "(default: train one, 300 iterations)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each analysis (median)")
    args = parser.parse_args(argv)
    import megatronapp.scope as ms

    experiment = results.start("scope_timing", argv)
    with tempfile.TemporaryDirectory() as tmp:
        run = args.run or trained(Path(tmp))
        rows = [measure_split(ms, run, pp, tp, args.repeats) for pp, tp in SPLITS]
        iterations = json.loads((run / "checkpoint" / "checkpoint.json").read_text()).get(
            "iterations")
    path = experiment.record({"iterations": iterations, "prompt": PROMPT, "pair": PAIR,
                              "repeats": args.repeats, "splits": rows})
    print(f"wrote {path}")
    return 0


def tables(doc: dict[str, Any]) -> dict[str, str]:
    """``timing``: per split, load to first cache and each analysis after it."""
    splits = doc["data"]["splits"]
    names = list(splits[0]["analyses"])
    rows = []
    for s in splits:
        first = s["load_to_first_cache"]
        rows.append([f"pp {s['pp']} × tp {s['tp']}",
                     f"{first['wall_s']:.1f} ({first['cpu_s']:.1f})",
                     *(f"{s['analyses'][n]['wall_s']:.2f} ({s['analyses'][n]['cpu_s']:.2f})"
                       for n in names)])
    note = (f"\nSeconds, wall (CPU of all the model's processes), median of "
            f"{doc['data']['repeats']}; the tiny model trained {doc['data']['iterations']} "
            f"iterations; {doc['machine']['cpu']}, "
            f"{doc['machine']['cores']} cores, load {doc['load']['before'][0]} before; "
            f"{doc['date'][:10]}.\n")
    return {"timing": markdown_table(["split", "load to first cache", *names], rows,
                                     "l" + "r" * (len(names) + 1)) + note}


if __name__ == "__main__":
    raise SystemExit(main())
