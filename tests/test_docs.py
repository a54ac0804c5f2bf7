"""The docs' shell commands still run and still print what the docs show.

Every command in a code block of README.md and docs/*.md that invokes
``megatronapp`` (``.venv/bin/megatronapp``, ``python -m megatronapp.cli``) is
collected. Commands that are cheap on the simulator run, in document order,
in a temporary directory holding a copy of ``scenarios/`` (so ``runs/...``
paths land there, never in the repository). Where the docs show what a
command prints, the printed numbers must be the same, exactly: the simulator
is deterministic. The docs show output in two ways:

- ``$ command`` lines in a block, each followed by its output (up to the next
  ``$`` line; none shown means none compared);
- ``<!-- output of: command -->`` right before a block: that block is the
  command's output (the command runs there).

A shown line may leave lines of the real output out, but each shown line must
be, in order, a printed line with the same words and the same numbers.
Commands that cannot run here (torch, a GPU, long) are listed in NOT_RUN with
the reason; a command that is neither run nor listed fails the test.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))

OUTPUT_MARKER = re.compile(r"<!--\s*output of:\s*(.+?)\s*-->", re.DOTALL)
# a number as printed: 18,144 / 1.498 / -33.9; not the digits of a word (tp1)
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:,\d{3})*(?:\.\d+)?")
PROMPT = "$ "
SHELL_OPERATORS = {"&&", "||", "|", "&", ";", ">", ">>", "<", "<<"}
CLI = ("megatronapp", ".venv/bin/megatronapp")

TORCH = "runs real torch processes (minutes of CPU)"
NEEDS_TORCH_RUN = "reads a torch-backend run directory (minutes of CPU to make)"
SERVER = "starts a web server that runs until stopped"
SCOPE_ANALYSIS = "run on the tiny model the docs train by tests/test_scope_lens.py (slow)"
HOWTO = "the how-to's folder of a profiled job (tests/test_profile_howto.py makes one and reads it)"
# Commands the docs show that are not run here, and why (normalized: comments
# and prompts dropped, continuation lines joined, whitespace collapsed).
NOT_RUN: dict[str, str] = {
    "scripts/setup && .venv/bin/megatronapp run scenarios/throttle.yaml":
        "scripts/setup builds a virtual environment; the run itself is docs/megascan.md's",
    ".venv/bin/megatronapp run scenarios/fbd_torch_small.yaml --backend torch": TORCH,
    ".venv/bin/megatronapp validate-detector --trials 1000 --seed 0 --jobs 2 "
    "--csv runs/validate-detector.csv": "1000 simulated trials: minutes on two cores",
    "megatronapp run scenarios/scope_tiny.yaml --backend torch --out runs/scope_tiny": TORCH,
    "megatronapp scope serve runs/scope_tiny": SERVER,
    "megatronapp scope serve runs/scope_generate --port 0": SERVER,
    "megatronapp scope serve runs/scope_tiny --allow-perturb": SERVER,
    "megatronapp scope serve runs/live --follow": SERVER,
    "megatronapp scope serve runs/scope_tiny --host ::1": SERVER,
    "megatronapp run scenarios/scope_tiny.yaml --backend torch --out runs/live &": TORCH,
    "megatronapp scope summary runs/scope_tiny": NEEDS_TORCH_RUN,
    "megatronapp scope lens runs/scope_tiny --prompt \"If the value of the expression is true\"":
        SCOPE_ANALYSIS,
    "megatronapp scope patch runs/scope_tiny --clean \"the value\" --corrupt \"the valve\" "
    "--clean-answer \" \" --corrupt-answer n": SCOPE_ANALYSIS,
    "megatronapp scope patch runs/scope_tiny --clean \"the value\" --corrupt \"the valve\" "
    "--clean-answer \" \" --corrupt-answer n --per head": SCOPE_ANALYSIS,
    "megatronapp scope dla runs/scope_tiny --prompt \"If the value of the expression is true\" "
    "--tp 2": SCOPE_ANALYSIS,
    "megatronapp report RUN_DIR [--out FILE] [--force]": "a template (RUN_DIR) for any run",
    "megatronapp report TRACES [--out FILE] [--cycle N|all]":
        "a template (TRACES) for any folder of traces",
    "megatronapp detect traces": HOWTO,
    "megatronapp analyze traces": HOWTO,
    "megatronapp report traces": HOWTO,
    "megatronapp watch traces": "follows a job while it runs (tests/test_scan_watch.py)",
    "megatronapp scope query runs/scope_tiny \"SELECT layer, head, avg(value) FROM stats "
    "WHERE stat = 'entropy' AND step = 1400 GROUP BY ALL ORDER BY ALL\"": NEEDS_TORCH_RUN,
    "megatronapp scope generate runs/scope_tiny --prompt \"The return statement\" "
    "--tokens 40 --perturb '{kind: act_noise, site: resid_post, layers: [1], sigma: 0.3}'":
        NEEDS_TORCH_RUN,
    "megatronapp sweep scenarios/sweeps/throttle_severity.yaml --out /tmp/sw.csv --jobs 2":
        "48 simulated runs: over a minute on two cores",
    "megatronapp sweep scenarios/sweeps/throttle_severity.yaml --out /tmp/sw.csv "
    "--report /tmp/sw.html --jobs 2": "the same 48 runs (the page is tested in test_sweep.py)",
    ".venv/bin/megatronapp run /tmp/torch_tiny.yaml --backend torch --out /tmp/torch_run": TORCH,
    "megatronapp fidelity fit [--generation DEVICE:SOFTWARE]":
        "a template; a fit simulates every fitted published row several times (minutes)",
    "megatronapp run scenarios/fidelity/cpu_tiny.yaml --backend torch --out runs/cpu_tiny": TORCH,
    "megatronapp calibrate runs/cpu_tiny --scenario scenarios/fidelity/cpu_tiny.yaml":
        NEEDS_TORCH_RUN,
    ".venv/bin/megatronapp run SCENARIO --backend torch --stall-timeout 60":
        "a template (SCENARIO) for torch runs",
}


@dataclass
class Command:
    """A documented command and the output the docs show for it (maybe none)."""

    text: str
    where: str
    shown: list[str] = field(default_factory=list)


def logical_lines(block: str) -> list[str]:
    """The block's lines with backslash continuations joined."""
    lines: list[str] = []
    pending = ""
    for line in block.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    if pending:
        lines.append(pending)
    return lines


