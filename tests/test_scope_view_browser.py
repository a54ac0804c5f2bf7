"""The view in a real browser: Debian's chromium driven by Playwright, on a
real ``scope serve`` process with live generation on the tiny model.

Tokens appear one at a time, a top-k chart opens for both runs, the first
divergent step is marked, choosing a layer and a head changes the attention
canvas's pixels, the layer x head grid enlarges the map clicked, hovering a
cell shows its token pair and weight, the timeline moves it to another step,
the PCA view draws on robust axes, the perturbation's parameters title its
charts, only its own fields show; the logit lens, patching and direct logit
attribution results stored by the real ``scope lens``, ``scope patch`` and
``scope dla`` are drawn with hover values;
any console error or page error fails the test.
Screenshots go to the test's directory and, when ``MEGASCOPE_SCREENSHOTS`` names
a directory (``docs/img`` for the documentation), there too. The model is an
untrained one made here, or the run directory ``MEGASCOPE_VIEW_RUN`` names
(the trained tiny model, for the documentation's screenshots).
"""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from megatronapp.scope.lens import patch_sites, result_name
from tests.scope_view_support import (ViewServer, blank_of, launch_chromium, make_run,
                                      page_with_errors, shoot)
from tests.support import run_cli

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")]
TOKENS = 12
VIEWPORT = {"width": 1400, "height": 900}
LENS_PROMPT = "If the value of the expression is true"
PATCH = ("--clean", "is an", "--corrupt", "is on", "--clean-answer", "d", "--corrupt-answer", "e")
PERTURBATION = "act_noise: σ = 0.5 (relative) at resid_post, layer 1"
VISIBLE = {" ": "␣", "\n": "↵", "\t": "⇥"}  # how the page writes whitespace


def visible(text: str) -> str:
    return "".join(VISIBLE.get(c, c) for c in text)


@dataclass(frozen=True)
class Stored:
    """The lens, patching and attribution results stored with the served capture
    (as printed)."""

    lens: dict[str, Any]
    patch: dict[str, Any]
    dla: dict[str, Any]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("MEGASCOPE_VIEW_RUN")
    return Path(given) if given else make_run(tmp_path_factory.mktemp("run"), steps=6)


@pytest.fixture(scope="module")
def stored(target: Path) -> Stored:
    """``scope lens``, ``scope patch`` and ``scope dla`` run for real on the
    served checkpoint."""
    done = [run_cli("scope", "lens", str(target), "--prompt", LENS_PROMPT, "--json"),
            run_cli("scope", "patch", str(target), *PATCH, "--json"),
            run_cli("scope", "dla", str(target), "--prompt", LENS_PROMPT, "--json")]
    assert all(r.returncode == 0 for r in done), "".join(r.stderr for r in done)
    return Stored(*(json.loads(r.stdout) for r in done))


@pytest.fixture(scope="module")
def server(target: Path, stored: Stored) -> Iterator[ViewServer]:
    with ViewServer(target, ("--allow-perturb",)) as srv:
        yield srv


def pixels(page: Any, canvas: str) -> str:
    return page.evaluate(f"document.getElementById({canvas!r}).toDataURL()")  # type: ignore


def tab(page: Any, name: str) -> None:
    page.click(f"#tabs button[data-tab={name}]")


def hover_cell(page: Any, canvas: str, row: int, col: int, rows: int, cols: int,
               left: int = 70) -> str:
    """Point at a cell of a heat map (its box: ``left`` px in, 24 down, 120 and 46
    short of the right and bottom edges) and read the tooltip."""
    width, height = canvas_size(page, canvas)
    x = left + (col + 0.5) * (width - left - 120) / cols
    y = 24 + (row + 0.5) * (height - 70) / rows
    return hover_at(page, canvas, x, y)


def canvas_size(page: Any, canvas: str) -> tuple[int, int]:
    return tuple(page.evaluate(  # type: ignore[return-value]
        f"[document.querySelector({canvas!r}).width, document.querySelector({canvas!r}).height]"))


def hover_at(page: Any, canvas: str, x: float, y: float) -> str:
    """Point at ``(x, y)`` in the canvas's own pixels and read the tooltip."""
    box = page.locator(canvas).bounding_box()
    width, height = canvas_size(page, canvas)
    page.mouse.move(box["x"] + x * box["width"] / width, box["y"] + y * box["height"] / height)
    assert page.locator("#tip").is_visible()
    return page.text_content("#tip")  # type: ignore[no-any-return]


