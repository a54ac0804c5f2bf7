"""A run's summary and store taken a few pipelines at a time equal the ones
taken from every row in memory, and the store's row groups are cut as
``trace/store.py`` documents (whole data-parallel replicas of one stage).

Jobs here have jitter on every link and device, so no two pipelines are alike
and nothing reduces: every batch is rows the summary has not seen.
"""
from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from megatronapp.dpp.windows import DppTotals, dpp_summary
from megatronapp.run.write import build_summary
from megatronapp.scenario.config import parse_scenario
from megatronapp.trace.columns import TableSource, concat_same, source_of
from megatronapp.trace.exact import ExactSum, exact_sum
from megatronapp.trace.on_disk import store_meta
from megatronapp.trace.store import CutReader, read_columns, row_groups_of, write_events
from megatronapp.trace.summary import summarize
from megatronapp.trace.totals import RunTotals, fed
from sim import run_sim

FEW = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def jittered(draw: Any) -> dict[str, Any]:
    tp, pp, dp = draw(st.sampled_from([1, 2])), draw(st.integers(2, 3)), draw(st.integers(2, 3))
    schedule = draw(st.sampled_from(["1f1b", "interleaved", "gpipe"]))
    vpp = 2 if schedule == "interleaved" else 1
    return {"seed": draw(st.integers(0, 10**6)), "iterations": draw(st.integers(1, 2)),
            "schedule": schedule,
            "parallel": {"tp": tp, "pp": pp, "dp": dp, "vpp": vpp, "microbatches": 2 * pp},
            "model": {"layers": 2 * pp * vpp, "hidden": 256, "heads": 4, "seq_len": 128,
                      "vocab": 1024},
            "cluster": {"jitter": {"compute_sigma": 0.05, "link_sigma": 0.2}}}


@FEW
@given(data=jittered(), rows=st.integers(1, 5000))
def test_the_summary_of_batches_is_the_summary_of_every_row(data: dict[str, Any], rows: int
                                                              ) -> None:
    s = parse_scenario(data)
    run = run_sim(s, reduce=False)
    source = source_of(run)
    batches = list(source.weighted_batches(rows))
    assert sum(len(cols) for cols, _w in batches) == source.events
    every = {r: list(run.events[r]) for r in run.events}
    assert fed(RunTotals(), batches) == summarize(every)
    assert fed(DppTotals(s, source.stand_ins()), batches) == dpp_summary(s, every)


def test_a_run_summary_is_the_one_of_its_rows_held_in_memory() -> None:
    s = parse_scenario(jittered_job())
    run = run_sim(s, reduce=False)
    table = TableSource(concat_same(list(source_of(run).batches())))
    assert len(list(source_of(run).weighted_batches(1000))) > 1
    streamed = build_summary(s, run)
    in_memory = build_summary(s, replace(run, source=table))
    assert streamed == in_memory


def jittered_job() -> dict[str, Any]:
    return {"seed": 7, "schedule": "interleaved", "parallel": {"tp": 2, "pp": 2, "dp": 4, "vpp": 2, "microbatches": 4},
            "model": {"layers": 8, "hidden": 256, "heads": 4, "seq_len": 128, "vocab": 1024},
            "cluster": {"jitter": {"compute_sigma": 0.05, "link_sigma": 0.2}}}


def test_row_groups_hold_whole_replicas_of_one_stage(tmp_path: Path) -> None:
    s = parse_scenario(jittered_job())
    run = run_sim(s, reduce=False)
    source = source_of(run)
    tp, dp = s.parallel.tp, s.parallel.dp
    per_rank = source.events // s.world_size
    path = tmp_path / "trace.parquet"
    written = write_events(path, source, store_meta(s, run, source), max_rows=3 * tp * per_rank)
    assert written == source.events
    in_memory = tmp_path / "in_memory.parquet"  # every row held, written as one row group
    write_events(in_memory, TableSource(concat_same(list(source.batches()))),
                 store_meta(s, run, source), max_rows=source.events)
    assert pq.read_table(path).equals(pq.read_table(in_memory))
    footer = pq.ParquetFile(path)
    seen: list[int] = []
    for g in range(footer.num_row_groups):
        ranks = np.unique(footer.read_row_group(g, columns=["rank"]).column("rank").to_numpy())
        stage = ranks // (tp * dp)
        assert len(np.unique(stage)) == 1  # one stage
        assert ranks[0] % tp == 0 and len(ranks) % tp == 0  # whole replicas
        assert np.array_equal(ranks, np.arange(ranks[0], ranks[-1] + 1))
        assert len(ranks) <= 3 * tp
        seen += ranks.tolist()
    assert seen == list(range(s.world_size))  # ascending, no rank in two row groups
    replica = [r for r in range(s.world_size) if (r // tp) % dp == 1]  # replica 1, every stage
    assert len(row_groups_of(path, replica)) == s.parallel.pp
    cols, _meta = read_columns(path, ranks=replica)
    whole, _ = read_columns(path)
    assert np.array_equal(cols.start_s, whole.start_s[np.isin(whole.rank, replica)])
    assert np.array_equal(cols.rank, whole.rank[np.isin(whole.rank, replica)])
    reader = CutReader(path)  # the same rows, metadata and footer read once for every cut
    for cut in (replica, [r for r in range(s.world_size) if (r // tp) % dp == 0], None):
        by_reader = reader.columns(cut, None)
        alone, _ = read_columns(path, ranks=cut, with_args=False)
        assert np.array_equal(by_reader.rank, alone.rank)
        assert np.array_equal(by_reader.start_s, alone.start_s)
        assert np.array_equal(by_reader.dur_s, alone.dur_s)


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=60),
       st.integers(0, 60))
@example([1.6994480443672662e+297, 1.7976931348453213e+308, -1.0], 0)  # rounds down to the largest
def test_an_exact_sum_does_not_depend_on_how_its_terms_are_cut(values: list[float], cut: int
                                                                 ) -> None:
    terms = np.array(values, np.float64)
    parts = ExactSum()
    parts.add(terms[:cut])
    parts.add(terms[cut:])
    exact = sum((Fraction(v) for v in values), Fraction(0))
    try:  # rounded once (math.fsum refuses an overflow midway that the rounding undoes)
        expected = float(exact)
    except OverflowError:  # the exact sum rounds beyond a float: infinity of its sign
        expected = math.inf if exact > 0 else -math.inf
    assert exact_sum(terms) == expected == parts.value()
