"""Commands that read a trace check its size against this machine before
reading its events, cap what a gzip file may inflate to, and turn running out
of memory into one line."""
from __future__ import annotations

import gzip
import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from megatronapp.host import limits
from megatronapp.cli import main
from megatronapp.scan.ingest.kineto import read_json_any
from megatronapp.scan.ingest.load import TraceError, TraceSize, locate_trace, trace_size

from .support import ROOT, peak_memory_of

SCENARIO = ("name: small\niterations: 3\nparallel: {pp: 4, dp: 2, microbatches: 16}\n"  # ~2k events
            "model: {layers: 4, hidden: 64, heads: 2, seq_len: 64, vocab: 128}\n")
TINY_MEMORY = 50e6  # less than any command's fixed cost (limits.COSTS.base_bytes)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("small")
    (work / "s.yaml").write_text(SCENARIO)
    assert main(["run", str(work / "s.yaml"), "--out", str(work / "run"), "--quiet"]) == 0
    return work / "run"


def _commands(run: Path, out: Path) -> dict[str, list[str]]:
    return {"detect": ["detect", str(run)],
            "detect json": ["detect", str(run / "trace.json")],
            "detect baseline": ["detect", str(run), "--method", "slowest-mean"],
            "analyze": ["analyze", str(run)],
            "align": ["align", str(run), "--out", str(out / "aligned.json")],
            "plot": ["plot", str(run)],
            "export-trace": ["export-trace", str(run), "--out", str(out / "export.json")]}


COMMANDS = list(_commands(Path("r"), Path("o")))


def _main(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, list[str]]:
    code = main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


