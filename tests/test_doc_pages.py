"""The user pages stay short and their links lead somewhere.

Every page of docs/ a user reads (all but the generated reference and the
measurement journal) is at most ``MAX_LINES`` lines; history goes to
docs/journal/. Every relative link of README.md and docs/ (journal included)
names a file that exists and, where it names a heading, a heading that page
has (GitHub's anchors: lower case, punctuation dropped, spaces to hyphens)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MAX_LINES = 300
GENERATED = {"reference.md"}  # python -m megatronapp.reference writes it
USER_PAGES = sorted(p for p in DOCS.glob("*.md") if p.name not in GENERATED)
LINKED_PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := HEADING.match(line)):
            name, n = anchor(m.group(1)), 1
            while name in found:  # a repeated heading gets -1, -2, ...
                name, n = f"{anchor(m.group(1))}-{n}", n + 1
            found.add(name)
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(target)
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: p.name)
def test_a_user_page_is_short(page: Path) -> None:
    lines = len(page.read_text().splitlines())
    assert lines <= MAX_LINES, f"{page.name}: {lines} lines (move history to docs/journal/)"


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_page_links_only_to_what_exists(page: Path) -> None:
    assert broken_links(page) == []


def test_a_long_page_and_a_broken_link_are_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# A `code` heading, with punctuation!\n\n```\n# not a heading\n```\n"
                    "[ok](#a-code-heading-with-punctuation) [gone](#not-a-heading) "
                    "[missing](other.md) [web](https://example.org/x)\n")
    assert broken_links(page) == ["#not-a-heading", "other.md"]
    assert anchors(page) == {"a-code-heading-with-punctuation"}