def normalize(line: str) -> str:
    """A command as NOT_RUN keys it: no prompt, no comment, single spaces."""
    line = line.strip().removeprefix(PROMPT)
    return " ".join(line[:_comment_start(line)].split())


def _comment_start(line: str) -> int:
    """Where a shell comment starts in ``line`` (its length when none)."""
    quote = ""
    for index, char in enumerate(line):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return index
    return len(line)


def invokes_cli(command: str) -> bool:
    words = command.split()
    return any(w in CLI for w in words) or "megatronapp.cli" in words


def block_commands(block: str, where: str) -> list[Command]:
    """The CLI commands of one code block, each with the output shown after it."""
    lines = logical_lines(block)
    prompted = any(line.startswith(PROMPT) for line in lines)
    commands: list[Command] = []
    current: Command | None = None
    for line in lines:
        if prompted and not line.startswith(PROMPT):
            if current is not None and line.strip():
                current.shown.append(line)
            continue
        text = normalize(line)
        current = Command(text, where) if invokes_cli(text) else None
        if current is not None:
            commands.append(current)
    return commands


def doc_commands(path: Path) -> list[Command]:
    """Every CLI command of one document, in order, with the output it shows."""
    commands: list[Command] = []
    marked: str | None = None
    for token in MarkdownIt("commonmark").parse(path.read_text()):
        where = f"{path.relative_to(ROOT)}:{(token.map or [0])[0] + 1}"
        if token.type == "html_block":
            match = OUTPUT_MARKER.search(token.content)
            marked = normalize(match.group(1)) if match else None
        elif token.type in ("fence", "code_block"):
            if marked is not None:
                commands.append(Command(marked, where, token.content.splitlines()))
                marked = None
            else:
                commands.extend(block_commands(token.content, where))
        else:
            marked = None
    return commands


