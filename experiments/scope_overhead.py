"""MegaScope's capture overhead on the torch backend, and the simulator's prediction.

1. Calibrate the capture cost model's constants on this machine (one process,
   CPU time): the work of one capturing hook beside its statistics, the
   statistics' throughput, host work per row.
2. Train the tiny model (scenarios/scope_tiny.yaml: 2 pipeline ranks, gloo)
   in interleaved rounds of five arms: hooks absent, hooks installed but
   idle, active at every step, active every 10th step (per token), active
   every 10th step pooled over tokens (one row per site). Each run has W warm-up
   iterations and M measured ones; per iteration, wall time (rank 0's clock)
   and CPU time (both ranks' process time), and each rank's peak RSS.
3. Overhead of each arm against "absent": the ratio of mean iteration times
   minus one (the amortised cost: a capture every 10th step shows in the
   mean, not in the median iteration), reported as the median and 95%
   interval of a hierarchical bootstrap (rounds, then iterations); beside it
   the median iteration time of each arm.
4. The simulator on the same scenario, its compute costs set to the measured
   "absent" medians, the capture constants (a) as calibrated in isolation,
   (b) scaled by one factor fitted on the measured "every step" arm (what
   contention between ranks, writer threads and the machine's other load adds
   to each unit of capture work): its predicted overheads against the
   measured ones, the fitted arm itself excluded from the error.

    python -m experiments.scope_overhead [--rounds 4] [--warmup 20] [--measured 50]
    python -m experiments.scope_overhead --reuse   # the last runs, calibration and simulation again

With ``--gpu`` (a CUDA GPU): the same interleaved rounds on one rank (NCCL,
world size 1) training scenarios/scope_overhead_gpu.yaml, a model that keeps
the GPU busy, without the idle arm, the CPU calibration or the simulator;
wall time per iteration is the GPU's (CUDA events at the optimizer step),
beside each run's peak GPU memory:

    python -m experiments.scope_overhead --gpu --rounds 8 --warmup 5 --measured 20
    python -m experiments.scope_overhead --gpu --reuse experiments/data/scope_overhead_gpu_h200.json

Prints markdown tables and writes runs/scope_overhead.json
(``scope_overhead_gpu.json`` with ``--gpu``). ``--reuse [JSON]`` reads the
runs of a saved measurement (default: that file) instead of running any.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np

from experiments import results as results_file
from experiments.render import markdown_table
from megatronapp.scenario.config import Scenario, load_scenario, parse_scenario
from megatronapp.run.jobs import StagesFor, rank_programs
from megatronapp.parallel.ops import Compute, RankProgram

ROOT = Path(__file__).resolve().parents[1]
NAME = "scope_overhead"
SCENARIO = ROOT / "scenarios" / "scope_tiny.yaml"
GPU_SCENARIO = ROOT / "scenarios" / "scope_overhead_gpu.yaml"
STATS = ["mean", "std", "absmax", "pixels_absmax(8)"]
# what the slides measured in training: Q, K, V, MLP1, MLP2 (+ the residual stream)
OBSERVE: list[dict[str, Any]] = [{"site": site, "stats": STATS} for site in ("attn.q", "attn.k", "attn.v",
                                                        "mlp.pre", "mlp.post", "resid_post")]
OBSERVE.append({"site": "attn.probs", "stats": ["entropy", "prev_token_mass", "sink_mass"]})
ARMS: dict[str, tuple[int, str] | None] = {
    "absent": None, "idle": (10 ** 9, "all"), "every step": (1, "all"),
    "every 10th step": (10, "all"), "every 10th step, pooled": (10, "pooled")}
GPU_ARMS = {arm: every for arm, every in ARMS.items() if arm != "idle"}


# ------------------------------------------------------------ cpu marks
def _peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM; ru_maxrss survives exec on Linux,
    so a spawned rank would report its parent's peak)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _peak_gpu_mb() -> float:
    """This process's peak GPU memory held by torch's allocator (0 without CUDA)."""
    import torch

    return torch.cuda.max_memory_allocated() / 2 ** 20 if torch.cuda.is_available() else 0.0


def _stamp(meta: dict[str, Any]) -> None:
    meta.update(cpu_s=time.process_time(), rss_mb=_peak_rss_mb(), gpu_mb=_peak_gpu_mb())


def _marked(program: RankProgram) -> RankProgram:
    """The program, plus a CPU-time stamp after each optimizer step (the event's
    arguments are copied after ``run``, so the stamp lands in the trace)."""
    op: Any = next(program, None)
    while op is not None:
        result = yield op
        if isinstance(op, Compute) and op.name == "optimizer":
            meta = {"iteration": op.meta["iteration"]}
            yield Compute("cpu_mark", 0.0, run=partial(_stamp, meta), meta=meta)
        try:
            op = program.send(result)
        except StopIteration:
            op = None


def marked_programs(s: Scenario, stages_for: StagesFor) -> dict[int, RankProgram]:
    return {r: _marked(p) for r, p in rank_programs(s, stages_for).items()}


# ------------------------------------------------------------ scenarios
def arm_scenario(base: Scenario, arm: tuple[int, str] | None, iterations: int) -> Scenario:
    """The tiny model's scenario observing OBSERVE every ``arm[0]`` steps, per
    token ("all") or one row per site ("pooled"; statistics that need tokens
    dropped), or nothing (None)."""
    data = base.model_dump(mode="json")
    data.update(iterations=iterations, training={**data["training"], "checkpoint": False})
    if arm is None:
        data["scope"] = None
        return parse_scenario(data)
    every, tokens = arm
    observe = [{**o, "every_n_steps": every, "tokens": tokens} for o in OBSERVE]
    if tokens == "pooled":
        observe = [{**o, "stats": [x for x in o["stats"] if not x.startswith("pixels")]}
                   for o in observe if o["site"] != "attn.probs"]
    data["scope"] = {"observe": observe,
                     "cost": data["scope"]["cost"] if data.get("scope") else {}}
    return parse_scenario(data)


def run_arm(s: Scenario, warmup: int) -> dict[str, Any]:
    from backends.torch.launch import spawn_run
    from backends.torch.scope_run import finalize
    from backends.torch.stages import TrainOptions

    with tempfile.TemporaryDirectory() as work:
        run, _ = spawn_run(s, TrainOptions(optimizer=s.training.optimizer, lr=s.training.lr,
                                           workdir=work), programs=marked_programs)
        assert run.training is not None, "a torch run's result has its training section"
        capture, _ = finalize(s, Path(work), run.training.loss_per_iteration)
    marks = {r: sorted((e for e in evs if e.name == "cpu_mark"),
                       key=lambda e: e.args["iteration"]) for r, evs in run.events.items()}
    wall = np.diff([e.start_s for e in marks[0]])[warmup - 1:]
    cpu = np.sum([np.diff([e.args["cpu_s"] for e in m])[warmup - 1:] for m in marks.values()],
                 axis=0)
    fwd = [e.dur_s for evs in run.events.values() for e in evs if e.name == "forward"
           and e.args["iteration"] >= warmup]
    bwd = [e.dur_s for evs in run.events.values() for e in evs if e.name == "backward"
           and e.args["iteration"] >= warmup]
    opt = [e.dur_s for evs in run.events.values() for e in evs if e.name == "optimizer"
           and e.args["iteration"] >= warmup]
    return {"wall_s": wall.tolist(), "cpu_s": list(map(float, cpu)),
            "peak_rss_mb": max(m[-1].args["rss_mb"] for m in marks.values()),
            "peak_gpu_mb": max(m[-1].args["gpu_mb"] for m in marks.values()),
            "dropped": capture.dropped_records if capture is not None else 0,
            "forward_s": statistics.median(fwd), "backward_s": statistics.median(bwd),
            "optimizer_s": statistics.median(opt)}


# ------------------------------------------------------------ statistics
def overhead_ci(arm: list[list[float]], base: list[list[float]], rng: np.random.Generator,
                n: int = 2000) -> tuple[float, float, float]:
    """Mean iteration time of ``arm`` over ``base`` minus one: the median and the
    95% interval of a hierarchical bootstrap (the same rounds for both arms,
    then iterations within each run)."""
    draws = []
    for _ in range(n):
        pick = rng.integers(0, len(arm), len(arm))
        a = np.concatenate([rng.choice(arm[i], len(arm[i])) for i in pick])
        b = np.concatenate([rng.choice(base[i], len(base[i])) for i in pick])
        draws.append(a.mean() / b.mean() - 1)
    lo, mid, hi = np.percentile(draws, [2.5, 50, 97.5])
    return float(mid), float(lo), float(hi)


# ------------------------------------------------------------ calibration
def calibrate(base: Scenario) -> dict[str, float]:
    """The cost model's constants, measured in this process on the same model."""
    import torch

    from backends.torch.scope import RankPlace, session_for
    from backends.torch.scope_generate import one_rank
    from megatronapp.scope import stats
    from megatronapp.scope.cost import model_shape
    from megatronapp.scope.storage import PartWriter
    from megatronapp.scenario.scope_spec import parse_stat

    torch.set_num_threads(1)
    specs = tuple(parse_stat(s) for s in STATS)
    reduce_pts = []
    for rows, cols in [(256, 32), (512, 128), (1024, 512), (512, 2048)]:
        x = torch.randn(rows, cols)
        t = _median_time(lambda: stats.partials(x, specs, stats.Slice(0, cols)), 30)
        reduce_pts.append((rows * cols * 4 * (1 + len(specs)), t))
    slope = float(np.polyfit([b for b, _ in reduce_pts], [t for _, t in reduce_pts], 1)[0])
    with tempfile.TemporaryDirectory() as tmp:
        writer = PartWriter(Path(tmp), 0)
        host_pts = []
        for rows in (64, 512, 4096):
            x = torch.randn(rows, 128)
            rec = _host_record(stats.partials(x, specs, stats.Slice(0, 128)).numpy(), specs, rows)
            host_pts.append((rows * len(specs), _median_time(lambda: writer.write([rec], []), 10)))
        per_row = float(np.polyfit([r for r, _ in host_pts], [t for _, t in host_pts], 1)[0])
    m = base.model
    single = {**base.model_dump(mode="json"), "parallel": {}}
    spec = parse_scenario({**single, "scope": {"observe": [
        {"site": "resid_post", "tokens": [0], "stats": ["max"]}]}}).scope
    assert spec is not None
    with one_rank():
        session = session_for(spec, model_shape(base), 0,
                              RankPlace(0, 1, 0, 0, torch.device("cpu")), None, live=False)
        obs = spec.observe[0]
        x = torch.randn(m.seq_len, m.micro_batch_size, m.hidden)

        def hook() -> None:  # what one capturing hook does beyond its statistics
            with session.task("forward", 0, 0):
                for _ in range(100):
                    session._observe(obs, "resid_post", 1, "sbh", x)
            session._pending.records.clear()
        per_hook = _median_time(hook, 20) / 100
    return {"hook_us": per_hook * 1e6, "reduce_gbps": 1 / slope / 1e9,
            "host_us_per_row": per_row * 1e6, "d2h_gbps": 1000.0, "host_overlaps": False}