def attention_row(page: Any, step: int, layer: int, head: int, q: int) -> list[float]:
    """Query ``q``'s attention over the keys, read from the step's frame."""
    return page.evaluate(  # type: ignore[no-any-return]
        f"(() => {{ const a = window.megascope.steps[{step}].arrays['clean/attention/layer{layer}'];"
        f" const n = a.shape[1]; return Array.from(a.data.subarray("
        f"({head} * n + {q}) * n, ({head} * n + {q} + 1) * n)); }})()")


def check_perturbation_fields(page: Any) -> None:
    """Only the fields the chosen perturbation uses are shown."""
    shown = {"act_noise": {"site", "sigma"}, "act_offset": {"site", "value"}, "head_mask": {"head"}}
    for kind, fields in shown.items():
        page.select_option("#p-kind", kind)
        assert {f for f in ("site", "sigma", "value", "head")
                if page.locator(f"#f-{f}").is_visible()} == fields, kind


def test_the_view_in_a_browser(server: ViewServer, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server.url)
            page.wait_for_function("() => window.megascope.info !== null")
            assert page.text_content("#status") == "ready: enter a prompt"

            # generate, clean and perturbed, and watch the tokens arrive
            page.fill("#prompt", "def main(")
            page.fill("#ntokens", str(TOKENS))
            page.check("#use-perturb")
            tab(page, "perturbation")
            check_perturbation_fields(page)
            page.select_option("#p-kind", "act_noise")
            page.select_option("#p-layer", "1")
            page.fill("#p-sigma", "0.5")
            tab(page, "generation")
            page.click("#generate")
            seen = set()
            while not page.evaluate("window.megascope.done === true"):
                seen.add(page.locator("#tokens .tok").count())
                time.sleep(0.02)
            assert page.evaluate("window.megascope.shown") == list(range(1, TOKENS + 1))
            assert len(seen - {0, TOKENS}) >= 1, "the tokens arrived all at once"
            assert page.locator("#tokens-perturbed .tok").count() == TOKENS
            assert page.text_content("#status") == f"done: {TOKENS} tokens"
            assert page.text_content("#tokens .prompt") == "def␣main("  # whitespace shows

            # the first step where the perturbed run picks another token is marked
            picks = page.evaluate("window.megascope.steps.map(r => "
                                  "[r.header.clean.token_id, r.header.perturbed.token_id])")
            diverge = next(i for i, (c, q) in enumerate(picks) if c != q)
            assert page.eval_on_selector_all("#tokens-perturbed .tok.diverge",
                                             "es => es.map(e => Number(e.dataset.step))") == [diverge]
            assert f"first divergent step: {diverge}" in page.text_content("#divergence")
            assert PERTURBATION in page.text_content("#tokens-perturbed .label")

            # a token's top-k bar chart
            assert page.locator("#topk-panel").is_hidden()
            page.click("#tokens .tok >> nth=3")
            assert page.locator("#topk-panel").is_visible()
            assert page.locator("#topk .topk-bar[data-run=clean]").count() == 5
            assert page.locator("#topk .topk-bar[data-run=perturbed]").count() == 5
            assert PERTURBATION in page.text_content("#topk")
            assert page.input_value("#timeline") == "3"
            shoot(page, tmp_path, "generation")

            # attention: another layer, another head, another step: other pixels
            tab(page, "attention")
            first = pixels(page, "attn-canvas")
            page.select_option("#q-layer", "2")
            second = pixels(page, "attn-canvas")
            page.select_option("#q-head", "3")
            third = pixels(page, "attn-canvas")
            assert len({first, second, third}) == 3
            page.fill("#timeline", str(TOKENS - 1))
            assert page.text_content("#timeline-label") == f"{TOKENS - 1} / {TOKENS - 1}"
            fourth = pixels(page, "attn-canvas")
            assert fourth not in {first, second, third}
            assert page.locator("#attn-perturbed-fig").is_visible()
            assert PERTURBATION in page.text_content("#attn-perturbed-fig figcaption")

            # the layer x head grid: every map drawn; a click enlarges one
            layers, heads = page.evaluate("[window.megascope.info.live.layers, "
                                          "window.megascope.info.live.heads]")
            assert page.locator("#attn-grid canvas.mini").count() == layers * heads
            assert page.evaluate("window.megascope.gridDrawn") == layers * heads
            page.click(f"#attn-grid canvas.mini[data-layer='2'][data-head='{heads - 2}']")
            assert page.evaluate("[window.megascope.sel.layer, window.megascope.sel.head]"
                                 ) == [2, heads - 2]
            assert page.input_value("#q-head") == str(heads - 2)
            assert pixels(page, "attn-canvas") not in {first, second, third, fourth}
            assert page.get_attribute("#attn-canvas", "aria-label") == (
                f"layer 2, head {heads - 2}, step {TOKENS - 1}")
            page.select_option("#attn-grid-of", "perturbed-clean")
            assert page.evaluate("window.megascope.gridDrawn") == layers * heads
            assert PERTURBATION in page.text_content("#attn-grid-note")
            page.select_option("#attn-grid-of", "clean")

            # hover: the token pair and the weight of the cell under the pointer
            window = page.evaluate(f"window.megascope.steps[{TOKENS - 1}].header.window")
            q = len(window) - 1
            row = attention_row(page, TOKENS - 1, 2, heads - 2, q)
            k = max(range(len(row)), key=row.__getitem__)  # the key it attends most
            weight = row[k]
            assert hover_cell(page, "#attn-canvas", q, k, len(window), len(window)) == (
                f"query {q} {visible(window[q])} → key {k} {visible(window[k])}: {weight:.4f}")

            # a second prompt beside the first: same layer, head and step, its own attention
            assert page.locator("#attn-b-fig").is_hidden()
            page.fill("#prompt-b", "class Foo:")
            page.click("#generate-b")
            page.wait_for_function("() => window.megascope.doneB === true")
            assert page.evaluate("window.megascope.stepsB.length") == TOKENS
            assert page.evaluate("window.megascope.steps.length") == TOKENS  # A is kept
            assert page.evaluate("window.megascope.stepsB[0].header.window.join('')"
                                 ).startswith("class Foo:")
            assert page.locator("#attn-b-fig").is_visible()
            assert page.text_content("#attn-prompt-b") == "class␣Foo:"
            b_last = pixels(page, "attn-canvas-b")
            page.select_option("#attn-diff-of", "b-a")  # the difference view of B and A
            assert page.get_attribute("#attn-canvas-d", "aria-label").startswith(
                "prompt B − prompt A, layer")
            page.select_option("#attn-grid-of", "b-a")
            assert page.evaluate("window.megascope.gridDrawn") == layers * heads
            assert b_last not in {pixels(page, "attn-canvas"), blank_of(page, 460, 460)}
            page.fill("#timeline", "2")
            assert pixels(page, "attn-canvas-b") != b_last  # B follows the timeline too
            page.fill("#timeline", str(TOKENS - 1))
            page.select_option("#attn-grid-of", "clean")
            page.select_option("#attn-diff-of", "perturbed-clean")
            hover_cell(page, "#attn-canvas", q, k, len(window), len(window))
            shoot(page, tmp_path, "attention", full_page=True)

            tab(page, "pca")
            blank = blank_of(page, 900, 560)
            pca_layer2 = pixels(page, "pca-canvas")
            assert pca_layer2 != blank
            page.select_option("#q-layer", "1")
            assert pixels(page, "pca-canvas") != pca_layer2
            # robust axes: the 1-99% range of every point, the points beyond counted and drawn
            spread = page.evaluate("window.megascopeLib.robustRange([...Array(100).keys(), 1e6])")
            assert 0 < spread[1] < 200
            pca = page.evaluate("window.megascope.pca")
            assert pca["points"] == 2 * len(window) and 0 <= pca["clipped"] < pca["points"]
            assert PERTURBATION in page.get_attribute("#pca-canvas", "aria-label")
            shoot(page, tmp_path, "pca")

            tab(page, "tensors")
            page.select_option("#stat-site", "resid_post")
            page.select_option("#stat-name", "std")
            shoot(page, tmp_path, "tensors")
            tab(page, "perturbation")
            assert PERTURBATION in page.get_attribute("#kl-canvas", "aria-label")
            assert PERTURBATION in page.get_attribute("#dh-canvas", "aria-label")
            assert page.get_attribute("#dh-canvas", "data-xticks") == ",".join(
                str(n) for n in range(1, layers + 1))  # whole layers, not 1.25, 1.5, ...
            shoot(page, tmp_path, "perturbation")
            tab(page, "training")
            page.wait_for_function("() => window.megascope.series !== null")
            assert "dropped records in this capture: 0" in page.text_content("#dropped")
            steps = page.evaluate("window.megascope.series.arrays.steps.data.length")
            assert steps >= 1 and page.evaluate("window.megascope.ridges") == min(steps, 40)
            ridges = pixels(page, "ridge-canvas")
            assert ridges != blank_of(page, 900, 420)
            other = [v for v in page.eval_on_selector_all("#t-stat option", "os => os.map(o => o.value)")
                     if v != page.input_value("#t-stat")][0]
            page.select_option("#t-stat", other)
            page.wait_for_function(f"() => window.megascope.series.header.stat === {other!r}")
            assert pixels(page, "ridge-canvas") != ridges
            shoot(page, tmp_path, "training", full_page=True)

            # the replay walks the timeline from the first step
            page.click("#play")
            page.wait_for_function(f"() => window.megascope.sel.step === {TOKENS - 1}")
        finally:
            browser.close()
    assert errors == []


