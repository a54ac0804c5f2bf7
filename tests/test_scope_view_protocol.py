"""The view's protocol, frames and data shaping, without a server.

Client messages are refused for size, syntax, schema and bounds; a Python
expression is a string like any other; binary frames round-trip; the arrays a
step sends are the capture rows laid out by layer and token; training series
are the per-step means; a directory that is not a capture is a one-line error.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatronapp.errors import UserError
from megatronapp.scope.generate import GenerationStep, StepView, TopK
from megatronapp.scope.view.protocol import (MAX_MESSAGE_BYTES, Generate, Refused, Series,
                                              decode_frame, encode_frame, parse_message)
from megatronapp.scope.view.source import TrainingSeries, open_source
from megatronapp.scope.view.steps import step_message

EXPRESSION = "__import__('os').system('touch /tmp/megascope-pwned')"


def gen(**fields: object) -> str:
    return json.dumps({"type": "generate", "prompt": "def", **fields})


@pytest.mark.parametrize("text, where", [
    ("{not json", "not JSON"),
    (json.dumps({"type": "exec", "code": "1+1"}), "type"),
    (json.dumps({"prompt": "x"}), "message"),
    (gen(extra=1), "extra"),
    (gen(tokens=0), "tokens"),
    (gen(tokens=10_000), "tokens"),
    (gen(top_k=21), "top_k"),
    (gen(prompt=""), "prompt"),
    (gen(prompt="x" * 257), "prompt"),
    (gen(perturb={"kind": "act_noise", "sigma": 6.0}), "perturb.sigma"),
    (gen(perturb={"kind": "act_offset", "value": -11}), "perturb.value"),
    (gen(perturb={"kind": "param_bitflip"}), "perturb.kind"),
    (gen(perturb={"kind": "act_noise", "site": "os.system"}), "perturb.site"),
    (gen(perturb={"kind": "head_mask", "heads": list(range(65))}), "perturb.heads"),
    ('{"type": "generate", "prompt": "x", "perturb": {"kind": "act_noise", "sigma": NaN}}',
     "perturb.sigma"),
    (json.dumps({"type": "series", "site": "s" * 65, "stat": "mean"}), "series.site"),
])
def test_malformed_messages_are_refused_naming_the_field(text: str, where: str) -> None:
    with pytest.raises(Refused) as err:
        parse_message(text)
    assert where in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("fields, where", [
    ({"tokens": True}, "tokens"),
    ({"tokens": "5"}, "tokens"),
    ({"tokens": 5.0}, "tokens"),
    ({"top_k": True}, "top_k"),
    ({"top_k": "3"}, "top_k"),
    ({"perturb": {"kind": "act_noise", "layer": True}}, "perturb.layer"),
    ({"perturb": {"kind": "act_noise", "layer": "1"}}, "perturb.layer"),
    ({"perturb": {"kind": "act_noise", "sigma": "0.1"}}, "perturb.sigma"),
    ({"perturb": {"kind": "act_offset", "value": True}}, "perturb.value"),
    ({"perturb": {"kind": "head_mask", "heads": [0, True]}}, "perturb.heads.1"),
    ({"perturb": {"kind": "head_mask", "heads": ["1"]}}, "perturb.heads.0"),
])
def test_numbers_are_strictly_typed(fields: dict[str, object], where: str) -> None:
    """A boolean or a string is not a number, and a float is not an integer."""
    with pytest.raises(Refused) as err:
        parse_message(gen(**fields))
    assert where in str(err.value)


def test_an_integer_is_a_number() -> None:
    m = parse_message(gen(perturb={"kind": "act_offset", "value": 2}))
    assert isinstance(m, Generate) and m.perturb is not None and m.perturb.value == 2.0


@pytest.mark.parametrize("opening, closing", [("[", "]"), ('{"a":', "}")])
def test_deep_nesting_is_refused_as_a_message_error(opening: str, closing: str) -> None:
    """As deep as fits in a message (2,047 lists): parsing must not recurse without bound."""
    depth = (MAX_MESSAGE_BYTES - 1) // (len(opening) + len(closing))
    text = opening * depth + "1" + closing * depth
    assert len(text.encode()) <= MAX_MESSAGE_BYTES
    with pytest.raises(Refused) as err:
        parse_message(text)
    assert "not JSON" in str(err.value) and "recursion" in str(err.value)


def test_an_oversized_message_is_refused_before_it_is_parsed() -> None:
    text = gen(prompt="a" * MAX_MESSAGE_BYTES)
    with pytest.raises(Refused, match="over 4096 bytes"):
        parse_message(text)
    # multi-byte characters count as bytes, not characters
    with pytest.raises(Refused, match="over"):
        parse_message(gen(prompt="é" * (MAX_MESSAGE_BYTES // 2)))


def test_a_python_expression_is_data() -> None:
    m = parse_message(gen(prompt=EXPRESSION))
    assert isinstance(m, Generate) and m.prompt == EXPRESSION
    s = parse_message(json.dumps({"type": "series", "site": EXPRESSION[:64], "stat": "mean"}))
    assert isinstance(s, Series) and s.site == EXPRESSION[:64]
    assert not Path("/tmp/megascope-pwned").exists()


def test_a_perturbation_becomes_its_scope_entry() -> None:
    m = parse_message(gen(perturb={"kind": "act_noise", "site": "mlp.out", "layer": 2,
                                   "sigma": 0.5}))
    assert isinstance(m, Generate) and m.perturb is not None
    assert m.perturb.scope_entry() == {"kind": "act_noise", "layers": [2], "site": "mlp.out",
                                       "sigma": 0.5, "relative": True}
    h = parse_message(gen(perturb={"kind": "head_mask", "layer": 1, "heads": [3]}))
    assert isinstance(h, Generate) and h.perturb is not None
    assert h.perturb.scope_entry() == {"kind": "head_mask", "layers": [1], "heads": [3]}


shapes = st.lists(st.integers(1, 5), min_size=1, max_size=3)


@given(st.lists(shapes, min_size=1, max_size=4), st.text(max_size=20))
def test_frames_round_trip(shape_list: list[list[int]], word: str) -> None:
    rng = np.random.default_rng(len(shape_list))
    arrays = {f"a{i}": rng.normal(size=s).astype(np.float32) for i, s in enumerate(shape_list)}
    header, back = decode_frame(encode_frame({"kind": "x", "word": word}, arrays))
    assert header["kind"] == "x" and header["word"] == word
    assert list(back) == list(arrays)
    for name, a in arrays.items():
        np.testing.assert_array_equal(back[name], a)


def test_frame_data_starts_on_a_float32_boundary() -> None:
    for n in range(8):
        frame = encode_frame({"pad": "x" * n}, {"a": np.ones(3)})
        (length,) = np.frombuffer(frame[:4], dtype="<u4")
        assert (4 + int(length)) % 4 == 0


def _step() -> GenerationStep:
    rows = [
        {"layer": 1, "site": "attn.q", "head": 0, "token": 0, "stat": "std", "value": 1.0,
         "index": None, "values": None},
        {"layer": 1, "site": "attn.q", "head": 1, "token": 0, "stat": "std", "value": 3.0,
         "index": None, "values": None},
        {"layer": 2, "site": "resid_post", "head": -1, "token": 1, "stat": "mean", "value": -4.0,
         "index": None, "values": None},
        {"layer": 2, "site": "attn.q", "head": 1, "token": 1, "stat": "pixels_absmax(2)",
         "value": None, "index": [0, 1], "values": [5.0, 6.0]},
        {"layer": 2, "site": "resid_post", "head": -1, "token": -1, "stat": "mean",
         "value": 9.0, "index": None, "values": None},  # pooled: not a token's cell
    ]
    attention = {1: np.eye(2)[None].repeat(2, 0), 2: np.full((2, 2, 2), 0.5)}
    pca = {1: np.arange(4.0).reshape(2, 2), 2: -np.arange(4.0).reshape(2, 2)}
    view = StepView(7, "h", 0.25, [TopK(7, "h", 0.25), TopK(3, "d", 0.2)], attention, pca, rows)
    return GenerationStep(3, 2, [3, 7], view)


def test_a_steps_arrays_lay_the_rows_out_by_layer_and_token() -> None:
    header, arrays = step_message(_step(), layers=2, decode=lambda ids: "dh"[ids[0] == 7],
                                  decoded_at=1.5)
    assert header["window"] == ["d", "h"] and header["clean"]["prob"] == 0.25
    assert "perturbed" not in header
    std = arrays["clean/stats/attn.q/std"]
    assert std.shape == (2, 2) and std[0, 0] == 2.0  # mean over heads
    assert np.isnan(std[0, 1]) and np.isnan(std[1]).all()
    mean = arrays["clean/stats/resid_post/mean"]
    assert mean[1, 1] == -4.0 and np.isnan(mean[0]).all()  # the pooled row is not a token
    px = arrays["clean/pixels/attn.q"]
    assert px.shape == (2, 2, 4)  # head 1's blocks sit beside head 0's
    np.testing.assert_array_equal(px[1, 1], [np.nan, np.nan, 5.0, 6.0])
    np.testing.assert_array_equal(arrays["clean/pca/layer2"], -np.arange(4.0).reshape(2, 2))
    assert arrays["clean/attention/layer1"].shape == (2, 2, 2)


def test_training_series_are_per_step_means() -> None:
    table = pa.table({
        "step": [0, 0, 0, 10, 10, 10, 0],
        "layer": [1, 1, 2, 1, 2, 2, 1],
        "site": ["resid_post"] * 7,
        "stat": ["std"] * 5 + ["hist", "std"],
        "value": [1.0, 3.0, 5.0, 7.0, 9.0, None, float("nan")],  # a NaN row is left out
    })
    s = TrainingSeries.of(table)
    assert s.steps.tolist() == [0, 10] and s.layers == [1, 2]
    np.testing.assert_array_equal(s.values[("resid_post", "std")], [[2.0, 7.0], [5.0, 9.0]])
    assert s.names() == {"resid_post": ["std"]}
    assert not math.isnan(s.values[("resid_post", "std")].sum())


def test_a_directory_that_is_not_a_capture_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not a MegaScope capture"):
        open_source(tmp_path)
    with pytest.raises(UserError, match="not a directory"):
        open_source(tmp_path / "missing")
    (tmp_path / "manifest.json").write_text('{"format": "something-else"}')
    with pytest.raises(UserError, match="no megascope-capture manifest"):
        open_source(tmp_path)