def _host_record(partial: np.ndarray, specs: tuple[Any, ...], rows: int) -> Any:
    from megatronapp.scope import stats
    from megatronapp.scope.storage import HostRecord, RecordKey, Rows

    r = np.arange(rows)
    return HostRecord(RecordKey(0, 0, 0, 1, "resid_post"), Rows(r * 0, r * 0 - 1, r),
                      tuple(s.label for s in specs), tuple(stats.widths(specs, 128)), partial)


def _median_time(fn: Any, repeats: int) -> float:
    """Median CPU seconds of ``fn`` (this process's CPU time: robust to the
    descheduling a loaded machine inflicts on wall time)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


# ------------------------------------------------------------ simulator
def sim_costs(base: Scenario, measured: dict[str, float]) -> dict[str, float]:
    """The measured per-chunk compute medians, and a point-to-point time fitted
    so that the simulated baseline iteration equals the measured one."""
    from sim import run_sim
    from megatronapp.trace.summary import iteration_times

    costs = {"forward_s": measured["forward_s"], "backward_s": measured["backward_s"],
             "optimizer_s": measured["optimizer_s"], "allreduce_s": 0.0}

    def iteration(p2p: float) -> float:
        s = _with(base, None, {**costs, "p2p_s": p2p}, 4)
        return float(np.mean(iteration_times(run_sim(s).events)))

    t0, t1 = iteration(0.0), iteration(1e-3)
    p2p = max(0.0, (measured["wall_s"] - t0) / (t1 - t0) * 1e-3)
    return {**costs, "p2p_s": p2p, "simulated_baseline_s": iteration(p2p)}


def _with(base: Scenario, every: tuple[int, str] | None, costs: dict[str, float], iterations: int,
          calibrated: dict[str, Any] | None = None) -> Scenario:
    data = arm_scenario(base, every, iterations).model_dump(mode="json")
    data["costs"] = {k: v for k, v in costs.items() if k != "simulated_baseline_s"}
    data["cluster"] = {**data["cluster"], "jitter": {"compute_sigma": 0, "link_sigma": 0}}
    if calibrated is not None:
        data["scope"]["cost"] = calibrated
    return parse_scenario(data)


def predicted(base: Scenario, every: tuple[int, str], calibrated: dict[str, Any],
              costs: dict[str, float]) -> dict[str, float]:
    from sim import simulate as run_sim_scenario

    from megatronapp.trace.sections import ScopeOverhead

    overhead = run_sim_scenario(_with(base, every, costs, 20, calibrated)).scope
    assert isinstance(overhead, ScopeOverhead), "a simulated capture predicts its overhead"
    return asdict(overhead)


def measure(base: Scenario, args: Any, arms: dict[str, tuple[int, str] | None],
            keep: Callable[[dict[str, list[dict[str, Any]]]], object]
            ) -> dict[str, list[dict[str, Any]]]:
    """Interleaved rounds of every arm; ``keep`` saves the runs after each
    one (a measurement cut short keeps what it finished)."""
    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    iterations = args.warmup + args.measured + 1
    for r in range(args.rounds):
        order = list(arms)[r % len(arms):] + list(arms)[:r % len(arms)]  # interleaved, rotated
        for arm in order:
            t0 = time.perf_counter()
            results[arm].append(run_arm(arm_scenario(base, arms[arm], iterations), args.warmup))
            print(f"round {r + 1}/{args.rounds}: {arm}: median "
                  f"{1e3 * statistics.median(results[arm][-1]['wall_s']):.2f} ms/iteration "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
            keep(results)
    return results


def overhead_rows(results: dict[str, list[dict[str, Any]]], rng: np.random.Generator
                  ) -> list[dict[str, Any]]:
    """Per arm: median wall and CPU time per iteration, peak memory, dropped
    records, and the overhead against "absent" (bootstrap median, 95% CI)."""
    rows = []
    base_runs = results["absent"]
    for arm, runs in results.items():
        row = {"arm": arm, "wall_ms": 1e3 * float(np.median([w for x in runs for w in x["wall_s"]])),
               "cpu_ms": 1e3 * float(np.median([c for x in runs for c in x["cpu_s"]])),
               "peak_rss_mb": max(x["peak_rss_mb"] for x in runs),
               "peak_gpu_mb": max(x.get("peak_gpu_mb", 0.0) for x in runs),
               "dropped": sum(x["dropped"] for x in runs)}
        for kind in ("wall_s", "cpu_s"):
            row[kind.split("_")[0] + "_overhead"] = overhead_ci([x[kind] for x in runs],
                                                                [x[kind] for x in base_runs], rng)
        rows.append(row)
    return rows


def gpu_machine() -> str:
    """The GPU, torch and NCCL versions the measurement ran on."""
    import torch

    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return (f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}, CUDA "
            f"{torch.version.cuda}, NCCL {nccl}; {os.cpu_count()} CPUs")


def reused(args: Any, default: Path) -> tuple[dict[str, list[dict[str, Any]]], str]:
    """The runs and machine of a saved measurement; its rounds, warm-up and
    measured iterations become ``args``'."""
    previous = json.loads(Path(args.reuse or default).read_text())
    for key in ("rounds", "warmup", "measured"):
        setattr(args, key, previous["args"][key])
    return previous["runs"], previous["machine"]


