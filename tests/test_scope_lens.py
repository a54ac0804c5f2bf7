"""The notebook API, the logit lens, activation patching and direct logit
attribution on the tiny model trained by ``megatronapp run
scenarios/scope_tiny.yaml --backend torch``."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pytest

import megatronapp.scope as ms
from tests.support import run_cli

pytestmark = pytest.mark.slow  # the run spawns torch processes

PROSE = "If the value of the expression is true"  # the kind of text the model trained on
# prompt pairs differing in one character; a test uses those whose answers differ
PAIRS = [("is an", "is on"), ("a list", "a last"), ("x = 1", "x + 1"), ("in the list", "in the lisp"),
         ("the value", "the valve"), ("is true", "is trie")]


@pytest.fixture(scope="module")
def kept(scope_tiny_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generation that keeps the raw residual stream of every layer."""
    out = tmp_path_factory.mktemp("kept") / "gen"
    r = run_cli("scope", "generate", str(scope_tiny_run), "--prompt", PROSE, "--tokens", "1",
                "--out", str(out), "--observe",
                "[{site: resid_post, stats: [mean], keep_raw: true}]")
    assert r.returncode == 0, r.stderr
    return out


def test_open_gives_the_tables_scope_query_reads(scope_tiny_run: Path) -> None:
    data = ms.open(scope_tiny_run)
    stats = data.table("stats")
    assert stats.num_rows == data.manifest["rows"] > 0
    q = run_cli("scope", "query", str(scope_tiny_run),
                "SELECT count(DISTINCT site) AS n FROM stats", "--json")
    assert q.returncode == 0, q.stderr
    assert json.loads(q.stdout) == [{"n": len(set(stats["site"].to_pylist()))}]
    assert data.table("injections").num_rows == data.manifest["injections"]
    frame = data.df("stats")  # the notebook's pandas view of the same rows
    assert len(frame) == stats.num_rows and list(frame.columns) == stats.column_names
    assert frame["site"].tolist() == stats["site"].to_pylist()


def test_the_cache_holds_what_the_capture_kept(kept: Path) -> None:
    data = ms.open(kept)
    with ms.load(kept) as model:
        logits, cache = model.run_with_cache(PROSE)
    assert logits.shape[:2] == (1, len(PROSE))
    for name in data.raw_names():  # step0/dp0/mb0/layer{n}/resid_post: the prompt's window
        layer = int(name.split("/")[3].removeprefix("layer"))  # a capture counts from 1
        np.testing.assert_allclose(cache["resid_post", layer - 1][0].numpy(), data.raw(name)[0],
                                   rtol=1e-5, atol=1e-6)
    with ms.load(kept / "clean") as from_capture:  # its manifest names the checkpoint
        np.testing.assert_array_equal(from_capture(PROSE).numpy(), logits.numpy())
    assert {"blocks.0.hook_resid_pre", "blocks.0.attn.hook_q", "blocks.1.attn.hook_pattern",
            "blocks.1.mlp.hook_post"} <= set(cache.keys())
    assert cache["attn.q", 0].shape == (1, len(PROSE), 4, 32)


def test_the_lens_at_the_last_layer_is_the_model_and_ranks_fall_layer_by_layer(
        scope_tiny_run: Path) -> None:
    with ms.load(scope_tiny_run) as model:
        lens = ms.logit_lens(model, PROSE, k=3)
        logits = model(PROSE)[0]
    model_choice = [int(i) for i in logits.argmax(-1)]
    assert [pos[0].token_id for pos in lens.top[-1]] == model_choice
    means = lens.mean_ranks()
    assert all(a > b for a, b in zip(means, means[1:])), means


def test_scope_lens_prints_a_table_and_stores_it_with_the_capture(scope_tiny_run: Path) -> None:
    r = run_cli("scope", "lens", str(scope_tiny_run), "--prompt", "is true", "--json")
    assert r.returncode == 0, r.stderr
    printed = json.loads(r.stdout)
    stored = [json.loads(p.read_text()) for p in (scope_tiny_run / "scope").glob("lens-*.json")]
    assert printed in stored and printed["rows"][0] == "resid_pre 0"
    again = run_cli("scope", "lens", str(scope_tiny_run), "--prompt", "is true")
    assert again.returncode == 0 and "mean rank of the next token" in again.stdout


