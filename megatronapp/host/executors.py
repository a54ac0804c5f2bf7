"""Where many independent runs execute: here, local processes, or a Ray cluster.

Harnesses (sweeps, detector validation) hand a module-level function and its
tasks to ``map_unordered`` and get the results in completion order. Local
processes are the default; ``ray_address`` sends every task to a running Ray
cluster (``ray start --head`` on some machine; ``pip install 'megatronapp[ray]'``).
The cluster's workers receive this checkout's packages with the tasks, so they
run the same code as the driver without installing it.
"""
from __future__ import annotations

import argparse
import importlib
import multiprocessing as mp
import os
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from ..errors import UserError

PACKAGES = ("megatronapp", "backends", "sim")  # shipped to Ray workers


@dataclass(frozen=True)
class Where:
    """``jobs`` local processes (1 = in this process), or a Ray cluster's address."""

    jobs: int = 1
    ray_address: str | None = None

    def describe(self) -> str:
        if self.ray_address:
            return f"Ray cluster at {self.ray_address}"
        return "this process" if self.jobs <= 1 else f"{self.jobs} local processes"


def map_unordered(fn: Callable[[Any], Any], tasks: Sequence[Any], where: Where,
                  on_done: Callable[[], None] = lambda: None) -> Iterator[Any]:
    """``fn(task)`` for every task, yielded as each finishes (``fn`` must be a
    module-level function: it is pickled)."""
    if where.ray_address:
        yield from _on_ray(fn, tasks, where.ray_address, on_done)
    elif where.jobs <= 1 or len(tasks) <= 1:
        for task in tasks:
            yield fn(task)
            on_done()
    else:
        yield from _on_processes(fn, tasks, where.jobs, on_done)


def _on_processes(fn: Callable[[Any], Any], tasks: Sequence[Any], jobs: int,
                  on_done: Callable[[], None]) -> Iterator[Any]:
    with ProcessPoolExecutor(max_workers=min(jobs, len(tasks)),
                             mp_context=mp.get_context("spawn")) as pool:
        pending = {pool.submit(fn, task) for task in tasks}
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                yield future.result()
                on_done()


def _ray() -> Any:
    try:
        return importlib.import_module("ray")
    except ImportError:
        raise UserError("--ray: Ray is not installed (pip install 'megatronapp[ray]')") from None


def _on_ray(fn: Callable[[Any], Any], tasks: Sequence[Any], address: str,
            on_done: Callable[[], None]) -> Iterator[Any]:
    ray = _ray()
    modules = [importlib.import_module(p) for p in PACKAGES]
    try:
        ray.init(address=address, log_to_driver=False, runtime_env={"py_modules": modules})
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise UserError(f"--ray: cannot connect to {address}: {str(err).splitlines()[0]}") from None
    try:
        remote = ray.remote(fn)
        pending = [remote.remote(task) for task in tasks]
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            yield ray.get(done[0])
            on_done()
    finally:
        ray.shutdown()


# ------------------------------------------------------------ command line
def where_from(args: argparse.Namespace) -> Where:
    """``--jobs`` local processes, or ``--ray ADDRESS``."""
    if args.jobs is not None and args.jobs < 1:
        raise UserError("--jobs: must be >= 1")
    most = 4 * (os.cpu_count() or 1)
    if args.jobs is not None and args.jobs > most:
        raise UserError(f"--jobs: {args.jobs} processes is more than this machine runs "
                        f"usefully (at most {most})")
    if args.ray is not None and not args.ray.strip():
        raise UserError("--ray: give the cluster's address, e.g. 127.0.0.1:6379")
    return Where(jobs=args.jobs or os.cpu_count() or 1, ray_address=args.ray)


def add_where_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--jobs", type=int, default=None,
                        help="local processes (default: one per CPU core)")
    parser.add_argument("--ray", metavar="ADDRESS", default=None,
                        help="run every task on the Ray cluster at ADDRESS instead "
                             "(e.g. 127.0.0.1:6379; needs pip install 'megatronapp[ray]')")
