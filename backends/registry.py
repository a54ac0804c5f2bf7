"""Every backend by name: the CLI's ``--backend`` choices and what harnesses run.

Backends load on first use (torch is heavy), so listing them costs nothing.
"""
from __future__ import annotations

import argparse
import importlib
from functools import partial
from typing import TYPE_CHECKING

from megatronapp.program.backend import (PROFILE, REPLICA, SCOPE_MODEL, STALL_TIMEOUT, Backend,
                                         RunHooks, RunOptions, ScopeModel, ScopeModelBackend)
from megatronapp.errors import UserError
from megatronapp.trace.events import RunResult, RunScenario

if TYPE_CHECKING:  # the parser is built before any scenario loads
    from megatronapp.scenario.config import Scenario

# name -> (module, class), and what ``--backend`` says of each
BACKENDS = {"sim": ("backends.sim", "SimBackend"), "torch": ("backends.torch", "TorchBackend")}
DESCRIPTIONS = {"sim": "the SimPy cluster model", "torch": "real torch.distributed ranks"}


def backend_names() -> tuple[str, ...]:
    return tuple(BACKENDS)


def get_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise UserError(f"--backend: unknown backend {name!r} (one of {', '.join(BACKENDS)})")
    module, cls = BACKENDS[name]
    backend: Backend = getattr(importlib.import_module(module), cls)()
    return backend


def add_backend_option(parser: argparse.ArgumentParser, default: str = "sim",
                       help_of: dict[str, str] | None = None) -> None:
    """``--backend`` with the registry's names as its choices (``help_of``: what
    a command says of some of them instead of their descriptions)."""
    said = {**DESCRIPTIONS, **(help_of or {})}
    parser.add_argument("--backend", default=default, choices=backend_names(),
                        help="; ".join(f"{name}: {said[name]}" for name in BACKENDS))


def check_options(backend: Backend, options: RunOptions) -> None:
    """One line naming the first option the backend cannot honour."""
    asked = {STALL_TIMEOUT: ("--stall-timeout", options.stall_timeout_s is not None),
             PROFILE: ("--profile", options.profile_dir is not None),
             REPLICA: ("--replica", options.replica)}
    for capability, (flag, wanted) in asked.items():
        if wanted and capability not in backend.capabilities:
            raise UserError(f"{flag}: the {backend.name} backend does not take it")


def run_named(name: str, options: RunOptions, scenario: Scenario,
              hooks: RunHooks = RunHooks()) -> RunResult:
    """Run ``scenario`` on the backend called ``name`` (module-level: it pickles)."""
    return get_backend(name).run(scenario, options, hooks)


def run_function(name: str, options: RunOptions = RunOptions()) -> RunScenario:
    """A scenario -> RunResult function for harnesses (validation, sweeps, studies)."""
    return partial(run_named, name, options)


def scope_model(name: str = "torch") -> ScopeModel:
    """The backend called ``name``'s runner of saved checkpoints for MegaScope
    (its ``SCOPE_MODEL`` capability), loaded on first use."""
    backend = get_backend(name)
    if SCOPE_MODEL not in backend.capabilities or not isinstance(backend, ScopeModelBackend):
        raise UserError(f"the {name} backend does not run MegaScope's checkpoints")
    return backend.scope_model()
