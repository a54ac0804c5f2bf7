"""Regenerate the MegaScope view's screenshots in docs/img.

    python -m experiments.screenshots                          # the followed training view
    python -m experiments.screenshots --run runs/scope_tiny    # and the nine views of a trained run

The followed training view is a run written step by step into
/tmp/megatronapp-docs/runs/follow (two steps while the page is open), served
from /tmp/megatronapp-docs so the page names it ``runs/follow``, not a
temporary path. The nine other views are the browser test's, on the trained
tiny model that ``--run`` names (``megatronapp run scenarios/scope_tiny.yaml
--backend torch --out runs/scope_tiny``; give it relative to the repository,
as the page shows it): prompt ``def main(``, 12 tokens, ``act_noise`` at
layer 1's residual stream; the logit lens, patching and direct logit
attribution views show the results the test first stores in the run with
``scope lens``, ``scope patch`` and ``scope dla``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from experiments import results
from tests.scope_view_support import (ViewServer, follow_next_step, launch_chromium,
                                      open_training_view, start_followed_run)

ROOT = Path(__file__).resolve().parents[1]
WORKDIR = Path("/tmp/megatronapp-docs")
FOLLOWED = Path("runs/follow")
FOLLOW_VIEWPORT = {"width": 1400, "height": 1100}


def follow_screenshot(out: Path) -> Path:
    """``megascope-training-follow.png``: a followed run that gains a step."""
    from playwright.sync_api import sync_playwright

    shutil.rmtree(WORKDIR / FOLLOWED, ignore_errors=True)
    writer = start_followed_run(WORKDIR / FOLLOWED)
    target = out / "megascope-training-follow.png"
    with ViewServer(FOLLOWED, ("--follow",), cwd=WORKDIR) as srv, sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page = browser.new_page(viewport=FOLLOW_VIEWPORT)
            open_training_view(page, srv.url)
            follow_next_step(page, writer, 1)
            page.screenshot(path=str(target), full_page=True)
        finally:
            browser.close()
    return target


def browser_screenshots(run: Path, out: Path) -> None:
    """The browser test's nine screenshots of a trained run, copied into ``out``."""
    env = {**os.environ, "MEGASCOPE_VIEW_RUN": str(run), "MEGASCOPE_SCREENSHOTS": str(out),
           "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "pytest", "tests/test_scope_view_browser.py",
                    "-p", "no:xdist", "-q"], cwd=ROOT, env=env, check=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    parser.add_argument("--run", type=Path, help="a trained scope_tiny run, relative to the "
                        "repository; without it only the followed view is regenerated")
    results.results_dir_option(parser)
    args = parser.parse_args(argv)
    run, out = results.start("screenshots", argv), args.out.resolve()
    before = {p: p.stat().st_mtime_ns for p in out.glob("*.png")}
    print(f"wrote {follow_screenshot(out)}")
    if args.run is not None:
        browser_screenshots(args.run, out)
        print(f"wrote the browser test's screenshots into {out}")
    written = sorted(results.shown(p) for p in out.glob("*.png")
                     if before.get(p) != p.stat().st_mtime_ns)
    recorded = run.record({"run": None if args.run is None else results.shown(args.run),
                           "screenshots": written}, args.results_dir)
    print(f"wrote {recorded}")


if __name__ == "__main__":
    main()
