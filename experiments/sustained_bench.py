"""A published row's transformer layer, timed in a short burst and under
sustained load, on one GPU: how much slower its kernels run once the GPU
has been busy for a while (clocks under the power limit), row by row.

The kernel table (``kernel_bench.py measure``) times each kernel in short
bursts; a training step keeps the GPU busy for minutes. ``shapes`` (CPU)
lists, for every published H100 row, one layer's per-rank kernels as the
cost model prices them: the four GEMMs forward with their input- and
weight-gradient GEMMs, and the attention core forward and backward.
``measure`` (one CUDA GPU; torch and nvidia-ml-py only, so it runs where this
package is not installed) runs each row's layer after the GPU has idled:
first a burst (the best of three short blocks, as the kernel table was
timed), then back to back for ``--seconds``, and reports the last windows'
time per layer over the burst's, with the SM clock and power read meanwhile.
``compare`` (CPU) prices each row's layer with the measured kernel tables
(``megatronapp/scenario/kernels``) and prints the sustained time over that.

    python -m experiments.sustained_bench shapes --out FILE
    python -m experiments.sustained_bench measure --shapes FILE --out RESULT [--seconds 20]
    python -m experiments.sustained_bench compare --shapes FILE --result RESULT [--table NAME]
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from statistics import fmean, median
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]

IDLE_S = 6.0  # the GPU idles this long before each row, so each burst starts cool
BURST_BLOCKS = 3
WINDOW_S = 1.0
LAST_WINDOWS = 5


# ---- shapes (CPU, this package) ----

def layer_kernels(s: Any) -> dict[str, Any]:
    """One layer's per-rank GEMMs (forward, input and weight gradient) and its
    attention core, as the cost model prices them for scenario ``s``."""
    from megatronapp.costs.gemm import rank_layer_shapes
    from megatronapp.costs.flops import ATTENTION_CORE
    from megatronapp.costs.kernels import attention_shape
    from experiments.kernel_bench import backward_shapes

    gemms = [mnk for n, g in rank_layer_shapes(s).items() if n not in ATTENTION_CORE
             for mnk in backward_shapes(g).values()]
    a, m = attention_shape(s), s.model
    return {"gemms": gemms, "attention": {"b": m.micro_batch_size,
                                          "h": a.batch_heads // m.micro_batch_size,
                                          "sq": a.sq, "sk": a.sk, "d": a.head}}


def row_shapes(root: Path, device: str) -> list[dict[str, Any]]:
    from megatronapp.fidelity.published import published_runs

    return [{"source": r.source, "fitted": r.fitted, **layer_kernels(r.scenario)}
            for r in published_runs(root) if r.device == device]


# ---- measure (torch and a CUDA GPU) ----

class PowerSampler:
    """SM clock (MHz) and board power (W) every 0.1 s, from NVML, in a thread."""

    def __init__(self) -> None:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.samples: list[tuple[float, int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        nv, h = self._nvml, self._handle
        while not self._stop.wait(0.1):
            clock = nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)
            power = nv.nvmlDeviceGetPowerUsage(h) / 1e3
            self.samples.append((time.monotonic(), clock, power))

    def __enter__(self) -> "PowerSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, t0: float, t1: float) -> dict[str, float]:
        inside = [(c, p) for t, c, p in self.samples if t0 <= t <= t1]
        if not inside:
            return {"sm_clock_mhz": float("nan"), "power_w": float("nan")}
        return {"sm_clock_mhz": fmean(c for c, _ in inside),
                "power_w": fmean(p for _, p in inside)}


def layer_step(row: dict[str, Any]) -> Callable[[], None]:
    """The row's layer: every GEMM into a kept output, attention forward and backward."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    bf16: dict[str, Any] = {"device": "cuda", "dtype": torch.bfloat16}
    mats = [(torch.randn(m, k, **bf16), torch.randn(n, k, **bf16).t(),
             torch.empty(m, n, **bf16)) for m, n, k in row["gemms"]]
    at = row["attention"]
    q, k, v = (torch.randn(at["b"], at["h"], n, at["d"], requires_grad=True, **bf16)
               for n in (at["sq"], at["sk"], at["sk"]))
    causal = at["sq"] == at["sk"]
    grad = torch.randn(at["b"], at["h"], at["sq"], at["d"], **bf16)

    def step() -> None:
        for a, b, out in mats:
            torch.mm(a, b, out=out)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                (q, k, v), grad)
    return step


