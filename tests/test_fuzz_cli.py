"""Property-based fuzzing of the real command line.

Hypothesis generates valid scenarios and traces and breaks them (wrong types,
NaN and infinities, negative and huge numbers, unknown keys, deep nesting, bad
encodings, duplicate keys, unsafe names). Each input runs through
``python -m megatronapp.cli`` in a subprocess capped in time and memory, and
the contract holds: exit 0 with a complete, valid result, or exit 2 with one
line on stderr and nothing left behind.

``MEGATRONAPP_FUZZ_EXAMPLES`` sets the inputs per test (default 40).
"""
from __future__ import annotations

import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from megatronapp.trace.store import read_columns

from .support import ROOT

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("MEGATRONAPP_FUZZ_EXAMPLES", "40"))
TIME_CAP_S = 240  # per command; the runs themselves are kept under --max-seconds
MEMORY_CAP = 6 << 30  # address space per command
MAX_SECONDS = "10"  # estimated work a fuzzed run may do (an explicit option of run)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=False, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _caps() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))
    resource.setrlimit(resource.RLIMIT_CPU, (TIME_CAP_S, TIME_CAP_S + 5))


def cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "megatronapp.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=TIME_CAP_S,
                          preexec_fn=_caps)


def listing(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def strict_json(path: Path) -> Any:
    def refuse(name: str) -> None:
        raise AssertionError(f"{path.name} holds {name}")

    return json.loads(path.read_text(encoding="utf-8"), parse_constant=refuse)


def check_contract(result: subprocess.CompletedProcess[str], before: set[str], work: Path,
                   on_success: Callable[[], None], tally: Counter) -> None:
    """Exit 0 and a valid result, or exit 2, one line and nothing new on disk."""
    detail = f"exit {result.returncode}; stderr: {result.stderr[-2000:]}"
    assert result.returncode in (0, 2), detail
    if result.returncode == 2:
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("megatronapp"), detail
        assert listing(work) == before, f"left behind: {listing(work) - before}; {detail}"
        tally["exit 2 (one line, nothing left)"] += 1
        event("exit 2")
    else:
        on_success()
        tally["exit 0 (valid result)"] += 1
        event("exit 0")


# ------------------------------------------------------------ scenarios
SIGNED = st.one_of(st.integers(-(2**70), 2**70), st.integers(-5, 5))


@st.composite
def valid_scenario(draw: st.DrawFn) -> dict[str, Any]:
    tp, pp, dp = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4])), draw(
        st.sampled_from([1, 2]))
    interleaved = pp > 1 and draw(st.booleans())
    vpp = 2 if interleaved else 1
    schedule = draw(st.sampled_from(["interleaved", "dfc"] if interleaved else
                                    ["gpipe", "1f1b", "bfc", "adaptive"]))
    microbatches = pp * draw(st.integers(1, 2)) if interleaved else draw(st.integers(1, 4))
    world = tp * pp * dp
    data: dict[str, Any] = {
        "name": draw(st.sampled_from(["fuzz", "run-1", "a.b", "\u00e9t\u00e9"])),
        "seed": draw(SIGNED), "iterations": draw(st.integers(1, 2)), "schedule": schedule,
        "parallel": {"tp": tp, "pp": pp, "dp": dp, "vpp": vpp, "microbatches": microbatches},
        "model": {"layers": pp * vpp * draw(st.integers(1, 2)), "hidden": 16 * tp * 2,
                  "heads": 2 * tp, "seq_len": 32, "vocab": 64},
        "cluster": {"jitter": {"compute_sigma": draw(st.sampled_from([0.0, 0.05])),
                               "link_sigma": draw(st.sampled_from([0.0, 0.1]))}},
        "faults": draw(st.lists(fault(world), max_size=3)),
        "allow_idle_faults": True,  # random ranks: a link may join ranks that never talk
    }
    if draw(st.booleans()):
        data["costs"] = {"forward_s": draw(st.floats(0, 1e-2)),
                         "backward_s": draw(st.floats(0, 2e-2)), "p2p_s": 0.0}
    return data


def fault(world: int) -> st.SearchStrategy[dict[str, Any]]:
    rank = st.integers(0, world - 1)
    pair = st.lists(rank, min_size=2, max_size=2, unique=True) if world > 1 else st.nothing()
    kinds = [st.fixed_dictionaries({"kind": st.just("throttle"), "rank": rank,
                                    "factor": st.floats(0.5, 4)}),
             st.fixed_dictionaries({"kind": st.just("clock_skew"), "rank": rank,
                                    "offset_us": st.floats(-1e4, 1e4),
                                    "drift_ppm": st.floats(-100, 100)})]
    if world > 1:
        kinds += [st.fixed_dictionaries({"kind": st.just("slow_link"), "ranks": pair,
                                         "factor": st.floats(1, 8)}),
                  st.fixed_dictionaries({"kind": st.just("link_jitter"), "ranks": pair,
                                         "sigma": st.floats(0.01, 1)})]
    return st.one_of(kinds)


