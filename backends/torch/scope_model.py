"""MegaScope's commands on a saved checkpoint, run by this backend in one
process (``megatronapp.program.backend.ScopeModel``): torch and megatron-core
load on first use."""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence


@dataclass(frozen=True)
class TorchScopeModel:
    def quiet(self) -> None:
        from .worker import quiet_megatron_warnings

        quiet_megatron_warnings()

    def checkpoint_dir(self, target: str | Path) -> Path:
        from .scope_cache import checkpoint_dir

        return checkpoint_dir(target)

    def one_rank(self) -> AbstractContextManager[None]:
        from .scope_generate import one_rank

        return one_rank()

    def generate(self, ckpt: Any, prompt: str, tokens: int, scope: Any, *, seed: int = 0,
                 k: int = 5, temperature: float = 0.0, out: Path | None = None
                 ) -> Iterator[Any]:
        from .scope_generate import generate

        return generate(ckpt, prompt, tokens, scope, seed=seed, k=k, temperature=temperature,
                        out=out)

    def logit_lens(self, checkpoint: str | Path, prompt: str, k: int, *, pp: int = 1,
                   tp: int = 1) -> Any:
        from .scope_lens import logit_lens

        return logit_lens(checkpoint, prompt, k, pp=pp, tp=tp)

    def activation_patching(self, checkpoint: str | Path, clean: str, corrupt: str,
                            sites: Sequence[str], clean_answer: str | None,
                            corrupt_answer: str | None, *, pp: int = 1, tp: int = 1) -> Any:
        from .scope_lens import activation_patching

        return activation_patching(checkpoint, clean, corrupt, sites, clean_answer,
                                   corrupt_answer, pp=pp, tp=tp)

    def direct_logit_attribution(self, checkpoint: str | Path, prompt: str,
                                 answer: str | None, baseline: str | None, *, pp: int = 1,
                                 tp: int = 1) -> Any:
        from .scope_lens import direct_logit_attribution

        return direct_logit_attribution(checkpoint, prompt, answer, baseline, pp=pp, tp=tp)
