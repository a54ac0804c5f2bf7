"""docs/reference.md is what ``python -m megatronapp.reference`` writes from the
parsers and the scenario schema today, and the generator reads both."""
from __future__ import annotations

import argparse
from pathlib import Path

from pydantic import BaseModel

from megatronapp import reference
from megatronapp.cli import build_parser


def test_the_reference_page_is_what_the_generator_writes_now() -> None:
    assert reference.PAGE.read_text() == reference.render(build_parser()), (
        "docs/reference.md differs from the parsers and the schema: "
        "run python -m megatronapp.reference")


def test_every_command_and_scenario_key_is_on_the_page() -> None:
    page = reference.PAGE.read_text()
    for name, _help, _sub in reference._subcommands(build_parser()):
        assert f"### `megatronapp {name}`" in page
    for key in ("parallel.tp", "model.ffn_hidden_size", "cluster.gpu.efficiency",
                "faults[].factor", "mitigation.restart_s", "scope.observe[].site"):
        assert f"| `{key}` |" in page


def test_a_new_option_and_key_appear_with_their_default_and_comment() -> None:
    parser = argparse.ArgumentParser(prog="megatronapp")
    sub = parser.add_subparsers()
    probe = sub.add_parser("probe", help="a probe command")
    probe.add_argument("--depth", type=int, default=3, help="how deep, default %(default)s")

    class Probe(BaseModel):
        width: int = 7  # how wide the probe is

    page = reference.render(parser, Probe)
    assert "| `--depth DEPTH` | 3 | how deep, default 3 |" in page
    assert "| `width` | int | 7 | how wide the probe is |  |" in page


def test_check_fails_on_a_stale_page(tmp_path: Path) -> None:
    stale = tmp_path / "reference.md"
    stale.write_text("# Reference\n(old)\n")
    assert reference.main(["--check", "--out", str(stale)]) == 1
    assert reference.main(["--out", str(stale)]) == 0
    assert reference.main(["--check", "--out", str(stale)]) == 0
