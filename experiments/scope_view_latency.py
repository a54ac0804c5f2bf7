"""MegaScope view: from a decoded token to its view updated in the browser.

Starts ``megatronapp scope serve`` on a run directory (the trained tiny model
with ``--run runs/scope_tiny``, else an untrained model of the same size made
in a temporary directory), opens the page in Debian's headless chromium,
generates ``--tokens`` tokens (clean, then clean with a perturbed run beside
it) and reads, per token, the page's record: the time from the server's
clock when the step was decoded to the animation frame after the page drew
it (same machine, same clock), the page's drawing time, and the server's
wall and CPU time (its decoding thread) to decode and encode the step.

    python -m experiments.scope_view_latency [--run runs/scope_tiny] [--tokens 60]

Prints a markdown table and writes runs/scope_view_latency.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments import results as results_file
from tests.scope_view_support import ViewServer, launch_chromium, make_run

ROOT = Path(__file__).resolve().parents[1]
SCOPE_TINY = {"layers": 2, "hidden": 128, "heads": 4, "seq_len": 64, "vocab": 96}


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def measure(page: Any, prompt: str, tokens: int, perturb: bool) -> list[dict[str, float]]:
    page.fill("#prompt", prompt)
    page.fill("#ntokens", str(tokens))
    page.set_checked("#use-perturb", perturb)
    page.click("#generate")
    page.wait_for_function("() => window.megascope.done === true", timeout=600_000)
    page.wait_for_function(f"() => window.megascope.latencies.length === {tokens}")
    return page.evaluate("window.megascope.latencies")  # type: ignore[no-any-return]


def summary(arm: str, rows: list[dict[str, float]]) -> dict[str, Any]:
    lat = [r["latency_ms"] for r in rows]
    return {"arm": arm, "tokens": len(rows), "latency_median_ms": statistics.median(lat),
            "latency_p90_ms": quantile(lat, 0.9), "latency_max_ms": max(lat),
            "render_median_ms": statistics.median(r["render_ms"] for r in rows),
            "server_wall_median_ms": 1000 * statistics.median(r["decode_wall_s"] for r in rows),
            "server_cpu_median_ms": 1000 * statistics.median(r["decode_cpu_s"] for r in rows)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", help="a run directory with a checkpoint (default: an untrained "
                    "model of the tiny model's size)")
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--prompt", default="The return statement")
    results_file.results_dir_option(ap)
    args = ap.parse_args(argv)
    experiment = results_file.start("scope_view_latency", argv)
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        if args.run:
            target = Path(args.run)
        else:
            print("making an untrained model of the tiny model's size ...", flush=True)
            target = make_run(Path(tmp), SCOPE_TINY, steps=2)
        load_before = os.getloadavg()
        with ViewServer(target, ("--allow-perturb",)) as srv, sync_playwright() as p:
            browser = launch_chromium(p)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(srv.url)
            page.wait_for_function("() => window.megascope.info !== null")
            results = []
            for arm, perturb in (("clean", False), ("clean + perturbed", True)):
                print(f"generating {args.tokens} tokens ({arm}) ...", flush=True)
                t0 = time.perf_counter()
                rows = measure(page, args.prompt, args.tokens, perturb)
                results.append({**summary(arm, rows), "generation_wall_s":
                                time.perf_counter() - t0, "per_token": rows})
            browser.close()
    load = {"before": load_before, "after": os.getloadavg()}
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, load average "
          f"{load['before'][0]:.1f} before / {load['after'][0]:.1f} after; model: "
          f"{args.run or 'untrained, tiny-model size'}\n")
    print("| arm | tokens | decoded → shown, median (ms) | p90 (ms) | max (ms) | page drawing, "
          "median (ms) | server decode+encode wall, median (ms) | its CPU, median (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['arm']} | {r['tokens']} | {r['latency_median_ms']:.1f} | "
              f"{r['latency_p90_ms']:.1f} | {r['latency_max_ms']:.1f} | "
              f"{r['render_median_ms']:.1f} | {r['server_wall_median_ms']:.1f} | "
              f"{r['server_cpu_median_ms']:.1f} |")
    out = ROOT / "runs"
    out.mkdir(parents=True, exist_ok=True)
    data = {"machine": {"cores": os.cpu_count(), "load": load}, "run": args.run,
            "tokens": args.tokens, "prompt": args.prompt, "results": results}
    (out / "scope_view_latency.json").write_text(json.dumps(data, indent=1))
    print(f"\nwrote {out / 'scope_view_latency.json'}")
    print(f"wrote {experiment.record(data, args.results_dir)}")


if __name__ == "__main__":
    main()