def _patched(run: Path, clean: str, corrupt: str) -> dict | None:
    r = run_cli("scope", "patch", str(run), "--clean", clean, "--corrupt", corrupt, "--json")
    if r.returncode == 2 and "both prompts lead to" in r.stderr:
        return None  # the tiny model answers both alike: no logit difference to restore
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_patching_restores_where_the_prompts_differ_and_nothing_before(
        scope_tiny_run: Path) -> None:
    results = [(c, k, p) for c, k in PAIRS if (p := _patched(scope_tiny_run, c, k)) is not None]
    assert results, "no prompt pair with different answers"
    for clean, corrupt, res in results:
        at = next(i for i, (a, b) in enumerate(zip(clean, corrupt)) if a != b)
        grid = np.array(res["restored"])  # (sites, layers, positions)
        resid = res["sites"].index("resid_pre")
        assert grid[resid, 0, at] == pytest.approx(1.0, abs=1e-6)  # all downstream is clean
        np.testing.assert_allclose(grid[:, :, :at], 0.0, atol=1e-6)  # causal: nothing to restore
    assert len(list((scope_tiny_run / "scope").glob("patch-*.png"))) >= len(results)


def test_patching_the_last_position_at_the_last_layer_restores_it_all(
        scope_tiny_run: Path) -> None:
    """Prompts differing in their last character: the last layer's input at
    the last position carries all of the difference."""
    found = [p for p in (_patched(scope_tiny_run, c, c[:-1] + x) for c in ("is true", "the value")
                         for x in "xqz") if p is not None]
    assert found
    for res in found:
        grid = np.array(res["restored"])
        resid = res["sites"].index("resid_pre")
        assert grid[resid, -1, -1] == pytest.approx(1.0, abs=1e-6)
        np.testing.assert_allclose(grid[resid, -1, :-1], 0.0, atol=1e-6)


def test_prompts_of_different_lengths_are_refused_on_one_line(scope_tiny_run: Path) -> None:
    r = run_cli("scope", "patch", str(scope_tiny_run), "--clean", "is an", "--corrupt", "is a")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--corrupt" in r.stderr


def test_a_mistyped_site_is_refused_before_any_model_loads(scope_tiny_run: Path,
                                                          tmp_path: Path) -> None:
    """The capture alone, without the checkpoint: --sites is judged first."""
    import shutil

    capture_only = tmp_path / "capture"
    shutil.copytree(scope_tiny_run / "scope", capture_only)
    before = sorted(capture_only.iterdir())
    r = run_cli("scope", "patch", str(capture_only), "--clean", "is an", "--corrupt", "is on",
                "--sites", "resid_pre,attn.outt")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--sites" in r.stderr and "did you mean 'attn.out'" in r.stderr
    assert sorted(capture_only.iterdir()) == before  # nothing written


def test_attribution_against_the_model_s_choice_is_the_mirror_image(scope_tiny_run: Path) -> None:
    """Answer the model's runner-up: the baseline becomes its first choice,
    and every share changes sign."""
    with ms.load(scope_tiny_run) as model:
        first = ms.direct_logit_attribution(model, PROSE)
        mirror = ms.direct_logit_attribution(model, PROSE, answer=first.answers[1])
    assert mirror.answers == first.answers[::-1]
    assert mirror.logit_diff == pytest.approx(-first.logit_diff, abs=1e-6)
    np.testing.assert_allclose(mirror.heads, -first.heads, atol=1e-9)


def test_the_docs_analysis_commands_run_on_the_model_the_docs_train(
        scope_tiny_run: Path) -> None:
    """Every ``scope lens/patch/dla`` command docs/megascope-analysis.md shows runs, as
    written, on the tiny model trained as the docs say (its prompts work)."""
    from tests.test_docs import ROOT as DOCS_ROOT
    from tests.test_docs import SCOPE_ANALYSIS, NOT_RUN, doc_commands

    shown = [c.text for c in doc_commands(DOCS_ROOT / "docs" / "megascope-analysis.md")
             if c.text.split()[1:3] in (["scope", "lens"], ["scope", "patch"], ["scope", "dla"])]
    assert len(shown) >= 4 and all(NOT_RUN.get(text) == SCOPE_ANALYSIS for text in shown)
    for text in shown:
        argv = [str(scope_tiny_run) if w == "runs/scope_tiny" else w
                for w in shlex.split(text)[1:]]
        r = run_cli(*argv, "--force")
        assert r.returncode == 0, f"{text}: {r.stderr}"
        assert "Warning" not in r.stderr  # megatron-core's only with --verbose