@contextmanager
def served_page(server: ViewServer) -> Iterator[tuple[Any, list[str]]]:
    """A page on the served view once its info has arrived, and the list its
    console errors go to; the browser is closed after."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page, errors = page_with_errors(browser, VIEWPORT)
            page.goto(server.url)
            page.wait_for_function("() => window.megascope.info !== null")
            yield page, errors
        finally:
            browser.close()


def open_result(page: Any, view: str, menu: str, name: str) -> None:
    """The stored result ``name`` chosen in its view's menu, and received."""
    tab(page, view)
    page.select_option(menu, name)
    page.wait_for_function(f"() => window.megascope.analyses[{name!r}]")


def test_the_lens_and_patching_views(server: ViewServer, stored: Stored, tmp_path: Path) -> None:
    lens, patch = stored.lens, stored.patch
    with served_page(server) as (page, errors):
        open_result(page, "lens", "#lens-of", result_name("lens", LENS_PROMPT))
        assert LENS_PROMPT in page.get_attribute("#lens-canvas", "aria-label")
        rows, tokens = len(lens["rows"]), len(lens["tokens"])
        row, pos = rows - 1, 4
        tip = hover_cell(page, "#lens-canvas", row, pos, rows, tokens, left=110)
        assert tip.startswith(f"{lens['rows'][row]}, position {pos} "
                              f"{visible(lens['tokens'][pos])} → next "
                              f"{visible(lens['tokens'][pos + 1])}: "
                              f"rank {lens['rank'][row][pos]}")
        assert visible(lens["top"][row][pos][0]["token"]) in tip.split("top: ")[1]
        assert page.text_content("#lens-summary").endswith(
            " → ".join(f"{r} {m:.2f}" for r, m in zip(lens["rows"], lens["mean_rank"])))
        shoot(page, tmp_path, "lens")

        # the result stored above, by its name, among any others stored with the capture
        clean, corrupt, clean_answer, corrupt_answer = PATCH[1::2]
        open_result(page, "patching", "#patch-of", result_name(
            "patch", clean, corrupt, *patch_sites(None), clean_answer, corrupt_answer))
        assert page.locator(".patch-map").count() == len(patch["sites"])
        layers, positions = len(patch["layers"]), len(patch["tokens"])
        site, layer, pos = len(patch["sites"]) - 1, 0, positions - 2
        value = patch["restored"][site][layer][pos]
        tip = hover_cell(page, f".patch-map[data-site='{patch['sites'][site]}']", layer, pos,
                         layers, positions)
        assert tip == (f"{patch['sites'][site]}, layer {patch['layers'][layer]}, position "
                       f"{pos} {visible(patch['tokens'][pos])}: restored {value:.4f}")
        shoot(page, tmp_path, "patching", full_page=True)
    assert errors == []