def cli_argv(command: str) -> list[str]:
    """The argv that runs ``command`` with this interpreter and this checkout."""
    words = shlex.split(command)
    if words[:3] in (["python", "-m", "megatronapp.cli"], [".venv/bin/python", "-m",
                                                             "megatronapp.cli"]):
        rest = words[3:]
    elif words[0] in CLI:
        rest = words[1:]
    else:
        raise AssertionError(f"{command!r}: not a plain CLI call; run it or list it in NOT_RUN")
    if SHELL_OPERATORS.intersection(rest):
        raise AssertionError(f"{command!r}: a shell pipeline; list it in NOT_RUN")
    if any(word.startswith("/") for word in rest):
        raise AssertionError(f"{command!r}: an absolute path would be written or read outside "
                             "the test's directory; list it in NOT_RUN")
    return [sys.executable, "-m", "megatronapp.cli", *rest]


def shape(line: str) -> str:
    """A line's words with its numbers masked and its spacing collapsed."""
    return " ".join(NUMBER.sub("#", line).split())


def compare_shown(command: Command, printed: str) -> None:
    """Each shown line, in order, is a printed line with the same words and numbers."""
    lines = printed.splitlines()
    start = 0
    for shown in command.shown:
        wanted = shape(shown)
        found = next((i for i in range(start, len(lines)) if shape(lines[i]) == wanted), None)
        assert found is not None, (
            f"{command.where}: {command.text!r} no longer prints a line like\n  {shown}\n"
            f"it prints:\n{printed}")
        assert NUMBER.findall(lines[found]) == NUMBER.findall(shown), (
            f"{command.where}: {command.text!r} prints\n  {lines[found]}\n"
            f"the docs show\n  {shown}")
        start = found + 1


def run_documented(command: Command, workdir: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    done = subprocess.run(cli_argv(command.text), cwd=workdir, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
    # a command whose failure the docs show is compared; any other must succeed
    assert done.returncode == 0 or command.shown, (
        f"{command.where}: {command.text!r} exited {done.returncode}:\n{done.stdout}")
    compare_shown(command, done.stdout)


def all_commands() -> list[Command]:
    return [command for path in DOCS for command in doc_commands(path)]


def test_every_documented_command_is_run_or_listed() -> None:
    for command in all_commands():
        if command.text not in NOT_RUN:
            cli_argv(command.text)  # raises for what cannot run as a plain CLI call


def test_not_run_lists_only_documented_commands() -> None:
    documented = {command.text for command in all_commands()}
    stale = sorted(set(NOT_RUN) - documented)
    assert not stale, f"NOT_RUN names commands no doc shows any more: {stale}"


def test_shown_output_is_compared_line_by_line() -> None:
    command = Command("megatronapp detect runs/x", "doc:1",
                      ["root cause: rank 5 (compute, confidence 0.95)",
                       "  96% of 68 ops are slow"])
    printed = ("root cause: rank 5 (compute, confidence 0.95)\n  an extra line 3\n"
               "  96% of 516 ops are slow\n")
    with pytest.raises(AssertionError, match="68 ops"):
        compare_shown(command, printed)
    compare_shown(command, printed.replace("516", "68"))


def test_a_command_that_cannot_run_here_must_be_listed() -> None:
    for command in ("megatronapp run a.yaml --out /tmp/a", "megatronapp run a.yaml | tee log",
                    "taskset -c 1 megatronapp detect runs/a"):
        with pytest.raises(AssertionError, match="NOT_RUN"):
            cli_argv(command)
    assert cli_argv("python -m megatronapp.cli detect runs/a")[1:] == [
        "-m", "megatronapp.cli", "detect", "runs/a"]


def test_prompted_blocks_pair_commands_with_their_output() -> None:
    block = ("$ megatronapp run a.yaml --out runs/a   # simulate\n$ megatronapp detect \\\n"
             "    runs/a\nroot cause: rank 5\n")
    run, detect = block_commands(block, "doc:1")
    assert (run.text, run.shown) == ("megatronapp run a.yaml --out runs/a", [])
    assert (detect.text, detect.shown) == ("megatronapp detect runs/a", ["root cause: rank 5"])


@pytest.mark.slow
@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_documented_commands_print_what_the_docs_show(path: Path, tmp_path: Path) -> None:
    shutil.copytree(ROOT / "scenarios", tmp_path / "scenarios")
    for command in doc_commands(path):
        if command.text not in NOT_RUN:
            run_documented(command, tmp_path)
