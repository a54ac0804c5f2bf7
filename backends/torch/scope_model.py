"""MegaScope's commands on a saved checkpoint, run by this backend
(``megatronapp.program.backend.ScopeModel``): torch and megatron-core load on
first use."""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence


@dataclass(frozen=True)
class TorchScopeModel:
    def one_rank(self) -> AbstractContextManager[None]:
        from .scope_generate import one_rank

        return one_rank()

    def generate(self, ckpt: Any, prompt: str, tokens: int, scope: Any, *, seed: int = 0,
                 k: int = 5, temperature: float = 0.0, out: Path | None = None
                 ) -> Iterator[Any]:
        from .scope_generate import generate

        return generate(ckpt, prompt, tokens, scope, seed=seed, k=k, temperature=temperature,
                        out=out)

    def load(self, target: str | Path, pp: int = 1, tp: int = 1,
             say: Callable[[str], None] | None = None) -> Any:
        from .scope_hooked import load

        return load(target, pp, tp, say) if say is not None else load(target, pp, tp)

    def import_checkpoint(self, source: Path) -> Any:
        from .scope_import import read_foreign

        return read_foreign(source)

    def logit_lens(self, model: Any, prompt: Any, k: int) -> Any:
        from .scope_lens import logit_lens

        return logit_lens(model, prompt, k)

    def activation_patching(self, model: Any, clean: Any, corrupt: Any,
                            sites: Sequence[str] | None, per: str, clean_answer: str | None,
                            corrupt_answer: str | None) -> Any:
        from .scope_lens import activation_patching

        return activation_patching(model, clean, corrupt, sites, per=per,
                                   clean_answer=clean_answer, corrupt_answer=corrupt_answer)

    def direct_logit_attribution(self, model: Any, prompt: Any, answer: str | None,
                                 baseline: str | None) -> Any:
        from .scope_lens import direct_logit_attribution

        return direct_logit_attribution(model, prompt, answer, baseline)
