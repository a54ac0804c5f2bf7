"""Regenerate the plot images in docs/img from real runs: the quick-start
scenario's four figures (``plot-*.png``), and with ``--zoo`` the heat map of
an ordinary DDP job's torch.profiler trace with rank 1 slowed 2x
(``plot-zoo_ddp_heatmap.png``: one column per op class).

    .venv/bin/python -m experiments.plot_figures [--zoo] [--out docs/img]
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from experiments import results
from megatronapp.cli import main as cli

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ("timeline", "scan_heatmap", "scan_marey", "dpp_windows")


def quick_start_figures(tmp: Path, out: Path) -> list[Path]:
    run = tmp / "throttle"  # the folder's name is the figures' title
    for argv in (["run", str(ROOT / "scenarios" / "throttle.yaml"), "--out", str(run),
                  "--quiet"], ["plot", str(run)]):
        if cli(argv) != 0:
            raise SystemExit(f"megatronapp {argv[0]} failed")
    return [Path(shutil.copyfile(run / f"{name}.png", out / f"plot-{name}.png"))
            for name in FIGURES]


def zoo_heatmap(tmp: Path, out: Path) -> Path:
    job = tmp / "zoo_ddp"
    subprocess.run([sys.executable, str(ROOT / "tests" / "zoo" / "ddp_mlp.py"), "--out",
                    str(job), "--slow-rank", "1", "--factor", "2"], check=True, cwd=ROOT)
    if cli(["plot", str(job)]) != 0:
        raise SystemExit("megatronapp plot failed on the zoo trace")
    return Path(shutil.copyfile(job / "scan_heatmap.png", out / "plot-zoo_ddp_heatmap.png"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    parser.add_argument("--zoo", action="store_true", help="also the DDP zoo job's heat map")
    results.results_dir_option(parser)
    args = parser.parse_args(argv)
    run = results.start("plot_figures", argv)
    with tempfile.TemporaryDirectory() as tmp:
        written = quick_start_figures(Path(tmp), args.out)
        if args.zoo:
            written.append(zoo_heatmap(Path(tmp), args.out))
    for path in written:
        print(f"wrote {path}")
    recorded = run.record({"scenario": "scenarios/throttle.yaml", "zoo": args.zoo,
                           "figures": [results.shown(p) for p in written]}, args.results_dir)
    print(f"wrote {recorded}")


if __name__ == "__main__":
    main()
