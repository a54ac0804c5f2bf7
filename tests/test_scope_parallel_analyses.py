"""MegaScope's commands on a checkpoint split over pipeline stages and
tensor-parallel ranks (real processes, gloo) give what one process gives (the
model object itself is held to TransformerLens at pp 2 × tp 2 in
test_scope_oracle.py)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import megatronapp.scope as ms
from tests.support import run_cli

pytestmark = pytest.mark.slow  # torch processes

PROSE = "If the value of the expression is true"
# one character apart; the answers are given, so the logit difference exists
PAIR = {"clean": "the value", "corrupt": "the valve", "clean_answer": " ", "corrupt_answer": "n"}


def _cli_json(*args: str) -> dict:
    r = run_cli("scope", *args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_the_lens_is_the_same_on_one_and_two_pipeline_stages(scope_tiny_run: Path) -> None:
    with ms.load(scope_tiny_run) as model:
        one = ms.logit_lens(model, PROSE, k=3)
    two = _cli_json("lens", str(scope_tiny_run), "--prompt", PROSE, "--top-k", "3", "--pp", "2")
    assert two["rows"] == one.rows
    np.testing.assert_array_equal(np.array(two["rank"]), one.ranks)
    for row_two, row_one in zip(two["top"], one.top):
        for pos_two, pos_one in zip(row_two, row_one):
            assert [t["token_id"] for t in pos_two] == [t.token_id for t in pos_one]
            np.testing.assert_allclose([t["prob"] for t in pos_two], [t.prob for t in pos_one],
                                       rtol=1e-5, atol=1e-7)


def test_patching_at_the_stage_boundary_restores_it_all(scope_tiny_run: Path) -> None:
    """Patches at block 1 act on the second stage; resid_pre there is the
    tensor that stage receives."""
    with ms.load(scope_tiny_run) as model:
        one = ms.activation_patching(model, **PAIR)
    two = _cli_json("patch", str(scope_tiny_run), "--clean", PAIR["clean"], "--corrupt",
                    PAIR["corrupt"], "--clean-answer", " ", "--corrupt-answer", "n", "--pp", "2")
    assert two["sites"] == one.sites and two["layers"] == one.layers == [0, 1]
    np.testing.assert_allclose(np.array(two["restored"]), one.restored, atol=1e-5)
    resid = one.sites.index("resid_pre")
    assert one.restored[resid, 1, -1] == pytest.approx(1.0, abs=0.1)  # the stage boundary
    stored = [json.loads(p.read_text()) for p in (scope_tiny_run / "scope").glob("patch-*.json")]
    assert two in stored


def test_direct_logit_attribution_sums_to_the_logit_difference_and_splits_over_tp(
        scope_tiny_run: Path) -> None:
    with ms.load(scope_tiny_run) as model:
        one = ms.direct_logit_attribution(model, PROSE)
    heads, rest = one.heads, one.parts
    assert heads.shape == (2, 4)
    whole = heads.sum() + rest["embed"] + rest["attn_bias"].sum() + rest["mlp"].sum() \
        + rest["norm_bias"]
    assert whole == pytest.approx(one.logit_diff, abs=1e-4)  # the heads are the attention output
    two = _cli_json("dla", str(scope_tiny_run), "--prompt", PROSE, "--tp", "2")
    assert two["answers"] == list(one.answers)
    np.testing.assert_allclose(np.array(two["heads"]), heads, atol=1e-5)
    assert two["logit_diff"] == pytest.approx(one.logit_diff, abs=1e-5)
    stored = [json.loads(p.read_text()) for p in (scope_tiny_run / "scope").glob("dla-*.json")]
    assert two in stored


def test_a_split_the_model_does_not_allow_is_one_line(scope_tiny_run: Path) -> None:
    r = run_cli("scope", "lens", str(scope_tiny_run), "--prompt", "is", "--pp", "3")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--pp" in r.stderr, r.stderr


def test_an_input_is_refused_before_any_process_starts(scope_tiny_run: Path) -> None:
    r = run_cli("scope", "patch", str(scope_tiny_run), "--clean", "is an", "--corrupt", "is a",
                "--pp", "2")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("megatronapp: --corrupt: must have as many tokens")