def test_the_direct_logit_attribution_view(server: ViewServer, stored: Stored,
                                           tmp_path: Path) -> None:
    dla = stored.dla
    answer, baseline = (visible(c) for c in dla["answers"])
    total = f"logit[{answer}] − logit[{baseline}] = {dla['logit_diff']:.4f}"
    with served_page(server) as (page, errors):
        open_result(page, "dla", "#dla-of", result_name("dla", LENS_PROMPT, "", ""))
        assert total in page.get_attribute("#dla-canvas", "aria-label")
        # a bar per head per layer, and the embedding, each layer's bias and MLP, the norm's bias
        bars = {b["component"]: b for b in page.evaluate("window.megascope.dlaBars")}
        layers, heads = len(dla["layers"]), len(dla["heads"][0])
        assert len(bars) == layers * heads + 2 * layers + 2
        bar = bars[f"layer {dla['layers'][0]}, MLP"]
        assert hover_at(page, "#dla-canvas", bar["x"], bar["y"]).startswith(
            f"layer {dla['layers'][0]}, MLP: {dla['mlp'][0]:+.4f} of")
        layer, head = layers - 1, heads - 1
        bar = bars[f"layer {dla['layers'][layer]}, head {head}"]
        assert hover_at(page, "#dla-canvas", bar["x"], bar["y"]) == (
            f"layer {dla['layers'][layer]}, head {head}: "
            f"{dla['heads'][layer][head]:+.4f} of {total}")
        assert page.text_content("#dla-summary").startswith(total)
        shoot(page, tmp_path, "dla", full_page=True)
    assert errors == []