def seconds_per_step(step: Callable[[], None], steps: int) -> float:
    import torch

    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record()
    for _ in range(steps):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / steps


def measure_row(row: dict[str, Any], sampler: PowerSampler, seconds: float) -> dict[str, Any]:
    import torch

    step = layer_step(row)
    first = seconds_per_step(step, 2)  # warm-up: cuBLAS and cuDNN choose their kernels
    burst_steps = max(2, int(0.1 / first))
    time.sleep(IDLE_S)
    t0 = time.monotonic()
    burst = min(seconds_per_step(step, burst_steps) for _ in range(BURST_BLOCKS))
    t1 = time.monotonic()
    window_steps = max(1, int(WINDOW_S / burst))
    windows: list[tuple[float, float, float]] = []  # (start, end, seconds per step)
    while not windows or windows[-1][1] - t1 < seconds:
        w0 = time.monotonic()
        per_step = seconds_per_step(step, window_steps)
        windows.append((w0, time.monotonic(), per_step))
    last = windows[-LAST_WINDOWS:]
    sustained = median(w[2] for w in last)
    del step
    torch.cuda.empty_cache()
    return {"source": row["source"], "fitted": row["fitted"], "burst_s": burst,
            "sustained_s": sustained, "sustained_over_burst": sustained / burst,
            "windows_s": [w[2] for w in windows],
            "burst": sampler.between(t0, t1),
            "sustained": sampler.between(last[0][0], last[-1][1])}


def machine() -> dict[str, Any]:
    import torch

    p = torch.cuda.get_device_properties(0)
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "sm_count": p.multi_processor_count}


