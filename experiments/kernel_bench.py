"""The kernels the cost model prices, listed from the published rows, timed on
a GPU, and compared with the analytic GEMM model.

``shapes`` (CPU) lists every per-rank GEMM the cost model prices for a
published row (the layer's QKV, projection, two MLP GEMMs and the logits,
forward; backward's dgrad and wgrad shapes beside them) plus an m×n×k grid,
and every row's per-rank attention core (micro-batch × local heads, local and
full sequence, head width). ``measure`` (one CUDA GPU, torch) times them in
bf16 with CUDA events: GEMMs as A@B and A@Bᵀ-stored (Megatron's weights), the
attention core with torch's SDPA on the flash, cuDNN and efficient backends
(causal where query and key lengths agree; forward, and forward+backward),
and layernorm, GeLU, dropout+add and a copy by the bytes they move. It writes
the table megatronapp/scenario/kernels/<device>.json that device profiles
read (megatronapp/costs/kernels.py). ``compare`` (CPU) fits the analytic
model's constants (megatronapp/costs/gemm.py) on the measured GEMMs and
prints its residuals by GEMM size and by wave fill.

    python -m experiments.kernel_bench shapes [--out FILE]
    python -m experiments.kernel_bench measure --out megatronapp/scenario/kernels/h100-sxm.json
    python -m experiments.kernel_bench compare [--table FILE]
    python -m experiments.kernel_bench versus --other FILE [--table FILE]

``versus`` (CPU) compares two measured tables kernel by kernel (the other's
time over the table's, per GEMM, attention core and element-wise op).
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from statistics import median
from typing import Any, Callable, Iterable, Sequence

from experiments import results
from megatronapp.costs.gemm import GemmDevice, GemmShape, rank_layer_shapes, rank_logits_shape
from megatronapp.costs.flops import ATTENTION_CORE
from megatronapp.costs.kernels import attention_shape
from megatronapp.fidelity.published import PublishedRun, published_runs
from megatronapp.errors import UserError
from megatronapp.io.outdirs import add_force_option, check_file, new_file
from megatronapp.io import gate
from megatronapp.io.text import one_line_errors
from megatronapp.scenario.devices import KERNELS_DIR

ROOT = Path(__file__).resolve().parents[1]
GRID_M = (512, 1024, 2048, 4096, 8192, 16384)
GRID_N = (256, 512, 1024, 2048, 4096, 8192, 16384)
GRID_K = (1024, 4096, 12288)
MODEL_TILES = ((256, 128), (128, 256), (128, 128))
TILE_SETS: dict[str, tuple[tuple[int, int], ...] | None] = {
    "no waves": None,
    "256x128, 128x256, 128x128 (the model's)": MODEL_TILES,
    "with 128x64 and 64x128": ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128)),
}
PEAK_BF16 = {"h100-sxm": 989e12}


def row_gemms(s: Any) -> dict[str, GemmShape]:
    """The GEMMs the cost model prices per layer and for the logits (forward)."""
    shapes = {n: g for n, g in rank_layer_shapes(s).items() if n not in ATTENTION_CORE}
    return {**shapes, "logits": rank_logits_shape(s)}


def backward_shapes(g: GemmShape) -> dict[str, tuple[int, int, int]]:
    """Forward, and backward's input gradient and weight gradient, as (m, n, k)."""
    return {"fwd": (g.m, g.n, g.k), "dgrad": (g.m, g.k, g.n), "wgrad": (g.k, g.n, g.m)}


def attention_forward_flops(at: dict[str, Any]) -> float:
    """An attention core's forward FLOPs (QKᵀ and attention·V; half the square
    where causal, as flash and fused kernels compute it) from its shape entry."""
    causal = at["sq"] == at["sk"]
    return 4.0 * at["b"] * at["h"] * at["sq"] * at["sk"] * at["d"] * (0.5 if causal else 1.0)


