"""Fit each device's efficiency constants on its fitted published rows and
write them to megatronapp/scenario/device_fits.yaml (the data every named
device's scenarios use).

The rows each device is fitted on are marked ``fitted`` in
scenarios/published/runs.yaml (A100: Narayanan et al. 2021 Table 1 rows 1
and 7; H100: the Megatron-LM README's 32B, 119B and 314B rows); the constants
fitted are ``DEVICE_KNOBS`` in megatronapp/fidelity/published.py. Every other
published row is held out. Prints the constants and each fitted row's
residual.

    python paper_figs/fit_devices.py [--device NAME ...]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatronapp.scenario.config import Scenario  # noqa: E402
from megatronapp.scenario.devices import DEVICES, FITS_FILE, load_fits  # noqa: E402
from megatronapp.fidelity.predict import steady_state_s  # noqa: E402
from megatronapp.fidelity.published import DEVICE_KNOBS, fit_device, published_runs  # noqa: E402
from sim import simulate_iteration_times  # noqa: E402


def replica_time(s: Scenario) -> float:
    return steady_state_s(simulate_iteration_times(s, replica=True))


def write_fits(fits: dict[str, dict], path: Path = FITS_FILE) -> None:
    """The fits file with its header comment kept, replaced atomically."""
    header = "".join(line for line in path.read_text().splitlines(keepends=True)
                     if line.startswith("#"))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(header + yaml.safe_dump(fits, sort_keys=True, width=100))
    os.replace(tmp, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", action="append", choices=sorted(DEVICE_KNOBS),
                        help="fit only this device (repeatable; default: every fitted device)")
    args = parser.parse_args()
    runs = published_runs(ROOT)
    fits = load_fits()
    for device in args.device or sorted(DEVICE_KNOBS):
        t0 = time.perf_counter()
        constants, fit = fit_device(runs, device, replica_time,
                                    {d: f["constants"] for d, f in fits.items()},
                                    progress=lambda m: print(m, file=sys.stderr, flush=True))
        rows = [r.source for r in runs if r.fitted and r.device == device]
        print(f"{device}: fitted on {len(rows)} rows in {time.perf_counter() - t0:.0f} s, "
              f"{fit.steps} Gauss-Newton steps: "
              + ", ".join(f"{k} = {v:.4f}" for k, v in constants.items()))
        for source, residual in zip(rows, fit.residuals):
            print(f"  {source}: simulated / published time - 1 = {residual * 100:+.1f}%")
        fits[device] = {"fitted_on": DEVICES[device].fitted_on,
                        "constants": {k: round(v, 4) for k, v in constants.items()}}
        write_fits(fits)
    return 0


if __name__ == "__main__":
    sys.exit(main())
