"""A generation stopped part-way (a signal, a consumer that stops reading)
closes its capture sessions and leaves the merge undone: its output is thrown
away, and merging it would make the stop as slow as the run had been long.
A generation that ran every step is merged."""
from __future__ import annotations

from pathlib import Path

import pytest

from backends.torch.scope_generate import generate, initial_state, one_rank
from megatronapp.scenario.checkpoint import read_checkpoint, write_checkpoint
from megatronapp.scenario.config import Data, parse_scenario
from megatronapp.scope.cli import generation_scope

pytestmark = pytest.mark.slow

MERGED = "pca.safetensors"  # written by the merge alone


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):
    s = parse_scenario({"model": {"layers": 2, "hidden": 32, "heads": 4, "seq_len": 12,
                                  "vocab": 40}, "data": {"kind": "random"}})
    path = tmp_path_factory.mktemp("ckpt") / "ckpt"
    with one_rank():
        write_checkpoint(path, initial_state(s), s.model, Data(kind="text"), {"iterations": 0})
    return read_checkpoint(path)


def _steps(ckpt, out: Path, tokens: int, read: int) -> int:
    scope = generation_scope(ckpt, None, [], 0)
    with one_rank():
        steps = generate(ckpt, "ab", tokens, scope, out=out)
        taken = [next(steps) for _ in range(read)]
        steps.close()  # what a stop does to it: GeneratorExit at its last yield
    return len(taken)


def test_a_generation_stopped_part_way_is_not_merged(ckpt, tmp_path: Path) -> None:
    out = tmp_path / "gen"
    out.mkdir()
    assert _steps(ckpt, out, tokens=50, read=3) == 3
    assert not (out / MERGED).exists()


def test_a_generation_that_ran_every_step_is_merged(ckpt, tmp_path: Path) -> None:
    out = tmp_path / "gen"
    out.mkdir()
    scope = generation_scope(ckpt, None, [], 0)
    with one_rank():
        records = list(generate(ckpt, "ab", 3, scope, out=out))
    assert len(records) == 3
    assert (out / MERGED).exists() and (out / "clean").is_dir()