def kernel_shapes(runs: Sequence[PublishedRun]) -> dict[str, list[dict[str, Any]]]:
    """Every row's GEMMs (with their uses: row|gemm|pass) and the grid, and
    every row's attention core (with the rows that use it)."""
    gemms: dict[tuple[int, int, int], list[str]] = {}
    attention: dict[tuple[int, ...], list[str]] = {}
    for r in runs:
        for name, g in row_gemms(r.scenario).items():
            for kind, mnk in backward_shapes(g).items():
                gemms.setdefault(mnk, []).append(f"{r.source}|{name}|{kind}")
        a, m = attention_shape(r.scenario), r.scenario.model
        key = (m.micro_batch_size, a.batch_heads // m.micro_batch_size,
               max(1, m.query_groups // r.scenario.parallel.tp), a.sq, a.sk, a.head)
        attention.setdefault(key, []).append(r.source)
    for mnk in ((m, n, k) for m in GRID_M for n in GRID_N for k in GRID_K):
        gemms.setdefault(mnk, []).append("grid")
    return {"gemms": [{"m": m, "n": n, "k": k, "uses": u} for (m, n, k), u in gemms.items()],
            "attention": [dict(zip(("b", "h", "kvh", "sq", "sk", "d"), key), uses=u)
                          for key, u in attention.items()]}


# ---- measure (needs torch and a CUDA GPU) ----

def timed(fn: Callable[[], Any], reps: int) -> float:
    """Seconds per call: back-to-back calls after two warm-up calls, CUDA
    events around each block, the best of three blocks."""
    import torch

    for _ in range(2):
        fn()
    best = math.inf
    for _ in range(3):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / reps)
    return best


def measure_gemms(shapes: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    import torch

    rows = []
    for g in sorted(shapes, key=lambda g: g["m"] * g["n"] * g["k"]):
        m, n, k = g["m"], g["n"], g["k"]
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        b_t = b.t().contiguous().t()  # stored (n, k), used transposed: Megatron's weights
        flops = 2.0 * m * n * k
        reps = max(3, min(50, int(2e13 / flops)))
        plain, stored_t = timed(lambda: a @ b, reps), timed(lambda: a @ b_t, reps)
        rows.append({**g, "s": plain, "s_bT": stored_t, "tflops": flops / plain / 1e12,
                     "tflops_bT": flops / stored_t / 1e12})
    return rows


def measure_attention(shapes: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    rows = []
    for at in shapes:
        b, h, sq, sk, d = at["b"], at["h"], at["sq"], at["sk"], at["d"]
        causal = sq == sk
        fwd_flops = attention_forward_flops(at)
        for name, backend in backends.items():
            q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for n in (sq, sk, sk))
            with sdpa_kernel([backend]):
                def forward() -> Any:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                grad = torch.randn_like(forward())
                fwd = timed(forward, 5)
                both = timed(lambda: torch.autograd.grad(forward(), (q, k, v), grad), 5)
            rows.append({**at, "backend": name, "causal": causal, "fwd_s": fwd,
                         "fwd_bwd_s": both, "fwd_flops": fwd_flops,
                         "fwd_tflops": fwd_flops / fwd / 1e12,
                         "bwd_tflops": 2.5 * fwd_flops / (both - fwd) / 1e12})
    return rows


def measure_elementwise() -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    rows = []
    for tokens, hidden in ((4096, 2048), (4096, 6144), (4096, 12288), (8192, 16384),
                           (2048, 20480)):
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        w, bias = torch.ones(hidden, device="cuda", dtype=torch.bfloat16), None
        ops: dict[str, tuple[Callable[[], Any], int]] = {  # the op and its tensors moved
            "layernorm": (lambda: F.layer_norm(x, (hidden,), w, bias), 2),
            "gelu": (lambda: F.gelu(x), 2),
            "dropout_add": (lambda: F.dropout(x, 0.1, True) + x, 5),
            "copy": (lambda: x.clone(), 2)}
        for name, (fn, tensors) in ops.items():
            t = timed(fn, 20)
            rows.append({"op": name, "tokens": tokens, "hidden": hidden, "s": t,
                         "gbps_nominal": tensors * x.numel() * 2 / t / 1e9})
    return rows


def machine(out: Path) -> dict[str, Any]:
    import torch

    p = torch.cuda.get_device_properties(0)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         check=True).stdout.split("\n")[0].split(", ")
    return {"device": torch.cuda.get_device_name(), "driver": smi[0], "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "sm_count": p.multi_processor_count, "memory_gb": round(p.total_memory / 1e9, 1),
            "sm_clock_max_mhz": int(smi[1]), "power_limit_w": float(smi[2]),
            "command": f"python -m experiments.kernel_bench measure --out {out}",
            "timing": "CUDA events; mean of back-to-back calls after two warm-up calls, "
                      "best of 3 blocks"}


def measure(shapes: dict[str, list[dict[str, Any]]], out: Path) -> dict[str, Any]:
    return {**machine(out), "gemms": measure_gemms(shapes["gemms"]),
            "attention": measure_attention(shapes["attention"]),
            "elementwise": measure_elementwise()}


# ---- compare (CPU) ----

def fit_gemm_model(gemms: Sequence[dict[str, Any]], peak: float, hbm: float, sm_count: int,
                   tiles: tuple[tuple[int, int], ...] | None) -> tuple[GemmDevice, list[float]]:
    """The efficiency and F½ (grid search, least squares in log time) that
    follow the measured GEMMs best, and each GEMM's residual (model / measured - 1)."""
    best: tuple[float, GemmDevice, list[float]] | None = None
    for half in (0.0, 1e9, 2e9, 5e9, 1e10, 2e10, 5e10):
        for eff in (e / 100 for e in range(55, 90)):
            dev = GemmDevice(peak, eff, half, 0.0, hbm, sm_count if tiles else None,
                             tiles or ((256, 128),))
            ratios = [dev.seconds(GemmShape(g["m"], g["n"], g["k"])) / g["s_bT"] for g in gemms]
            score = sum(math.log(r) ** 2 for r in ratios)
            if best is None or score < best[0]:
                best = (score, dev, [r - 1 for r in ratios])
    assert best is not None
    return best[1], best[2]


def print_comparison(table: dict[str, Any], peak: float, hbm: float,
                     show: Callable[[str], None] = print) -> None:
    gemms, sms = table["gemms"], table["sm_count"]
    rows = [any(u != "grid" for u in g["uses"]) for g in gemms]
    wave_model = GemmDevice(peak, 1.0, 0.0, 0.0, hbm, sms, MODEL_TILES)
    fills = [wave_model.wave_fill(GemmShape(g["m"], g["n"], g["k"])) for g in gemms]
    print(f"{len(gemms)} GEMMs measured ({sum(rows)} of the rows' shapes); peak {peak / 1e12:g} "
          "TFLOP/s\n")
    show("| tiles | efficiency | F½ GFLOP | all: mean \\|residual\\| | worst | rows' shapes: "
         "mean \\|residual\\| | worst |")
    show("|---|---:|---:|---:|---:|---:|---:|")
    fitted = {}
    for name, tiles in TILE_SETS.items():
        dev, res = fit_gemm_model(gemms, peak, hbm, sms, tiles)
        fitted[name] = res
        on_rows = [r for r, row in zip(res, rows) if row]
        show(f"| {name} | {dev.efficiency:.2f} | {dev.half_flops / 1e9:g} | "
             f"{sum(map(abs, res)) / len(res) * 100:.1f}% | {max(res, key=abs) * 100:+.1f}% | "
             f"{sum(map(abs, on_rows)) / len(on_rows) * 100:.1f}% | "
             f"{max(on_rows, key=abs) * 100:+.1f}% |")
    smooth = fitted["no waves"]
    print("\nBy wave fill (the model's tiles on", sms, "SMs): what the model charges for the "
          "partial wave, and what the measurements show over the fitted model without waves\n")
    show("| wave fill | GEMMs | charged | measured over the no-wave model (median) |")
    show("|---|---:|---:|---:|")
    for low, high in ((0.0, 0.5), (0.5, 0.7), (0.7, 0.85), (0.85, 0.95), (0.95, 1.01)):
        chosen = [i for i, f in enumerate(fills) if low <= f < high]
        if chosen:
            show(f"| {low:.2f}–{min(high, 1.0):.2f} | {len(chosen)} | "
                 f"{(median(1 / fills[i] for i in chosen) - 1) * 100:+.0f}% | "
                 f"{-median(smooth[i] / (1 + smooth[i]) for i in chosen) * 100:+.1f}% |")
    print("\nBy size (FLOPs), the fitted model without waves\n")
    show("| GFLOP | GEMMs | measured TFLOP/s (median) | residual (median) |")
    show("|---|---:|---:|---:|")
    for low, high in ((0, 1), (1, 10), (10, 100), (100, 1000), (1000, 1e9)):
        chosen = [i for i, g in enumerate(gemms)
                  if low <= 2e-9 * g["m"] * g["n"] * g["k"] < high]
        if chosen:
            show(f"| {low:g}–{high:g} | {len(chosen)} | "
                 f"{median(2 * gemms[i]['m'] * gemms[i]['n'] * gemms[i]['k'] / gemms[i]['s_bT'] for i in chosen) / 1e12:.0f} | "
                 f"{median(smooth[i] for i in chosen) * 100:+.1f}% |")


# the fields that name a kernel in a table, and the time compared, per kind
KERNEL_KEYS = {"gemms": (("m", "n", "k"), "s_bT"),
               "attention": (("b", "h", "kvh", "sq", "sk", "d", "backend", "causal"),
                             "fwd_bwd_s"),
               "elementwise": (("op", "tokens", "hidden"), "s")}


def time_ratios(table: dict[str, Any], other: dict[str, Any]) -> dict[str, list[float]]:
    """Per kind, the other table's time over this one's for each kernel both hold."""
    out: dict[str, list[float]] = {}
    for kind, (fields, time_key) in KERNEL_KEYS.items():
        mine = {tuple(k[f] for f in fields): k[time_key] for k in table.get(kind, [])}
        out[kind] = sorted(k[time_key] / mine[key] for k in other.get(kind, [])
                           if (key := tuple(k[f] for f in fields)) in mine)
    return out


def print_versus(table: dict[str, Any], other: dict[str, Any],
                 show: Callable[[str], None] = print) -> None:
    print(f"{other.get('device')} over {table.get('device')}, time per kernel:\n")
    show("| kernels | both hold | median | 5-95% |\n|---|---:|---:|---:|")
    for kind, ratios in time_ratios(table, other).items():
        if ratios:
            lo, hi = ratios[len(ratios) // 20], ratios[-1 - len(ratios) // 20]
            show(f"| {kind} | {len(ratios)} | {median(ratios):.3f}x | {lo:.2f}-{hi:.2f}x |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("shapes", "measure", "compare", "versus"))
    parser.add_argument("--out", type=Path, help="shapes: where to write them (default stdout); "
                                                "measure: the table to write")
    parser.add_argument("--table", type=Path, default=KERNELS_DIR / "h100-sxm.json",
                        help="compare, versus: the measured table")
    parser.add_argument("--other", type=Path, help="versus: the table compared with --table")
    add_force_option(parser, "an existing --out file")
    results.results_dir_option(parser)
    args = parser.parse_args(argv)
    if args.mode == "measure" and args.out is None:
        parser.error("measure needs --out")
    if args.mode == "versus" and args.other is None:
        parser.error("versus needs --other")
    return one_line_errors("kernel_bench.py", lambda: run_mode(args, argv))


def read_table(path: Path, option: str) -> dict[str, Any]:
    table = gate.read_json(path, option)
    if not isinstance(table, dict):
        raise UserError(f"{option} {path}: not a kernel table (expected an object)")
    return table


def run_mode(args: argparse.Namespace, argv: list[str] | None) -> int:
    """``compare`` and ``versus`` record their tables' cells in results/kernel_bench.json
    (one part each); ``shapes`` and ``measure`` write their data to ``--out`` (the
    measured table is itself the record the cost model reads)."""
    if args.mode in ("compare", "versus"):
        experiment, show = results.start("kernel_bench", argv), results.Printed()
        table = read_table(args.table, "--table")
        if args.mode == "compare":
            print_comparison(table, PEAK_BF16["h100-sxm"], 3.35e12, show)
        else:
            print_versus(table, read_table(args.other, "--other"), show)
        inputs = {"table": str(args.table), "other": args.other and str(args.other)}
        recorded = experiment.record_part(args.mode, {**inputs, "cells": show.cells()},
                                          args.results_dir)
        print(f"wrote {recorded}")
        return 0
    if args.out:  # before any work: a measurement should not end in a refusal
        check_file(args.out, "--out", args.force)
    shapes = kernel_shapes(published_runs(ROOT))
    if args.mode == "shapes":
        text = json.dumps(shapes, indent=0)
        print(f"{len(shapes['gemms'])} GEMM and {len(shapes['attention'])} attention shapes",
              file=sys.stderr)
        if not args.out:
            print(text)
    else:
        text = json.dumps(measure(shapes, args.out), indent=0)
    if args.out:
        with new_file(args.out, "--out", force=args.force) as tmp:
            tmp.write_text(text)
    return 0

if __name__ == "__main__":
    sys.exit(main())