def measure(rows: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    results = []
    with PowerSampler() as sampler:
        for row in rows:
            results.append(measure_row(row, sampler, seconds))
            r = results[-1]
            print(f"{r['source']}: burst {r['burst_s'] * 1e3:.2f} ms, sustained "
                  f"{r['sustained_s'] * 1e3:.2f} ms ({r['sustained_over_burst']:.3f}x); "
                  f"SM clock {r['burst']['sm_clock_mhz']:.0f} -> "
                  f"{r['sustained']['sm_clock_mhz']:.0f} MHz, power "
                  f"{r['burst']['power_w']:.0f} -> {r['sustained']['power_w']:.0f} W",
                  flush=True)
    return {**machine(), "idle_s": IDLE_S, "seconds": seconds, "rows": results}


# ---- compare (CPU, this package) ----

def table_priced_s(row: dict[str, Any], table: str) -> float:
    """The row's layer kernels as a measured kernel table prices them (GEMMs
    in Megatron's layout, attention on cuDNN's fused kernel, as timed)."""
    from megatronapp.costs.gemm import GemmShape
    from megatronapp.costs.kernels import AttentionShape, load_kernel_table
    from experiments.kernel_bench import attention_forward_flops

    kernels = load_kernel_table(table)
    gemms = sum(kernels.gemm_s(GemmShape(m, n, k)) for m, n, k in row["gemms"])
    at = row["attention"]
    shape = AttentionShape(at["b"] * at["h"], at["sq"], at["sk"], at["d"])
    return gemms + sum(kernels.attention_s("fused", shape, attention_forward_flops(at)))


def comparison_rows(shapes: list[dict[str, Any]], result: dict[str, Any],
                    tables: list[str]) -> list[dict[str, Any]]:
    by_source = {row["source"]: row for row in shapes}
    return [{**r, "priced_s": {t: table_priced_s(by_source[r["source"]], t) for t in tables}}
            for r in result["rows"]]


def print_comparison(shapes: list[dict[str, Any]], result: dict[str, Any],
                     tables: list[str]) -> list[dict[str, Any]]:
    rows = comparison_rows(shapes, result, tables)
    print(f"{result['device']}, torch {result['torch']}: each row's layer after "
          f"{result['idle_s']:.0f} s idle, in a burst, then {result['seconds']:.0f} s back to back")
    print()
    over = " | ".join(f"sustained / {t} table" for t in tables)
    print(f"| row | burst ms | sustained ms | sustained / burst | {over} "
          "| SM clock MHz, sustained | power W, sustained |")
    print("|---|---:|---:|---:|" + "---:|" * len(tables) + "---:|---:|")
    for r in rows:
        row_ratios = " | ".join(f"{r['sustained_s'] / r['priced_s'][t]:.3f}" for t in tables)
        print(f"| {r['source']} | {r['burst_s'] * 1e3:.2f} | {r['sustained_s'] * 1e3:.2f} "
              f"| {r['sustained_over_burst']:.3f} | {row_ratios} "
              f"| {r['sustained']['sm_clock_mhz']:.0f} | {r['sustained']['power_w']:.0f} |")
    print()
    for t in tables:
        ratios = sorted(r["sustained_s"] / r["priced_s"][t] for r in rows)
        print(f"sustained / {t} table: median {median(ratios):.3f}, "
              f"range {ratios[0]:.3f}-{ratios[-1]:.3f} over {len(ratios)} rows")
    burst = sorted(r["sustained_over_burst"] for r in rows)
    print(f"sustained / burst: median {median(burst):.3f}, range {burst[0]:.3f}-{burst[-1]:.3f}")
    return rows


def main(argv: list[str] | None = None) -> int:
    # this package's light modules only: measure runs where its dependencies are not installed
    from megatronapp.io.outdirs import add_force_option
    from megatronapp.io.text import one_line_errors

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("shapes", "measure", "compare"))
    parser.add_argument("--out", type=Path, help="shapes (default stdout) / measure: the JSON written")
    parser.add_argument("--shapes", type=Path, help="measure / compare: the shapes JSON")
    parser.add_argument("--result", type=Path, help="compare: the measured JSON")
    parser.add_argument("--table", action="append",
                        help="compare: a kernel table to price the layers with (repeatable; "
                             "default h200-sxm and h100-sxm)")
    parser.add_argument("--device", default="h100-sxm", help="shapes: the rows of this device")
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="measure: how long each row runs back to back")
    add_force_option(parser, "an existing --out file")
    parser.add_argument("--results-dir", type=Path, default=ROOT / "results",
                        help="compare: where sustained_bench.json is written (default results/)")
    args = parser.parse_args(argv)
    needed = {"measure": ("shapes", "out"), "compare": ("shapes", "result")}.get(args.mode, ())
    for name in needed:
        if getattr(args, name) is None:
            parser.error(f"{args.mode} needs --{name}")
    if args.seconds <= 0:
        parser.error("--seconds: must be positive")
    return one_line_errors("sustained_bench.py", lambda: run_mode(args, argv))


def read_json(path: Path, option: str) -> Any:
    from megatronapp.io import gate

    return gate.read_json(path, option)


def run_mode(args: argparse.Namespace, argv: list[str] | None) -> int:
    """``compare`` records its rows in results/sustained_bench.json; ``shapes`` and
    ``measure`` write their JSON to ``--out`` (``measure`` runs where only torch is)."""
    from megatronapp.io.outdirs import check_file, new_file

    if args.mode == "compare":
        from experiments import results

        experiment = results.start("sustained_bench", argv)
        tables = args.table or ["h200-sxm", "h100-sxm"]
        rows = print_comparison(read_json(args.shapes, "--shapes"),
                                read_json(args.result, "--result"), tables)
        recorded = experiment.record({"shapes": str(args.shapes), "result": str(args.result),
                                      "tables": tables, "rows": rows}, args.results_dir)
        print(f"wrote {recorded}")
        return 0
    if args.out is not None:  # before any work: a measurement should not end in a refusal
        check_file(args.out, "--out", args.force)
    if args.mode == "shapes":
        text = json.dumps(row_shapes(ROOT, args.device), indent=1)
    else:
        text = json.dumps(measure(read_json(args.shapes, "--shapes"), args.seconds), indent=1)
    if args.out is None:
        print(text)
        return 0
    with new_file(args.out, "--out", force=args.force) as tmp:
        tmp.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