def gpu_main(args: Any, argv: list[str] | None) -> int:
    """The arms on one GPU (one rank, NCCL): measured overheads only; the
    table goes to ``results/scope_overhead.json`` (``--results-dir``)."""
    import torch

    saved = ROOT / "runs" / "scope_overhead_gpu.json"
    saved.parent.mkdir(parents=True, exist_ok=True)
    if args.reuse is not None:
        results, machine = reused(args, saved)
    elif not torch.cuda.is_available():
        print("--gpu: no CUDA GPU here", file=sys.stderr)
        return 2
    else:
        machine = gpu_machine()
        print(f"machine: {machine}", flush=True)
        results = measure(load_scenario(GPU_SCENARIO), args, GPU_ARMS,
                          lambda runs: saved.write_text(json.dumps(
                              {"runs": runs, "args": vars(args), "machine": machine}, indent=1)))
    rounds = {arm: len(runs) for arm, runs in results.items()}
    args.rounds = max(rounds.values())  # a measurement cut short says what it finished
    if len(set(rounds.values())) > 1:
        print(f"rounds finished per arm: {rounds}")
    rows = overhead_rows(results, np.random.default_rng(args.seed))
    setting = f"torch backend, NCCL, 1 rank on {machine.split(';')[0]} ({GPU_SCENARIO.name})"
    print_measured(rows, args, setting)
    recorded = results_file.start(NAME, argv).record(
        {"gpu": {"setting": setting, "machine": machine, "rounds": args.rounds,
                 "warmup": args.warmup, "measured": args.measured, "rows": rows}},
        root=Path(args.results_dir))
    print(f"wrote {recorded}")
    saved.write_text(json.dumps({"rows": rows, "runs": results, "args": vars(args),
                                 "machine": machine}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--measured", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reuse", nargs="?", const="", default=None, metavar="JSON",
                        help="reuse the runs of a saved measurement (default "
                             "runs/scope_overhead.json, _gpu.json with --gpu)")
    parser.add_argument("--gpu", action="store_true",
                        help="one rank on a CUDA GPU (scenarios/scope_overhead_gpu.yaml)")
    parser.add_argument("--results-dir", default=str(results_file.RESULTS),
                        help="where --gpu writes scope_overhead.json (default results/)")
    args = parser.parse_args(argv)
    from backends.torch.worker import quiet_megatron_warnings

    quiet_megatron_warnings()
    if args.gpu:
        return gpu_main(args, argv)
    base = load_scenario(SCENARIO)
    machine = f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; no GPU"
    print(f"machine: {machine}", flush=True)
    calibrated = calibrate(base)
    print("calibrated cost model: " + json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                                  for k, v in calibrated.items()}), flush=True)
    saved = ROOT / "runs" / "scope_overhead.json"
    if args.reuse is not None:
        results, machine = reused(args, saved)
    else:
        saved.parent.mkdir(parents=True, exist_ok=True)  # kept even if what follows fails

        def keep(runs: dict[str, list[dict[str, Any]]]) -> None:
            saved.write_text(json.dumps({"runs": runs, "args": vars(args), "machine": machine,
                                         "calibrated": calibrated}, indent=1))

        results = measure(base, args, ARMS, keep)
    rows = overhead_rows(results, np.random.default_rng(args.seed))
    base_runs = results["absent"]
    measured_costs = {k: float(np.median([x[k] for x in base_runs]))
                      for k in ("forward_s", "backward_s", "optimizer_s")}
    measured_costs["wall_s"] = float(np.median([w for x in base_runs for w in x["wall_s"]]))
    costs = sim_costs(base, measured_costs)
    active = {arm: every for arm, every in ARMS.items() if every is not None and every[0] < 10 ** 9}
    sims = {arm: predicted(base, every, calibrated, costs) for arm, every in active.items()}
    wall = {r["arm"]: r["wall_overhead"][0] for r in rows}
    scale = wall["every step"] / sims["every step"]["predicted_capture_overhead"]
    fitted = {**calibrated, "hook_us": calibrated["hook_us"] * scale,
              "reduce_gbps": calibrated["reduce_gbps"] / scale,
              "host_us_per_row": calibrated["host_us_per_row"] * scale}
    fitted_sims = {arm: predicted(base, every, fitted, costs) for arm, every in active.items()}
    print_measured(rows, args, "torch backend, gloo, 2 pipeline ranks")
    print_simulated(sims, fitted_sims, scale, costs, rows)
    out = ROOT / "runs"
    out.mkdir(parents=True, exist_ok=True)
    (out / "scope_overhead.json").write_text(json.dumps(
        {"rows": rows, "sim": sims, "sim_fitted": fitted_sims, "scale": scale,
         "calibrated": calibrated, "fitted": fitted, "sim_costs": costs,
         "runs": results, "args": vars(args), "machine": machine}, indent=1))
    return 0


