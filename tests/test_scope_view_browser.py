"""The view in a real browser: Debian's chromium driven by Playwright, on a
real ``scope serve`` process with live generation on the tiny model.

Tokens appear one at a time, a top-k chart opens, choosing a layer and a
head changes the attention canvas's pixels, the timeline moves it to another
step, the PCA view draws; any console error or page error fails the test.
Screenshots go to the test's directory and, when ``MEGASCOPE_SCREENSHOTS`` names
a directory (``docs/img`` for the documentation), there too. The model is an
untrained one made here, or the run directory ``MEGASCOPE_VIEW_RUN`` names
(the trained tiny model, for the documentation's screenshots).
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.scope_view_support import (ViewServer, blank_of, launch_chromium, make_run,
                                      shoot)

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")]
TOKENS = 12
VIEWPORT = {"width": 1400, "height": 900}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ViewServer]:
    given = os.environ.get("MEGASCOPE_VIEW_RUN")
    target = Path(given) if given else make_run(tmp_path_factory.mktemp("run"), steps=6)
    with ViewServer(target, ("--allow-perturb",)) as srv:
        yield srv


def pixels(page: Any, canvas: str) -> str:
    return page.evaluate(f"document.getElementById({canvas!r}).toDataURL()")  # type: ignore


def tab(page: Any, name: str) -> None:
    page.click(f"#tabs button[data-tab={name}]")


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

            # a token's top-k bar chart
            assert page.locator("#topk-panel").is_hidden()
            page.click("#tokens .tok >> nth=3")
            assert page.locator("#topk-panel").is_visible()
            assert page.locator("#topk .topk-bar").count() == 5
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
            assert page.text_content("#attn-prompt-b") == "class Foo:"
            b_last = pixels(page, "attn-canvas-b")
            assert b_last not in {pixels(page, "attn-canvas"), blank_of(page, 460, 460)}
            page.fill("#timeline", "2")
            assert pixels(page, "attn-canvas-b") != b_last  # B follows the timeline too
            page.fill("#timeline", str(TOKENS - 1))
            shoot(page, tmp_path, "attention")

            tab(page, "pca")
            blank = blank_of(page, 760, 520)
            pca_layer2 = pixels(page, "pca-canvas")
            assert pca_layer2 != blank
            page.select_option("#q-layer", "1")
            assert pixels(page, "pca-canvas") != pca_layer2
            shoot(page, tmp_path, "pca")

            tab(page, "tensors")
            page.select_option("#stat-site", "resid_post")
            page.select_option("#stat-name", "std")
            shoot(page, tmp_path, "tensors")
            tab(page, "perturbation")
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
