"""Where the Megatron-LM README's H100 rows lose time that the simulator does
not: the virtual-stage split the README does not give, and the busiest stage.

The README names its parallel sizes but not the interleaving (virtual stages
per pipeline stage, vpp); its rows are predicted with one layer per virtual
stage (docs/fidelity.md says why). For each row this prints the prediction
at every vpp Megatron-core accepts there (a divisor of the layers per stage;
vpp 1 is the non-interleaved 1F1B schedule), each as throughput error against
the published figure (positive: the simulator is optimistic), and the
published iteration time over the busiest stage's compute as simulated at the
row's own vpp: about 1 where the pipeline and the data-parallel traffic hide,
more where the real run loses time the simulator does not charge. Nothing
here feeds the fit or the table (``experiments/published_runs.py``): it is sensitivity
only.

``--strong-scaling`` prints instead the README's strong scaling of its 177B
model (the same batch, 1,152, on 96 to 4,608 GPUs; MFU 47% at 96 and 42% at
4,608 from the README's text, 44% at 2,304 from its table), simulated at each
virtual-stage split: at 96 GPUs each replica runs 576 microbatches, so no
split's bubble matters there, and what the simulator misses is not the split.

``--gathers`` prints instead each row's first iteration beside its steady
state (the second iteration, which waits on the weight all-gather the first
step overlaps with it: ``--overlap-param-gather``).

``--matching-factor`` prints instead, for each row, the ``kernel_time_factor``
at which its simulated steady state takes the published time: the constant
that row alone would choose. One constant fits the rows only where these agree.
For pipelined rows it also prints what the published iteration takes beyond
the simulated one, per pipeline step of a rank (a chunk's forward or
backward), beside one activation message between stages at a NIC's rate.

``--te-overlap`` prices instead two costs of Transformer Engine 1.8's default
TP overlap (``transformer_engine/pytorch/module/base.py``; Megatron-core
r0.8.0 passes no configuration) that the simulator leaves out: its ring
exchange runs each all-gathered GEMM (QKV, first MLP projection) as tp row
blocks and its pipelined reduce-scatter each row-parallel GEMM (attention
projection, second MLP projection) as four, here priced from the kernel table
against the whole GEMM; and its reduce-scatter and bulk overlaps take 16 of
the GPU's SMs while they run (six per layer, forward and backward), here as
that share of the SMs over the overlapped time, a share of the layer.

    python -m experiments.h100_interleaving [--only 70B,177B]
    python -m experiments.h100_interleaving --strong-scaling
    python -m experiments.h100_interleaving --gathers [--only 32B]
    python -m experiments.h100_interleaving --matching-factor
    python -m experiments.h100_interleaving --te-overlap
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from experiments import results
from megatronapp.costs.gemm import GemmShape, rank_layer_shapes
from megatronapp.costs.per_op import Efficiency, layer_forward_s, stage_costs
from megatronapp.costs.tp_overlap import collective_s
from megatronapp.fidelity.fit import with_settings
from megatronapp.fidelity.predict import predict, steady_state_s
from megatronapp.fidelity.published import (PublishedRun, published_runs,
                                            throughput_error)
from megatronapp.scenario.config import Scenario
from megatronapp.scenario.devices import DEVICES
from megatronapp.trace.columns import KINDS, source_of
from megatronapp.trace.summary import run_iteration_times
from sim import simulate, simulate_iteration_times

ROOT = Path(__file__).resolve().parents[1]
NAME = "h100_interleaving"
SOURCE = "Megatron-LM README"
STRONG_ROW = "177B"
# GPUs -> published MFU: the README's text (96 and 4,608 GPUs) and its table (2,304)
STRONG_MFU = {96: 0.47, 2304: 0.44, 4608: 0.42}


def with_constants(run: PublishedRun) -> Scenario:
    """The row's scenario with its device's fitted constants."""
    constants = {f"cluster.gpu.{k}": v for k, v in DEVICES[run.device].fitted.items()}
    return with_settings(run.scenario, constants)


def with_vpp(s: Scenario, vpp: int) -> Scenario:
    """``s`` with ``vpp`` virtual stages per stage (1: Megatron's 1F1B)."""
    return with_settings(s, {"parallel.vpp": vpp,
                             "schedule": "interleaved" if vpp > 1 else "1f1b"})


def valid_vpps(s: Scenario) -> list[int]:
    """The virtual-stage counts Megatron-core r0.8.0 accepts: divisors of the
    layers per stage, and only 1 without a pipeline (``arguments.py``: pp > 1)."""
    if s.parallel.pp == 1:
        return [1]
    per_stage = s.model.layers // s.parallel.pp
    return [v for v in range(1, per_stage + 1) if per_stage % v == 0]


def row_name(run: PublishedRun) -> str:
    """The model size the README names the row by, e.g. 177B."""
    return run.source.rsplit(", ", 1)[-1]


def role(run: PublishedRun) -> str:
    return "fitted" if run.fitted else "held out"


def replica_iteration_times(s: Scenario) -> list[float]:
    """Each simulated iteration's time, one data-parallel replica."""
    return run_iteration_times(simulate(s, replica=True))


def iteration_and_busiest(s: Scenario) -> tuple[float, float]:
    """(steady-state iteration time, the busiest rank's compute per iteration)
    of one replica."""
    result = simulate(s, replica=True)
    source = source_of(result)
    compute = KINDS.index("compute")
    busiest = 0.0
    for rank in source.ranks():
        rows = source.rank_rows(rank)
        busiest = max(busiest, float(np.sum(rows.dur_s[rows.kind == compute])))
    times = run_iteration_times(result)
    return steady_state_s(times), busiest / len(times)


def row_line(run: PublishedRun) -> str:
    s = with_constants(run)
    own, busiest = iteration_and_busiest(s)
    cells = []
    for vpp in valid_vpps(s):
        t = own if vpp == s.parallel.vpp else iteration_and_busiest(with_vpp(s, vpp))[0]
        mark = "**" if vpp == s.parallel.vpp else ""
        cells.append(f"{mark}{vpp}: {throughput_error(run.iteration_s, t) * 100:+.1f}%{mark}")
    return (f"| {row_name(run)} | {s.parallel.pp} | {s.model.layers // s.parallel.pp} | "
            f"{run.iteration_s:.3f} | {busiest:.3f} | {run.iteration_s / busiest:.3f} | "
            f"{role(run)} | {', '.join(cells)} |")


def first_and_steady(s: Scenario) -> tuple[float, float]:
    """The first iteration's time, and the steady state's (two iterations)."""
    both = replica_iteration_times(with_settings(s, {"iterations": 2}))
    return both[0], steady_state_s(both)


def gathers_line(run: PublishedRun) -> str:
    first, steady = first_and_steady(with_constants(run))
    return (f"| {row_name(run)} | {role(run)} | {first:.3f} | {steady:.3f} "
            f"| {steady / first - 1:+.1%} | {throughput_error(run.iteration_s, first):+.1%} "
            f"| {throughput_error(run.iteration_s, steady):+.1%} |")


FACTOR_KEY = "cluster.gpu.kernel_time_factor"


def steady_at_factor(s: Scenario, factor: float) -> float:
    """One replica's steady-state iteration time at kernel time factor ``factor``."""
    return steady_state_s(replica_iteration_times(with_settings(s, {FACTOR_KEY: factor})))


def matching_factor(s: Scenario, published_s: float, steps: int = 2) -> tuple[float, float]:
    """The kernel time factor at which ``s`` takes ``published_s``, and the
    steady state at the fitted one: secant steps from the fitted constant and
    10% above it (the time is nearly linear in the factor; the data-parallel
    traffic it hides bends it a little)."""
    f0 = s.cluster.gpu.kernel_time_factor
    f1 = 1.1 * f0
    t0, t1 = steady_at_factor(s, f0), steady_at_factor(s, f1)
    at_fitted = t0
    for _ in range(steps):
        f0, t0, f1 = f1, t1, f1 + (published_s - t1) * (f1 - f0) / (t1 - t0)
        t1 = steady_at_factor(s, f1)
    return f1, at_fitted


def unexplained_per_step_ms(s: Scenario, published_s: float, simulated_s: float) -> float:
    """What the published iteration takes beyond the simulated one, per pipeline
    step of a rank (a chunk's forward or backward for one microbatch)."""
    steps = 2 * s.parallel.microbatches * s.parallel.vpp
    return (published_s - simulated_s) / steps * 1e3


def message_ms(s: Scenario) -> float:
    """One activation message between stages at one NIC's bandwidth."""
    return stage_costs(s).activation_bytes / (s.cluster.links.inter_node_gbps / 8 * 1e9) * 1e3


def factor_line(run: PublishedRun) -> str:
    s = with_constants(run)
    fitted = s.cluster.gpu.kernel_time_factor
    factor, simulated = matching_factor(s, run.iteration_s)
    per_step = (f"{unexplained_per_step_ms(s, run.iteration_s, simulated):.2f} "
                f"| {message_ms(s):.2f}" if s.parallel.pp > 1 else "(no pipeline) | –")
    return (f"| {row_name(run)} | {s.parallel.tp} | {s.parallel.pp} | {s.parallel.vpp} | "
            f"{role(run)} | {run.iteration_s:.3f} | "
            f"{factor:.3f} | {factor / fitted - 1:+.1%} | {per_step} |")


# Transformer Engine 1.8's defaults: row blocks per GEMM (tp for the ring
# exchange) and SMs taken by the SM-driven overlaps
TE_PIPELINE_SPLITS = 4
TE_COMM_SMS = 16
RING_EXCHANGED = ("qkv", "fc1")
PIPELINED = ("proj", "fc2")


def te_split_ratio(s: Scenario, eff: Efficiency) -> float:
    """The four overlapped forward GEMMs run as TE's row blocks, over run whole."""
    shapes = rank_layer_shapes(s)
    whole = split = 0.0
    for name in RING_EXCHANGED + PIPELINED:
        g = shapes[name]
        blocks = s.parallel.tp if name in RING_EXCHANGED else TE_PIPELINE_SPLITS
        whole += eff.shape_s(g)
        split += blocks * eff.shape_s(GemmShape(g.m // blocks, g.n, g.k))
    return split / whole


def te_sm_share(s: Scenario, eff: Efficiency) -> float:
    """The SMs TE's SM-driven overlaps take, over the time they overlap, as a
    share of a layer's forward and backward: the pipelined reduce-scatters in
    forward; in backward the bulk all-gathers under QKV's and the first MLP
    projection's data-gradient GEMMs and the bulk reduce-scatters under their
    weight-gradient GEMMs (each the forward GEMM's size)."""
    shapes = rank_layer_shapes(s)
    comm = collective_s(s)
    under = {name: min(comm, eff.shape_s(shapes[name])) for name in RING_EXCHANGED + PIPELINED}
    overlapped = sum(under[n] for n in PIPELINED) + 2 * sum(under[n] for n in RING_EXCHANGED)
    sm_count = s.cluster.gpu.sm_count or 0
    return overlapped * TE_COMM_SMS / sm_count / (3 * layer_forward_s(s, eff)) if sm_count else 0.0


def te_overlap_line(run: PublishedRun) -> str:
    s = with_constants(run)
    eff = Efficiency.of(s)
    if s.parallel.tp == 1:
        return f"| {row_name(run)} | 1 | (no TP) | (no TP) |"
    return (f"| {row_name(run)} | {s.parallel.tp} | {te_split_ratio(s, eff):.3f} "
            f"| {te_sm_share(s, eff):.2%} |")


def simulated_mfu(s: Scenario) -> float:
    return predict(s, simulate_iteration_times, replica=True).mfu


def at_gpus(s: Scenario, gpus: int) -> Scenario:
    """``s`` on ``gpus`` GPUs: more or fewer replicas, the same global batch."""
    batch = s.parallel.dp * s.parallel.microbatches * s.model.micro_batch_size
    dp = gpus // (s.world_size // s.parallel.dp)
    return with_settings(s, {"parallel.dp": dp,
                             "parallel.microbatches": batch // dp // s.model.micro_batch_size})


def strong_scaling_lines(run: PublishedRun) -> list[str]:
    """The 177B row at each GPU count of the README's strong scaling: the
    published MFU, and the simulated MFU's error at every split."""
    s = with_constants(run)
    lines = []
    for gpus, published in STRONG_MFU.items():
        at = at_gpus(s, gpus)
        cells = []
        for vpp in valid_vpps(at):
            mfu = simulated_mfu(with_vpp(at, vpp))
            mark = "**" if vpp == s.parallel.vpp else ""
            cells.append(f"{mark}{vpp}: {mfu * 100:.1f}% ({mfu / published - 1:+.1%}){mark}")
        lines.append(f"| {gpus} | {at.parallel.dp} | {at.parallel.microbatches} | {published:.0%} "
                     f"| {', '.join(cells)} |")
    return lines


def print_strong_scaling(runs: list[PublishedRun], show: results.Printed) -> None:
    run = next(r for r in runs if r.source.endswith(STRONG_ROW))
    show("| GPUs | dp | microbatches per replica | published MFU "
         "| simulated MFU (error) at each vpp (the row's own in bold) |")
    show("|---:|---:|---:|---:|---|")
    for line in strong_scaling_lines(run):
        show(line)


# each per-row mode: its table's header, and the function that prints a row
ROW_MODES: dict[str, tuple[str, Callable[[PublishedRun], str]]] = {
    "splits": ("| row | pp | layers per stage | published s | busiest stage's compute s "
               "| published / busiest | role | error at each vpp (the row's own in bold) |\n"
               "|---|---:|---:|---:|---:|---:|---|---|", row_line),
    "gathers": ("| row | role | first iteration s | steady state s | change "
                "| error, first | error, steady state |\n"
                "|---|---|---:|---:|---:|---:|---:|", gathers_line),
    "matching_factor": ("| row | tp | pp | vpp | role | published s | factor that matches it "
                        "| over the fitted constant | published beyond simulated, ms per "
                        "pipeline step | one activation message at a NIC, ms |\n"
                        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|", factor_line),
    "te_overlap": ("| row | tp | row-blocked GEMMs over whole | SMs taken by the overlaps, "
                   "share of a layer |\n|---|---:|---:|---:|", te_overlap_line),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="",
                        help="comma-separated model sizes as the README names them, e.g. 70B,177B")
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--strong-scaling", action="store_true",
                       help=f"the README's strong scaling of its {STRONG_ROW} row instead")
    modes.add_argument("--gathers", action="store_true",
                       help="each row's first iteration beside its steady state instead")
    modes.add_argument("--matching-factor", action="store_true",
                       help="the kernel time factor each row alone would choose instead")
    modes.add_argument("--te-overlap", action="store_true",
                       help="two costs of Transformer Engine's TP overlap, priced, instead")
    results.results_dir_option(parser)
    args = parser.parse_args(argv)
    experiment, show = results.start(NAME, argv), results.Printed()
    runs = [r for r in published_runs(ROOT) if r.source.startswith(SOURCE)]
    if args.strong_scaling:
        t0, w0 = time.process_time(), time.perf_counter()
        print_strong_scaling(runs, show)
        print(f"\n{time.process_time() - t0:.0f} s CPU, {time.perf_counter() - w0:.0f} s wall")
        recorded = experiment.record_part("strong_scaling", {"cells": show.cells()},
                                          args.results_dir)
        print(f"wrote {recorded}")
        return 0
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    known = {row_name(r) for r in runs}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        parser.error(f"--only: no README row {', '.join(unknown)} (rows: {', '.join(sorted(known))})")
    runs = [r for r in runs if not wanted or row_name(r) in wanted]
    t0, w0 = time.process_time(), time.perf_counter()
    mode = next((m for m in ROW_MODES if getattr(args, m, False)), "splits")
    header, line = ROW_MODES[mode]
    show(header)
    for run in runs:
        show(line(run))
    print(f"\n{len(runs)} rows: {time.process_time() - t0:.0f} s CPU, "
          f"{time.perf_counter() - w0:.0f} s wall")
    recorded = experiment.record_part(mode, {"only": wanted, "cells": show.cells()},
                                      args.results_dir)
    print(f"wrote {recorded}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