def _pct(ci: tuple[float, float, float]) -> str:
    return f"{100 * ci[0]:+.2f}% [{100 * ci[1]:+.2f}, {100 * ci[2]:+.2f}]"


def print_measured(rows: list[dict[str, Any]], args: Any, setting: str) -> None:
    print(f"\n{args.rounds} interleaved rounds x {args.measured} measured iterations "
          f"(after {args.warmup} warm-up) per arm; {setting}; "
          "overhead vs hooks absent: mean iteration time ratio - 1, bootstrap median [95% CI]\n")
    print(measured_table(rows), end="")


def measured_table(rows: list[dict[str, Any]]) -> str:
    """The measured arms as a Markdown table: medians, overheads with their
    intervals, memory, drops, and whether the whole interval is under 3%."""
    def below(r: dict[str, Any]) -> str:
        if r["arm"] == "absent":
            return "—"
        return "yes" if r["wall_overhead"][2] < 0.03 and r["cpu_overhead"][2] < 0.03 else "no"
    return markdown_table(
        ["arm", "median wall ms/it", "wall overhead", "median CPU ms/it (all ranks)",
         "CPU overhead", "peak RSS MB", "peak GPU MB", "dropped", "whole interval < 3%"],
        [[r["arm"], f"{r['wall_ms']:.2f}", _pct(r["wall_overhead"]), f"{r['cpu_ms']:.2f}",
          _pct(r["cpu_overhead"]), f"{r['peak_rss_mb']:.0f}", f"{r['peak_gpu_mb']:.0f}",
          r["dropped"], below(r)] for r in rows], "lrlrlrrrl")


