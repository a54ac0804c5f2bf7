"""Everything about writing the device profiles' fitted constants lives here.

``megatronapp fidelity fit`` fits each software generation's constants
(``published.GENERATION_KNOBS``) on its fitted rows of
``scenarios/published/runs.yaml`` and writes them, with the rows they were
fitted on, into the package data ``megatronapp/scenario/device_fits.yaml``
(replaced whole, its header kept). The simulation is handed in.
"""
from __future__ import annotations

import fcntl
import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import yaml

from ..io import gate
from ..io.outdirs import new_file
from ..scenario.devices import FITS_FILE, load_fits
from .fit import Mapper, SimulateTime
from .published import (GENERATION_KNOBS, Generation, PublishedRun, fit_generation,
                        published_runs)


@dataclass(frozen=True)
class GenerationFit:
    generation: Generation
    constants: dict[str, float]
    rows: tuple[str, ...]  # the fitted rows' sources
    residuals: tuple[float, ...]  # simulated over published time, minus one, per row
    steps: int


def fitted_on(sources: Sequence[str]) -> str:
    """The rows named once: their common source, then each row's own part."""
    heads = {s.rsplit(", ", 1)[0] for s in sources}
    if len(heads) == 1 and all(", " in s for s in sources):
        return f"{heads.pop()}: " + ", ".join(s.rsplit(", ", 1)[1] for s in sources)
    return "; ".join(sources)


def fit_generations(runs: Sequence[PublishedRun], wanted: Sequence[Generation],
                    simulate: SimulateTime, current: dict[Generation, dict[str, float]],
                    progress: Callable[[str], None] | None = None, mapper: Mapper = map,
                    steps: int = 6) -> Iterator[GenerationFit]:
    """Each wanted generation fitted in ``GENERATION_KNOBS`` order, yielded as it is
    done; a generation that keeps another's constant takes it from this fit or,
    not refitted, ``current``."""
    fitted = dict(current)
    for generation in GENERATION_KNOBS:
        if generation not in wanted:
            continue
        if progress:
            progress(f"fitting {generation[0]}, {generation[1]}")
        constants, fit = fit_generation(runs, generation, simulate, fitted, progress,
                                        mapper=mapper, steps=steps)
        fitted[generation] = constants
        rows = tuple(r.source for r in runs if r.fitted and r.generation == generation)
        yield GenerationFit(generation, constants, rows, fit.residuals, fit.steps)


def current_constants(fits: dict[str, Any]) -> dict[Generation, dict[str, float]]:
    return {(device, software): dict(f.get("constants", {}))
            for device, by_software in fits.items() for software, f in by_software.items()
            if isinstance(f, dict)}


def write_fits(results: Sequence[GenerationFit], path: Path = FITS_FILE) -> None:
    """The fits file with these generations' constants, its header and the others
    kept, replaced atomically (a device's first generation becomes its default);
    fits of other generations written meanwhile by another process are kept."""
    name = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    with open(Path(tempfile.gettempdir()) / f"megatronapp-fits-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # beside the file it would be package data
        _write_fits(results, path)


def _write_fits(results: Sequence[GenerationFit], path: Path) -> None:
    fits = load_fits(path)
    for r in results:
        device, software = r.generation
        entry = fits.setdefault(device, {})
        entry.setdefault("default", software)
        entry[software] = {"constants": {k: round(v, 4) for k, v in r.constants.items()},
                           "fitted_on": fitted_on(r.rows)}
    header = "".join(line for line in gate.read_text(path, "fits", gate.MAX_TEXT_BYTES)
                     .splitlines(keepends=True) if line.startswith("#"))
    with new_file(path, "fits", force=True) as tmp:  # the fits file is replaced whole
        tmp.write_text(header + yaml.safe_dump(fits, sort_keys=True, width=100))


def fit_lines(r: GenerationFit) -> list[str]:
    lines = [f"{r.generation[0]}, {r.generation[1]}: fitted on {len(r.rows)} rows in "
             f"{r.steps} Gauss-Newton steps: "
             + ", ".join(f"{k} = {v:.4f}" for k, v in r.constants.items())]
    lines += [f"  {source}: simulated / published time - 1 = {res * 100:+.1f}%"
              for source, res in zip(r.rows, r.residuals)]
    return lines


def parse_generation(text: str) -> Generation:
    """``DEVICE:SOFTWARE`` as one of the fitted generations (ValueError otherwise)."""
    device, _, software = text.partition(":")
    if (device, software) not in GENERATION_KNOBS:
        known = ", ".join(f"{d}:{s}" for d, s in GENERATION_KNOBS)
        raise ValueError(f"{text!r} is not a fitted generation ({known})")
    return device, software


def fit_command(root: Path, wanted: Sequence[Generation], simulate: SimulateTime,
                progress: Callable[[str], None], mapper: Mapper = map,
                steps: int = 6) -> list[str]:
    """Fit each wanted generation (all where none is named), writing the fits file
    after each, and the report's lines."""
    runs = published_runs(root)
    lines = []
    for result in fit_generations(runs, wanted or list(GENERATION_KNOBS), simulate,
                                  current_constants(load_fits()), progress, mapper, steps):
        write_fits([result])
        lines += fit_lines(result)
    return lines
