"""The kernel time factor each Megatron-LM README H100 row alone would need,
without and with the pipeline step's own exchange (costs/pipeline_step.py).

One ``kernel_time_factor`` can serve rows with and without a pipeline only where
the rows, each alone, want about the same one. For every README row this
simulates the steady state (one replica) at the generation's fitted factor and
10% above it, with the pipeline exchange off (``p2p_op_us`` unset: messages move
eagerly, the model before issue 43) and on (the fitted ``p2p_op_us``), and
takes the factor at which the row's time is the published one (the time is
close to linear in the factor). The spread is the largest factor over the
smallest: over every row, without the disputed 32B row, and over the fitted rows.

    python -m experiments.matching_factor [--jobs 2]
"""
from __future__ import annotations

import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Sequence

from experiments import results
from experiments.render import markdown_table
from megatronapp.fidelity.fit import with_settings
from megatronapp.fidelity.predict import steady_state_s
from megatronapp.fidelity.published import PublishedRun, published_runs
from megatronapp.scenario.config import Scenario
from sim import simulate_iteration_times

NAME = "matching_factor"
SOURCE = "Megatron-LM README"
FACTOR = "cluster.gpu.kernel_time_factor"
MODES = {"without": {"cluster.gpu.p2p_op_us": None}, "with": {}}


def readme_rows() -> list[PublishedRun]:
    return [r for r in published_runs(results.ROOT) if r.source.startswith(SOURCE)]


def steady_s(s: Scenario) -> float:
    return steady_state_s(simulate_iteration_times(s, replica=True))


def matching(s: Scenario, published_s: float) -> float:
    """The factor at which ``s`` takes ``published_s``: linear between the fitted
    factor and 10% above it."""
    f0 = s.cluster.gpu.kernel_time_factor
    t0, t1 = steady_s(s), steady_s(with_settings(s, {FACTOR: 1.1 * f0}))
    return f0 + (published_s - t0) * 0.1 * f0 / (t1 - t0)


def row_factors(index: int) -> dict[str, Any]:
    run = readme_rows()[index]
    wall = time.perf_counter()
    q = run.scenario.parallel
    modes = MODES if q.pp > 1 else {"without": MODES["without"]}  # no exchange without stages
    factors = {mode: matching(with_settings(run.scenario, settings), run.iteration_s)
               for mode, settings in modes.items()}
    factors.setdefault("with", factors["without"])
    return {"row": run.source.rsplit(", ", 1)[-1], "tp": q.tp, "pp": q.pp, "vpp": q.vpp,
            "role": "fitted" if run.fitted else "held out", "disputed": bool(run.disputed),
            "published_s": run.iteration_s, **{f"factor_{m}": f for m, f in factors.items()},
            "wall_s": time.perf_counter() - wall}


def spreads(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    groups = {"every row": rows,
              "every row but the disputed": [r for r in rows if not r["disputed"]],
              "the fitted rows": [r for r in rows if r["role"] == "fitted"],
              "without a pipeline": [r for r in rows if r["pp"] == 1],
              "with a pipeline": [r for r in rows if r["pp"] > 1]}
    out = []
    for name, members in groups.items():
        entry: dict[str, Any] = {"group": name, "rows": len(members)}
        for mode in MODES:
            values = [r[f"factor_{mode}"] for r in members]
            entry[mode] = {"min": min(values), "max": max(values),
                           "spread": max(values) / min(values)}
        out.append(entry)
    return out


def main(argv: list[str] | None = None) -> int:
    jobs = results.jobs_option(NAME, __doc__, argv)
    run = results.start(NAME, argv)
    count = len(readme_rows())
    wall = time.perf_counter()
    rows = []
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for row in pool.map(row_factors, range(count)):
            rows.append(row)
            print(f"{row['row']}: {row['factor_without']:.3f} -> {row['factor_with']:.3f} "
                  f"({row['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    s = readme_rows()[0].scenario.cluster.gpu
    run.record({"rows": rows, "spreads": spreads(rows), "wall_s": time.perf_counter() - wall,
                "constants": {"kernel_time_factor": s.kernel_time_factor,
                              "p2p_op_us": s.p2p_op_us}})
    print("\n".join(tables(results.read(NAME)).values()))
    return 0


def tables(doc: dict[str, Any]) -> dict[str, str]:
    data = doc["data"]
    rows = [[r["row"], r["tp"], r["pp"], r["vpp"],
             r["role"] + (" (disputed)" if r["disputed"] else ""), f"{r['published_s']:.3f}",
             f"{r['factor_without']:.3f}", f"{r['factor_with']:.3f}"] for r in data["rows"]]
    table = markdown_table(["row", "tp", "pp", "vpp", "role", "published s",
                            "factor without the pipeline exchange", "factor with it"], rows,
                           "lrrrlrrr")
    groups = [[g["group"], g["rows"],
               f"{g['without']['min']:.3f}–{g['without']['max']:.3f} "
               f"({g['without']['spread']:.3f})",
               f"{g['with']['min']:.3f}–{g['with']['max']:.3f} ({g['with']['spread']:.3f})"]
              for g in data["spreads"]]
    spread = markdown_table(["rows", "n", "without: range (max/min)", "with: range (max/min)"],
                            groups, "lrll")
    return {"rows": table, "spread": spread}


if __name__ == "__main__":
    sys.exit(main())