def tables(doc: dict[str, Any]) -> dict[str, str]:
    """docs/megascope.md's table of the GPU run (``--gpu``)."""
    return {"gpu": measured_table(doc["data"]["gpu"]["rows"])}


def print_simulated(sims: dict[str, dict[str, float]], fitted: dict[str, dict[str, float]],
                    scale: float, costs: dict[str, float], rows: list[dict[str, Any]]) -> None:
    print(f"\nsimulator (forward {1e3 * costs['forward_s']:.2f} ms, backward "
          f"{1e3 * costs['backward_s']:.2f} ms, optimizer {1e3 * costs['optimizer_s']:.2f} ms "
          f"per chunk as measured; p2p {1e3 * costs['p2p_s']:.2f} ms fitted to the measured "
          f"baseline, simulated {1e3 * costs['simulated_baseline_s']:.2f} ms/iteration) against "
          f"the measured overheads; (a) constants calibrated in isolation, (b) scaled by "
          f"{scale:.2f}, fitted on 'every step':\n")
    print("| arm | predicted (a) | predicted (b) | measured wall | measured CPU | "
          "error (b) vs wall, points |")
    print("|---|---:|---:|---:|---:|---:|")
    measured = {r["arm"]: r for r in rows}
    for arm, sim in sims.items():
        a, b = sim["predicted_capture_overhead"], fitted[arm]["predicted_capture_overhead"]
        w, c = measured[arm]["wall_overhead"][0], measured[arm]["cpu_overhead"][0]
        err = "(fitted)" if arm == "every step" else f"{100 * (b - w):+.2f}"
        print(f"| {arm} | {100 * a:.2f}% | {100 * b:.2f}% | {100 * w:.2f}% | {100 * c:.2f}% | "
              f"{err} |")


if __name__ == "__main__":
    sys.exit(main())
