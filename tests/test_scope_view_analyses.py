"""The lens, patching and attribution results the page shows: listed from beside
the capture, validated, sent on request by name only.

Results are written by ``megatronapp.scope.lens.save`` as ``scope lens``,
``scope patch`` and ``scope dla`` write them; the page gets the fields it draws, non-finite
numbers as null; a file that is not a result, a name not listed and a path
are refused; a broken file is one line naming it and the field.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatronapp.errors import UserError
from megatronapp.scope.lens import DlaResult, LensResult, PatchResult, result_name, save
from megatronapp.scope.storage import find_capture
from megatronapp.scope.view import analyses
from megatronapp.scope.view.protocol import Analysis, Refused, parse_message
from tests.scope_view_support import ViewServer, client, run_dir  # noqa: F401 - a fixture

PROMPT = "def f(x):"
CHARS = [chr(c) for c in range(32, 127)]


def lens_result(prompt: str = PROMPT, rows: int = 3) -> LensResult:
    ids = [CHARS.index(c) for c in prompt]
    logits = np.random.default_rng(0).normal(size=(rows, len(ids), len(CHARS)))
    named = {f"resid_pre {r + 1}": logits[r] for r in range(rows)}
    return LensResult.of(prompt, list(prompt), ids, named, 3, lambda i: CHARS[i[0]])


def patch_result() -> PatchResult:
    restored = np.random.default_rng(1).uniform(-1, 1, size=(2, 2, 5))
    restored[0, 0, 0] = np.nan
    return PatchResult("is an", "is on", list("is on"), ("a", "o"), ["resid_pre", "mlp.out"],
                       [1, 2], restored)


def dla_result() -> DlaResult:
    rng = np.random.default_rng(2)
    parts = {"embed": 0.25, "attn_bias": rng.normal(size=2), "mlp": rng.normal(size=2),
             "norm_bias": -0.125}
    heads = rng.normal(size=(2, 4))
    total = float(heads.sum() + sum(np.sum(v) for v in parts.values()))
    return DlaResult(PROMPT, list(PROMPT), (" ", "n"), [1, 2], heads, parts, total)


def store(capture: Path, kind: str, record: dict[str, object], *texts: str) -> str:
    name = result_name(kind, *texts)
    save(capture, name, record, force=False)
    return name


@pytest.fixture
def capture(tmp_path: Path) -> Path:
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "megascope-capture"}))
    return tmp_path


def test_stored_results_are_listed_and_read_with_their_fields(capture: Path) -> None:
    lens = lens_result()
    lens_name = store(capture, "lens", lens.to_json(), PROMPT)
    patch_name = store(capture, "patch", patch_result().to_json(), "is an", "is on")
    listed = analyses.listed(capture)
    assert set(listed) == {lens_name, patch_name}  # not manifest.json
    assert PROMPT in listed[lens_name] and "is on" in listed[patch_name]
    view = analyses.read(capture / f"{lens_name}.json")
    assert isinstance(view, analyses.LensView)
    assert view.rank == lens.ranks.tolist() and view.rows == lens.rows
    assert [[t.token for t in pos] for pos in view.top[1]] == [
        [t.token for t in pos] for pos in lens.top[1]]


def test_a_stored_attribution_is_listed_and_read_with_its_fields(capture: Path) -> None:
    dla = dla_result()
    name = store(capture, "dla", dla.to_json(), PROMPT, "", "")
    assert analyses.listed(capture) == {name: f"dla: {PROMPT!r}, ' ' over 'n'"}
    view = analyses.read(capture / f"{name}.json")
    assert isinstance(view, analyses.DlaView)
    assert view.heads == dla.heads.tolist() and view.answers == dla.answers
    assert view.mlp == dla.parts["mlp"].tolist() and view.embed == dla.parts["embed"]
    assert view.logit_diff == dla.logit_diff


@pytest.mark.parametrize("field, value, reason", [
    ("norm_bias", None, "norm_bias: Field required"),
    ("heads", [[0.5] * 4], "heads: Value error, one per layer expected, got 1 for 2 layers"),
    ("mlp", [0.5, 0.5, 0.5], "mlp: Value error, one per layer expected, got 3 for 2 layers"),
    ("heads", [[0.5] * 4, [0.5] * 3], "heads: Value error, layers with different numbers"),
])
def test_a_broken_attribution_is_one_line_naming_the_file_and_field(
        capture: Path, field: str, value: object, reason: str) -> None:
    record = dla_result().to_json()
    if value is None:
        del record[field]
    else:
        record[field] = value
    name = store(capture, "dla", record, field, str(value))
    with pytest.raises(UserError) as err:
        analyses.read(capture / f"{name}.json")
    assert str(err.value).startswith(f"{name}.json: {reason}") and "\n" not in str(err.value)


def test_non_finite_values_reach_the_page_as_null(capture: Path) -> None:
    name = store(capture, "patch", patch_result().to_json(), "is an", "is on")
    page = json.loads(analyses.read(capture / f"{name}.json").model_dump_json())
    assert page["restored"][0][0][0] is None
    assert page["restored"][1][1] == pytest.approx(patch_result().restored[1, 1].tolist())


def test_a_result_that_gains_fields_still_shows(capture: Path) -> None:
    record = {**lens_result().to_json(), "pipeline": {"stages": 2}}
    name = store(capture, "lens", record, "more")
    assert analyses.read(capture / f"{name}.json").tokens == list(PROMPT)


def test_a_broken_result_is_one_line_naming_the_file_and_field(capture: Path) -> None:
    record = lens_result().to_json()
    del record["rank"]
    name = store(capture, "lens", record, "broken")
    with pytest.raises(UserError) as err:
        analyses.read(capture / f"{name}.json")
    assert f"{name}.json: rank" in str(err.value) and "\n" not in str(err.value)
    assert "unreadable" in analyses.listed(capture)[name]


@pytest.mark.parametrize("kind", ["lens", "dla"])
def test_a_result_over_the_size_limit_is_not_read(capture: Path, kind: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    record = (lens_result() if kind == "lens" else dla_result()).to_json()
    name = store(capture, kind, record, PROMPT)
    size = (capture / f"{name}.json").stat().st_size
    monkeypatch.setattr(analyses, "MAX_RESULT_BYTES", size - 1)
    with pytest.raises(UserError, match=f"{name}.json: is .*, more than .*, not read"):
        analyses.read(capture / f"{name}.json")


@pytest.mark.parametrize("text, where", [
    (json.dumps({"type": "analysis", "name": "x" * 65}), "analysis.name"),
    (json.dumps({"type": "analysis", "name": 3}), "analysis.name"),
    (json.dumps({"type": "analysis", "name": "lens-0", "path": "/etc"}), "analysis.path"),
])
def test_a_malformed_analysis_request_is_refused(text: str, where: str) -> None:
    with pytest.raises(Refused, match=where):
        parse_message(text)
    assert isinstance(parse_message(json.dumps({"type": "analysis", "name": "lens-0"})),
                      Analysis)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
def test_the_server_sends_a_listed_result_and_refuses_other_names(run_dir: Path) -> None:
    captured = find_capture(run_dir / "gen", "RUN_DIR")
    name = store(captured, "patch", patch_result().to_json(), "is an", "is on")
    with ViewServer(run_dir / "gen") as srv, client(srv) as ws:
        info = json.loads(ws.recv(timeout=60))
        assert info["kind"] == "info" and list(info["analyses"]) == [name]
        ws.send(json.dumps({"type": "analysis", "name": name}))
        reply = json.loads(ws.recv(timeout=60))
        assert reply["kind"] == "analysis" and reply["name"] == name
        assert reply["result"]["sites"] == ["resid_pre", "mlp.out"]
        for other in ("manifest", "../clean/manifest", "lens-000000000000", "dla-000000000000"):
            ws.send(json.dumps({"type": "analysis", "name": other}))
            assert json.loads(ws.recv(timeout=60))["kind"] == "refused"