BAD_VALUES = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, -1, 0, -1e-9, 1e300, 10**40, 2**31, True,
                     False, None, "", "many", "1e9", [], {}, [1, 2], {"a": 1}, "../x", ".",
                     "/abs", "a/b"]),
    st.integers(), st.floats(), st.text(max_size=8))


def leaf_paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    if isinstance(node, dict):
        return [prefix] + [p for k, v in node.items() for p in leaf_paths(v, prefix + (k,))]
    if isinstance(node, list):
        return [prefix] + [p for i, v in enumerate(node) for p in leaf_paths(v, prefix + (i,))]
    return [prefix]


def set_path(data: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    node = data
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return data


DEEP = "DEEPLY_NESTED_"  # a placeholder the YAML text replaces with [[[...1...]]]


def nested(depth: int) -> str:
    return f"{DEEP}{depth}"


def expand_nesting(text: str) -> str:
    """YAML dumpers recurse: write deep flow lists into the text instead."""
    for depth in (10, 70, 3000):
        text = text.replace(f"{DEEP}{depth}", "[" * depth + "1" + "]" * depth)
    return text


@st.composite
def mutated_scenario(draw: st.DrawFn) -> dict[str, Any]:
    data = draw(valid_scenario())
    for _ in range(draw(st.integers(0, 3))):
        path = draw(st.sampled_from(leaf_paths(data)))
        how = draw(st.sampled_from(["bad", "bad", "huge", "unknown", "deep"]))
        if how == "bad":
            data = set_path(data, path, draw(BAD_VALUES))
        elif how == "huge":
            data = set_path(data, path, draw(st.sampled_from([10**6, 10**9, 10**12, 65536])))
        elif how == "unknown":
            target = data
            for part in path:
                target = target[part] if isinstance(target, (dict, list)) else target
            if isinstance(target, dict):
                target[draw(st.sampled_from(["bogus", "colour", "Name"]))] = 1
        else:
            data = set_path(data, path, nested(draw(st.sampled_from([10, 70, 3000]))))
        if not isinstance(data, dict):
            break
    return data


@st.composite
def scenario_bytes(draw: st.DrawFn) -> bytes:
    data = draw(st.one_of(valid_scenario(), mutated_scenario()))
    try:
        text = expand_nesting(yaml.safe_dump(data, allow_unicode=True, sort_keys=False))
    except yaml.YAMLError:
        text = "name: x\n"
    encoding = draw(st.sampled_from(["utf-8"] * 12 + ["utf-16", "latin-1", "binary", "empty",
                                                      "duplicate", "truncate"]))
    if encoding == "utf-16":
        return text.encode("utf-16")
    if encoding == "latin-1":
        return ("# caf\u00e9\n" + text).encode("latin-1", errors="replace")
    if encoding == "binary":
        return draw(st.binary(min_size=1, max_size=64)) + text.encode()
    if encoding == "empty":
        return draw(st.sampled_from([b"", b"\n", b"# nothing\n"]))
    if encoding == "duplicate":
        return (text + "seed: 1\nseed: 2\n").encode()
    if encoding == "truncate":
        return text.encode()[: draw(st.integers(0, max(0, len(text) - 1)))]
    return text.encode()


def check_run_dir(result_dir: Path) -> None:
    manifest = strict_json(result_dir / "manifest.json")
    files = set(manifest["files"])
    assert files == listing(result_dir) - {"manifest.json"}
    summary = strict_json(result_dir / "summary.json")
    assert summary["world_size"] >= 1 and len(summary["iteration_times_s"]) >= 1
    strict_json(result_dir / "ground_truth.json")
    cols, _meta = read_columns(result_dir / "trace.parquet")
    assert len(cols) == summary["trace"]["events"] >= 1
    if summary["trace"]["trace_json"]:
        trace = strict_json(result_dir / "trace.json")
        assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == len(cols)


SCENARIO_TALLY: Counter = Counter()


def test_fuzzed_scenarios_keep_the_contract() -> None:
    @FUZZ
    @given(content=scenario_bytes(), explicit_out=st.booleans(), force=st.booleans())
    def one(content: bytes, explicit_out: bool, force: bool) -> None:
        work = Path(tempfile.mkdtemp(prefix="fuzz-scenario-"))
        try:
            (work / "s.yaml").write_bytes(content)
            before = listing(work)
            args = ["run", "s.yaml", "--quiet", "--max-seconds", MAX_SECONDS]
            args += ["--out", "out"] if explicit_out else []
            args += ["--force"] if force else []
            result = cli(args, work)

            def valid() -> None:
                made = listing(work) - before
                top = {p.split("/")[0] for p in made}
                assert top == ({"out"} if explicit_out else {"runs"}), made
                result_dir = work / "out" if explicit_out else next((work / "runs").iterdir())
                check_run_dir(result_dir)

            check_contract(result, before, work, valid, SCENARIO_TALLY)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    one()
    tried = sum(SCENARIO_TALLY.values())
    print(f"\nfuzz scenarios: {tried} inputs tried, all kept the contract: "
          + ", ".join(f"{n} {k}" for k, n in sorted(SCENARIO_TALLY.items())))
    assert tried >= EXAMPLES


# --------------------------------------------------------------- traces
FINITE = st.floats(0, 1e6, allow_nan=False, allow_infinity=False)


@st.composite
def valid_trace(draw: st.DrawFn) -> list[dict[str, Any]]:
    ranks = draw(st.integers(1, 4))
    events: list[dict[str, Any]] = []
    for rank in range(ranks):
        t = 0.0
        for i in range(draw(st.integers(1, 6))):
            name = draw(st.sampled_from(["forward", "backward", "send_forward", "recv_forward",
                                         "dp_allreduce", "optimizer", "ncclKernel"]))
            args: dict[str, Any] = {"iteration": draw(st.integers(0, 1)), "microbatch": i,
                                    "chunk": 0}
            if name.startswith(("send", "recv")):
                args.update(peer=draw(st.integers(0, ranks)), bytes=1024)
            if name == "dp_allreduce":
                args["group"] = list(range(ranks))
            dur = draw(FINITE)
            events.append({"ph": "X", "name": name, "pid": rank, "tid": 0, "ts": t, "dur": dur,
                           "args": args})
            t += dur + draw(FINITE)
    return events


TRACE_BAD = st.sampled_from([math.nan, math.inf, -1.0, None, "x", True, [], {}, ["a"],
                             [{"r": 1}], 10**30])


@st.composite
def trace_bytes(draw: st.DrawFn) -> bytes:
    events = draw(valid_trace())
    for _ in range(draw(st.integers(0, 2))):
        if not events:
            break
        e = draw(st.sampled_from(events))
        key = draw(st.sampled_from(["ts", "dur", "ph", "pid", "name", "args", "args.group",
                                    "args.peer", "args.iteration", "args.bytes", "delete ph"]))
        if key == "delete ph":
            e.pop("ph", None)
        elif key.startswith("args."):
            if isinstance(e.get("args"), dict):
                e["args"][key[5:]] = draw(TRACE_BAD)
        else:
            e[key] = draw(TRACE_BAD)
    shape = draw(st.sampled_from(["object"] * 4 + ["list"] * 2 + [
        "empty", "deep", "utf-16", "binary", "truncate", "not-a-list"]))
    if shape == "empty":
        return b'{"traceEvents": []}'
    if shape == "deep":
        depth = draw(st.sampled_from([100, 100_000]))
        return ("[" * depth + "]" * depth).encode()
    if shape == "not-a-list":
        return b'{"traceEvents": 5}'
    text = json.dumps({"traceEvents": events} if shape != "list" else events)  # NaN/Infinity kept
    if shape == "utf-16":
        return text.encode("utf-16")
    if shape == "binary":
        return draw(st.binary(min_size=1, max_size=32)) + text.encode()
    if shape == "truncate":
        return text.encode()[: draw(st.integers(0, len(text) - 1))]
    return text.encode()


TRACE_COMMANDS = {
    "analyze": ["analyze", "run"], "detect": ["detect", "run"],
    "query": ["query", "run", "SELECT rank, count(*) FROM events GROUP BY rank"],
    "align": ["align", "run/trace.json", "--out", "aligned.json"], "plot": ["plot", "run"],
}
TRACE_TALLY: Counter = Counter()


def test_fuzzed_traces_keep_the_contract() -> None:
    @FUZZ
    @given(content=trace_bytes(), command=st.sampled_from(sorted(TRACE_COMMANDS)))
    def one(content: bytes, command: str) -> None:
        work = Path(tempfile.mkdtemp(prefix="fuzz-trace-"))
        try:
            (work / "run").mkdir()
            (work / "run" / "trace.json").write_bytes(content)
            before = listing(work)
            result = cli(TRACE_COMMANDS[command], work)

            def valid() -> None:
                assert result.stdout.strip(), "exit 0 says nothing"
                made = listing(work) - before
                if command == "align":
                    assert made == {"aligned.json"}
                    strict_json(work / "aligned.json")
                elif command == "plot":
                    assert made and all(p.endswith(".png") for p in made), made
                else:
                    assert made == set(), made

            check_contract(result, before, work, valid, TRACE_TALLY)
            TRACE_TALLY[f"via {command}"] += 1
        finally:
            shutil.rmtree(work, ignore_errors=True)

    one()
    tried = sum(v for k, v in TRACE_TALLY.items() if k.startswith("exit"))
    print(f"\nfuzz traces: {tried} inputs tried, all kept the contract: "
          + ", ".join(f"{n} {k}" for k, n in sorted(TRACE_TALLY.items())))
    assert tried >= EXAMPLES
