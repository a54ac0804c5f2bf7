"""A symmetric run's store: the representatives' rows and the classes they
stand for, read back as every rank by the store's readers, MegaScan, query
and export-trace, the same as a store of every row."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from megatronapp.cli import main
from megatronapp.scan.ingest.load import locate_trace, trace_size
from megatronapp.scenario.config import load_scenario
from megatronapp.trace.columns import EventColumns, TableSource, concat_columns
from megatronapp.trace.store import FORMAT, SYMMETRIC, expanded_view, iter_columns, read_columns, \
    read_meta, read_source, write_events
from sim import simulate

JOB = ("parallel: {tp: 2, pp: 4, dp: 8, microbatches: 8}\n"
       "model: {layers: 8, hidden: 64, heads: 4, seq_len: 64, vocab: 128}\n"
       "faults: [{kind: throttle, rank: 9, factor: 1.5}, {kind: slow_link, ranks: [1, 17], "
       "factor: 2.0}, {kind: clock_skew, rank: 40, offset_us: 300, drift_ppm: 20}]\n")


def _run(tmp_path: Path, *sets: str) -> tuple[Path, EventColumns]:
    """A run directory written by ``megatronapp run``, and every rank's events
    as the simulation produced them."""
    path = tmp_path / "job.yaml"
    path.write_text(JOB)
    out = tmp_path / "run"
    argv = [a for s in sets for a in ("--set", s)]
    assert main(["run", str(path), "--out", str(out), "--quiet", *argv]) == 0
    return out, simulate(load_scenario(path, list(sets))).source.columns()


def _rows(cols: EventColumns) -> dict[str, list[object]]:
    """Every field of every row, names and groups decoded."""
    out: dict[str, list[object]] = {f: getattr(cols, f).tolist() for f in (
        "rank", "kind", "start_s", "dur_s", "iteration", "microbatch", "chunk", "nbytes", "peer",
        "role", "tag")}
    out["name"] = [cols.names[i] for i in cols.name]
    out["group"] = [cols.groups[i] if i >= 0 else None for i in cols.group]
    return out


def test_a_symmetric_run_stores_its_representatives_and_is_read_as_every_rank(tmp_path):
    out, every = _run(tmp_path)
    store = out / "trace.parquet"
    meta = read_meta(store)
    stand_ins = meta.stand_ins
    assert stand_ins is not None and json.loads(pq.read_schema(store).metadata[
        b"megatronapp"])["format"] == SYMMETRIC
    stored = pq.read_metadata(store).num_rows
    assert stored < len(every) and meta.extra["events"] == len(every)
    assert set(pq.read_table(store, columns=["rank"]).column("rank").to_pylist()) == \
        set(stand_ins.members) | (set(range(64)) - {r for m in stand_ins.members.values()
                                                    for r in m})
    summary = json.loads((out / "summary.json").read_text())["trace"]
    assert (summary["events"], summary["stored_events"]) == (len(every), stored)
    assert _rows(read_columns(store)[0]) == _rows(every)
    assert _rows(concat_columns(list(iter_columns(store, max_rows=500)))) == _rows(every)
    wanted = np.isin(every.rank, [3, 9, 40, 63]) & (every.iteration == 0)
    chosen, _ = read_columns(store, ranks=[63, 3, 40, 9, 64, -1], iterations=[0])  # 64, -1: none
    assert _rows(chosen) == _rows(every.take(wanted))
    assert trace_size(locate_trace(out)).stored_events == len(every)  # what detect will hold


def test_a_run_with_no_two_pipelines_alike_stores_every_row(tmp_path):
    out, every = _run(tmp_path, "cluster.jitter.link_sigma=0.2")
    store = out / "trace.parquet"
    assert read_meta(store).stand_ins is None
    assert json.loads(pq.read_schema(store).metadata[b"megatronapp"])["format"] == FORMAT
    assert pq.read_metadata(store).num_rows == len(every)
    assert "stored_events" not in json.loads((out / "summary.json").read_text())["trace"]


def _full_copy(run: Path, tmp_path: Path) -> Path:
    """The same run directory with a store of every rank's rows (as runs wrote it
    before symmetric stores)."""
    full = tmp_path / "full"
    shutil.copytree(run, full)
    store = run / "trace.parquet"
    meta = read_meta(store)
    extra = {k: v for k, v in meta.extra.items() if k not in ("classes", "events")}
    cols, _ = read_columns(store)
    write_events(full / "trace.parquet", TableSource(cols), replace(meta, extra=extra))
    assert read_meta(full / "trace.parquet").stand_ins is None
    return full


@pytest.mark.parametrize("command", [
    ["detect", "{run}", "--json"],
    ["align", "{run}", "--json"],
    ["query", "{run}", "select rank, count(*), sum(dur_us), min(group_ranks), max(peer) "
     "from events group by rank order by rank"],
    ["export-trace", "{run}", "--ranks", "8-11", "--iterations", "0", "--out", "{out}"],
])
def test_readers_give_a_symmetric_store_the_answers_of_a_full_one(tmp_path, capsys, command):
    run, _every = _run(tmp_path)
    full = _full_copy(run, tmp_path)
    capsys.readouterr()  # what run printed
    answers = []
    for target in (run, full):
        out = tmp_path / f"{target.name}.json"
        assert main([a.format(run=target, out=out) for a in command]) == 0
        printed = capsys.readouterr().out.replace(str(target), "RUN").replace(str(out), "OUT")
        answers.append((printed, out.read_bytes() if out.exists() else b""))
    assert answers[0] == answers[1]


def test_duckdb_sees_every_rank_of_a_symmetric_store_through_its_view(tmp_path):
    import duckdb

    run, _every = _run(tmp_path)
    full = _full_copy(run, tmp_path)
    con = duckdb.connect()
    expanded_view(con, run / "trace.parquet")
    expanded_view(con, full / "trace.parquet", "whole")
    tables = [con.sql(f'SELECT * FROM {view} ORDER BY rank, start_s, name, dur_s, tag, peer, '
                          f'"group"').to_arrow_table() for view in ("events", "whole")]
    assert tables[0].schema.equals(tables[1].schema) and tables[0].equals(tables[1])
    assert con.execute("SELECT count(DISTINCT rank) FROM events").fetchone() == (64,)


def test_a_symmetric_store_is_a_compact_event_source_as_the_run_was(tmp_path):
    out, every = _run(tmp_path)
    path = out / "trace.parquet"
    run = simulate(load_scenario(tmp_path / "job.yaml", [])).source
    source = read_source(path)
    (stored, weights), (simulated, ran_weights) = source.compact(), run.compact()
    assert _rows(stored) == _rows(simulated) and weights.tolist() == ran_weights.tolist()
    assert source.stand_ins() == run.stand_ins() and source.events == len(every)
    assert _rows(source.rank_rows(41)) == _rows(every.take(every.rank == 41))
    assert isinstance(read_source(_full_copy(out, tmp_path) / "trace.parquet"), TableSource)


@pytest.mark.parametrize("classes", ["everyone", [[0, [0, 64]]], [[1, [0, 1]]], [[0, [0.5]]]])
def test_a_store_with_malformed_classes_is_one_line_naming_it(tmp_path, capsys, classes):
    out, _every = _run(tmp_path)
    store = out / "trace.parquet"
    table = pq.read_table(store)
    data = json.loads(table.schema.metadata[b"megatronapp"])
    pq.write_table(table.replace_schema_metadata({b"megatronapp": json.dumps(
        {**data, "classes": classes}).encode()}), store)
    capsys.readouterr()
    assert main(["detect", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(store) in err[0] and "'classes'" in err[0], err


def test_detect_expands_a_symmetric_store_one_batch_at_a_time_with_the_full_stores_verdict(
        tmp_path, monkeypatch):
    from megatronapp.scan.align import inputs
    from megatronapp.scan.evidence.detect import megascan_stored
    from megatronapp.trace.classes import Expansion

    run, every = _run(tmp_path)
    full = _full_copy(run, tmp_path)
    whole = megascan_stored(full / "trace.parquet").to_json()
    monkeypatch.setattr(inputs, "BATCH_ROWS", len(every) // 4)  # cut by microbatch
    expanded: list[int] = []
    rows = Expansion.rows

    def spy(self: Expansion, ranks: list[int]) -> EventColumns:
        out = rows(self, ranks)
        expanded.append(len(out))
        return out

    monkeypatch.setattr(Expansion, "rows", spy)
    largest = max(len(b.cols) for b in inputs.stored_batches(run / "trace.parquet"))
    assert largest < len(every) and max(expanded) <= largest  # never the whole run at once
    assert megascan_stored(run / "trace.parquet").to_json() == whole
    assert megascan_stored(full / "trace.parquet").to_json() == whole


ALIKE = ("parallel: {tp: 1, pp: 2, dp: 12, microbatches: 8}\n"
         "model: {layers: 8, hidden: 64, heads: 4, seq_len: 64, vocab: 128}\n")


@pytest.mark.parametrize("job, faults", [
    (JOB, "[]"),
    (JOB, "[{kind: throttle, rank: 9, factor: 1.5}]"),
    (JOB, "[{kind: slow_link, ranks: [1, 17], factor: 2.0}]"),
    (JOB, "[{kind: throttle, rank: 9, factor: 1.5}, {kind: slow_link, ranks: [3, 19], "
          "factor: 2.0}]"),
    # two replicas throttled alike (one class of two pipelines, judged from
    # one), two others each its own way, eight healthy (one class judged
    # from one): counted once each, the slowed ranks would be half of the
    # stage and their peers' median one of them
    (ALIKE, "[{kind: throttle, rank: 1, factor: 1.5}, {kind: throttle, rank: 2, factor: 1.5}, "
            "{kind: throttle, rank: 3, factor: 1.3}, {kind: throttle, rank: 4, factor: 1.2}]"),
])
def test_detect_judges_twin_replicas_from_one_with_the_verdict_of_every_rank(
        tmp_path, job, faults):
    from megatronapp.scan.align import inputs
    from megatronapp.scan.evidence.detect import megascan_stored

    path = tmp_path / "job.yaml"
    path.write_text(job)
    run = tmp_path / "run"
    assert main(["run", str(path), "--out", str(run), "--quiet", "--set", f"faults={faults}"]) == 0
    full = _full_copy(run, tmp_path)
    batches = list(inputs.stored_batches(run / "trace.parquet"))
    twins = batches[0].twins
    assert twins is not None and all(b.twins == twins for b in batches)
    assert set(np.unique(np.concatenate([b.cols.rank for b in batches])).tolist()) == \
        set(twins.present) and len(twins.present) < twins.world  # the present replicas only
    assert sum(b.job_events for b in batches) == trace_size(locate_trace(run)).stored_events
    verdict = megascan_stored(run / "trace.parquet")
    assert verdict.to_json() == megascan_stored(full / "trace.parquet").to_json()
    if "rank: 4," in faults:  # each slowed rank named, by how much it was slowed
        assert {c.rank: c.evidence["slowdown"] for c in verdict.root_causes} == {
            1: 1.5, 2: 1.5, 3: 1.3, 4: 1.2}