def _no_event_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way these commands read events fails the test if it is taken."""
    def read(*_args: object, **_kw: object) -> None:
        raise AssertionError("events were read before the size check")

    import megatronapp.trace.store as store
    import megatronapp.scan.ingest.load as load
    import megatronapp.scan.align.inputs as inputs

    read_json = load.read_json_any

    def read_summary(path: Path, *args: object, **kw: object) -> object:
        """A run's summary.json (its scenario: how its events are batched) holds no events."""
        if Path(path).name != "summary.json":
            read()
        return read_json(path, *args, **kw)

    monkeypatch.setattr(load, "read_json_any", read_summary)
    for module, name in ((load, "load_store"),
                         (inputs, "load_table_scan"), (store, "iter_columns"),
                         (store, "read_columns")):
        monkeypatch.setattr(module, name, read)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_small_trace_passes_and_is_refused_before_reading_when_memory_is_short(
        command, run_dir, tmp_path, capsys, monkeypatch):
    argv = _commands(run_dir, tmp_path)[command]
    code, err = _main(capsys, argv)
    assert code == 0, err
    monkeypatch.setattr(limits, "available_memory", lambda: TINY_MEMORY)
    _no_event_reading(monkeypatch)
    fresh = tmp_path / "again"  # the first call's outputs are not replaced without --force
    fresh.mkdir()
    code, err = _main(capsys, _commands(run_dir, fresh)[command])
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"megatronapp: limits: {command.split()[0]} on ")
    assert "trace events" in err[0] and "50 MB available" in err[0] and "--no-limits" in err[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_no_limits_skips_the_check(command, run_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(limits, "available_memory", lambda: TINY_MEMORY)
    code, err = _main(capsys, [*_commands(run_dir, tmp_path)[command], "--no-limits"])
    assert code == 0, err


def test_max_seconds_bounds_a_trace_command_too(run_dir, capsys):
    code, err = _main(capsys, ["analyze", str(run_dir), "--max-seconds", "0.01"])
    assert code == 2 and len(err) == 1 and "too long" in err[0] and "0.01 s" in err[0]


def test_a_json_trace_is_sized_by_its_text_and_a_gzip_file_by_its_stated_size(run_dir, tmp_path):
    text = (run_dir / "trace.json").read_bytes()
    packed = tmp_path / "trace.json.gz"
    packed.write_bytes(gzip.compress(text))
    for path in (run_dir / "trace.json", packed):
        assert trace_size(locate_trace(path)) == TraceSize(0, len(text))


# ------------------------------------------------------------- gzip bombs
BOMB_BYTES = 200 << 20  # zeros: about 200 kB packed


def _bomb(path: Path, stated_size: int | None = None) -> Path:
    """200 MB of zeros gzipped; ``stated_size`` overwrites the size the file
    states in its trailer (a lie a reader must not trust)."""
    with gzip.open(path, "wb", compresslevel=9) as fh:
        zeros = bytes(1 << 20)
        for _ in range(BOMB_BYTES >> 20):
            fh.write(zeros)
    if stated_size is not None:
        with open(path, "r+b") as fh:
            fh.seek(-4, 2)
            fh.write(stated_size.to_bytes(4, "little"))
    return path


@pytest.fixture(scope="module")
def lying_bomb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _bomb(tmp_path_factory.mktemp("bomb") / "t.json.gz", stated_size=1000)


def test_inflating_stops_at_the_cap_and_names_the_file_and_the_cap(lying_bomb):
    with pytest.raises(TraceError) as caught:
        read_json_any(lying_bomb, max_bytes=10e6)
    assert str(caught.value) == (f"{lying_bomb}: inflates to more than 10 MB of JSON text, the "
                                 "most this machine's memory can parse (pass --no-limits to "
                                 "try anyway)")


def test_a_plain_file_over_the_cap_is_refused_too(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(TraceError, match="more than 5 B of JSON text"):
        read_json_any(path, max_bytes=5)
    assert read_json_any(path, max_bytes=1e3) == {"traceEvents": []}


def test_detect_refuses_a_bomb_by_the_memory_it_has_and_no_limits_lifts_the_cap(
        lying_bomb, capsys, monkeypatch):
    parses_50_mb = 50e6 * limits.COSTS.json_memory_per_byte
    monkeypatch.setattr(limits, "available_memory", lambda: parses_50_mb)
    code, err = _main(capsys, ["detect", str(lying_bomb)])
    assert code == 2 and len(err) == 1
    assert str(lying_bomb) in err[0] and "inflates to more than 50 MB of JSON text" in err[0]
    code, err = _main(capsys, ["detect", str(lying_bomb), "--no-limits"])
    assert code == 2 and len(err) == 1 and "inflates" not in err[0]
    assert "incorrect length" in err[0].lower()  # inflated to its end, where the stated size lies


def test_an_honest_bomb_is_refused_by_its_stated_size_before_inflating(tmp_path, capsys,
                                                                       monkeypatch):
    bomb = _bomb(tmp_path / "t.json.gz")
    monkeypatch.setattr(limits, "available_memory", lambda: 1e9)  # parses 200 MB, no more
    _no_event_reading(monkeypatch)
    code, err = _main(capsys, ["detect", str(bomb)])
    assert code == 2 and len(err) == 1 and err[0].startswith("megatronapp: limits: detect on")


CAPPED = """
import resource, sys
from megatronapp import cli
import megatronapp.scan.ingest.load, megatronapp.scan.align.inputs, numpy  # what detect loads first
headroom = int(sys.argv[1])
soft = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize() + headroom
resource.setrlimit(resource.RLIMIT_AS, (soft, resource.getrlimit(resource.RLIMIT_AS)[1]))
sys.exit(cli.main(sys.argv[2:]))
"""


def test_under_an_address_space_cap_a_bomb_is_one_line_not_a_memory_error(lying_bomb):
    """800 MB of address space left once the command's modules are loaded:
    the cap on inflating (what the memory still free can parse) stops the
    stream before its 200 MB."""
    done = subprocess.run([sys.executable, "-c", CAPPED, str(800 << 20), "detect",
                           str(lying_bomb)], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, done.stderr
    assert "inflates" in err[0] and str(lying_bomb) in err[0]  # past the cap, or the ratio


# ------------------------------------------------------- out of memory
def _memory_errors() -> list[BaseException]:
    import duckdb
    import pyarrow as pa

    return [MemoryError(), pa.ArrowMemoryError("malloc of size 1 failed"),
            duckdb.OutOfMemoryException("could not allocate block")]


@pytest.mark.parametrize("error", _memory_errors(), ids=lambda e: type(e).__name__)
def test_running_out_of_memory_anyway_is_one_line(error, run_dir, capsys, monkeypatch):
    import megatronapp.scan.evidence.detect as detect

    def exhausted(*_args: object) -> None:
        raise error

    monkeypatch.setattr(detect, "megascan_stored", exhausted)
    code, err = _main(capsys, ["detect", str(run_dir)])
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"megatronapp: detect: out of memory ({type(error).__name__})")


WIDE = ("name: wide\nparallel: {tp: 2, pp: 4, dp: 2048, microbatches: 8}\n"  # 16,384 ranks alike
        "model: {layers: 8, hidden: 64, heads: 4, seq_len: 64, vocab: 128}\n")


def _ran(tmp_path: Path, scenario: str) -> tuple[Path, int]:
    """A run of ``scenario`` and the events its trace holds."""
    (tmp_path / "s.yaml").write_text(scenario)
    run = tmp_path / "run"
    assert main(["run", str(tmp_path / "s.yaml"), "--out", str(run), "--quiet"]) == 0
    return run, trace_size(locate_trace(run)).stored_events


def test_export_of_a_selection_is_priced_by_a_batch_not_by_the_whole_trace(
        tmp_path, capsys, monkeypatch):
    run, events = _ran(tmp_path, WIDE)
    every_event = limits.COSTS.base_bytes + events * limits.COSTS.export.bytes_per_event
    assert events > limits.COSTS.export.held_events  # more than one batch
    monkeypatch.setattr(limits, "available_memory", lambda: every_event / 2)
    argv = ["export-trace", str(run), "--ranks", "0-1023", "--out", str(tmp_path / "x.json")]
    code, err = _main(capsys, argv)
    assert code == 0, err
    estimate = limits.estimate_trace(events, 0, limits.COSTS.export).memory_bytes
    peak = peak_memory_of([*argv, "--force"])
    assert estimate / 3 <= peak <= 3 * estimate


LONG = SCENARIO.replace("iterations: 3", "iterations: 16")  # many small iterations


def test_detect_is_priced_by_its_largest_batch_and_state_not_by_every_event(
        tmp_path, capsys, monkeypatch):
    import megatronapp.scan.align.inputs as inputs

    run, events = _ran(tmp_path, LONG)
    cost = limits.COSTS.detect_columns
    peak = peak_memory_of(["detect", str(run)])
    estimate = limits.estimate_trace(events, 0, cost, inputs.batching(run / "trace.parquet"))
    assert estimate.memory_bytes / 3 <= peak <= 3 * estimate.memory_bytes
    monkeypatch.setattr(inputs, "BATCH_ROWS", events // 8)  # two iterations a batch
    fed = inputs.batching(run / "trace.parquet")
    assert fed.batch_events <= events // 8
    by_batch = limits.estimate_trace(events, 0, cost, fed).memory_bytes
    every_event = limits.estimate_trace(events, 0, cost).memory_bytes
    assert by_batch < every_event
    monkeypatch.setattr(limits, "available_memory", lambda: (by_batch + every_event) / 2)
    code, err = _main(capsys, ["detect", str(run)])
    assert code == 0, err  # the streaming detector fits: not refused


TWINS = ("name: twins\nparallel: {tp: 2, pp: 4, dp: 16, microbatches: 8}\n"
         "model: {layers: 8, hidden: 64, heads: 4, seq_len: 64, vocab: 128}\n"
         "faults: [{kind: throttle, rank: 9, factor: 1.5}]\n")  # 15 replicas of 16 alike


def test_detect_on_twin_replicas_is_priced_by_the_replicas_it_reads_and_every_rank_it_judges(
        tmp_path):
    import megatronapp.scan.align.inputs as inputs

    run, events = _ran(tmp_path, TWINS)
    fed = inputs.batching(run / "trace.parquet")
    assert fed.twin_ranks == 128 and fed.read_events is not None and fed.read_events < events
    assert fed.batch_events < events  # two replicas of sixteen, not every rank
    estimate = limits.estimate_trace(events, 0, limits.COSTS.detect_columns, fed)
    peak = peak_memory_of(["detect", str(run)])
    assert estimate.memory_bytes / 3 <= peak <= 3 * estimate.memory_bytes
