"""model.position_embedding_type: only learned absolute positions are weights
(megatron-core's LanguageModelEmbedding); rotary and no positions hold none."""
from __future__ import annotations

import pytest

from megatronapp.costs.memory import stage_params
from megatronapp.scenario.config import ScenarioError, parse_scenario

MODEL = {"layers": 4, "hidden": 256, "heads": 4, "seq_len": 1024, "vocab": 512}


def first_stage_params(kind: str | None) -> int:
    model = dict(MODEL) if kind is None else {**MODEL, "position_embedding_type": kind}
    return stage_params(parse_scenario({"parallel": {"pp": 2}, "model": model}), 0)


@pytest.mark.parametrize("kind", ["rope", "none"])
def test_only_learned_positions_are_seq_len_by_hidden_weights(kind: str) -> None:
    assert first_stage_params(None) == first_stage_params("learned_absolute")
    assert first_stage_params("learned_absolute") - first_stage_params(kind) == 1024 * 256


def test_an_unknown_kind_is_refused_naming_the_field() -> None:
    with pytest.raises(ScenarioError) as err:
        first_stage_params("alibi")
    assert err.value.field == "model.position_embedding_type"


def test_the_torch_backend_refuses_positions_it_does_not_learn() -> None:
    from backends.torch import check_supported

    with pytest.raises(ScenarioError) as err:
        check_supported(parse_scenario({"model": {**MODEL, "position_embedding_type": "rope"}}))
    assert err.value.field == "model.position_embedding_type"
