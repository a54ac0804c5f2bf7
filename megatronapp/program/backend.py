"""What a backend is, as the CLI and the harnesses see it.

A backend runs a scenario's rank programs and hands back a ``RunResult``:
the simulator (``sim``) or real torch.distributed ranks (``backends.torch``).
It has a name, says what it can do (``capabilities``), and takes typed
options and hooks; the registry (``backends.registry``) names them all.
Everything here is data: the core never imports a backend.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import (TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Protocol, Sequence,
                    runtime_checkable)

from ..io.progress import Say, quiet
from ..trace.events import Event, RunResult

if TYPE_CHECKING:  # pydantic loads with the scenario, not with --help
    from ..costs.run_size import RunSize
    from ..scenario.config import Scenario

# What a backend may declare it can do (the CLI checks options against these).
REAL = "real"  # runs real processes: one trial at a time, on this machine
STALL_TIMEOUT = "stall_timeout"  # stops ranks that make no progress (RunOptions.stall_timeout_s)
PROFILE = "profile"  # writes torch.profiler traces (RunOptions.profile_dir)
REPLICA = "replica"  # may run one data-parallel replica for all (RunOptions.replica)
SCOPE_MODEL = "scope_model"  # runs a saved checkpoint for MegaScope (``ScopeModelBackend``)
# its runs are counted before they start (``size``) and cost what ``host.limits`` models
ESTIMATED = "estimated"


@dataclass
class StopRequest:
    """Asks a running job to stop at its next iteration boundary (the closed
    loop sets ``requested`` from an event hook); a backend that stops says the
    last iteration its ranks finished."""

    requested: bool = False
    stopped_after: int | None = None


@dataclass(frozen=True)
class RunOptions:
    """How to run, beyond the scenario; a backend refuses what it cannot do
    (``capabilities``) before it starts."""

    stall_timeout_s: float | None = None  # None: the backend's own default
    profile_dir: Path | None = None
    out_dir: Path | None = None  # the run directory: captures and checkpoints go there
    replica: bool = False  # simulate data-parallel replica 0 for all (no faults or jitter)
    # the closed loop on real ranks: mid-run checkpoints into out_dir, a resume from one, a stop
    checkpoint_every: int | None = None
    resume_iteration: int = 0  # > 0: start from out_dir's checkpoint after this many iterations
    stop: StopRequest | None = None


@dataclass(frozen=True)
class RunHooks:
    """Where a backend reports while it runs; each uses what it has: the compiled
    simulator counts operations, event-by-event backends hand over each event.
    Observing never changes how a backend runs."""

    on_phase: Say = quiet  # what the run is doing now (spawning, simulating)
    operations: Callable[[int, int], None] | None = None  # (done since the last call, total)
    events: Callable[[int, Event], None] | None = None  # (rank, event) as each is recorded


class Backend(Protocol):
    """A named interpreter of rank programs."""

    @property
    def name(self) -> str: ...

    @property
    def capabilities(self) -> frozenset[str]: ...

    def run(self, scenario: Scenario, options: RunOptions, hooks: RunHooks) -> RunResult: ...

    def size(self, scenario: Scenario) -> RunSize | None:
        """What ``run`` will do, counted before it starts (None: not countable)."""

class ScopeModel(Protocol):
    """What MegaScope's commands on a saved checkpoint (``scope generate``,
    ``serve`` with live generation, ``import``, ``lens``, ``patch``, ``dla``)
    ask of the backend that runs it: ``load`` builds the model object once (in
    this process, or split ``pp`` × ``tp`` over worker processes), the
    analyses take it."""

    def one_rank(self) -> ContextManager[None]: ...

    def generate(self, ckpt: Any, prompt: str, tokens: int, scope: Any, *, seed: int = 0,
                 k: int = 5, temperature: float = 0.0, out: Path | None = None
                 ) -> Iterator[Any]: ...

    def load(self, target: str | Path, pp: int = 1, tp: int = 1,
             say: Callable[[str], None] | None = None) -> Any: ...

    def import_checkpoint(self, source: Path) -> Any:
        """A foreign checkpoint folder read as ``megatronapp.scope.imports.Imported``."""

    def logit_lens(self, model: Any, prompt: Any, k: int) -> Any: ...

    def activation_patching(self, model: Any, clean: Any, corrupt: Any,
                            sites: Sequence[str] | None, per: str, clean_answer: str | None,
                            corrupt_answer: str | None) -> Any: ...

    def direct_logit_attribution(self, model: Any, prompt: Any, answer: str | None,
                                 baseline: str | None) -> Any: ...


@runtime_checkable
class ScopeModelBackend(Backend, Protocol):
    """A backend with the ``SCOPE_MODEL`` capability."""

    def scope_model(self) -> ScopeModel: ...
