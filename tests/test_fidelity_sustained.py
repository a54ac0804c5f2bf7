"""The sustained-load layer benchmark (experiments/sustained_bench.py) times
the kernels the cost model prices for each H100 row, and the README's strong
scaling (experiments/h100_interleaving.py --strong-scaling) keeps its batch,
and --matching-factor finds the constant at which a row takes its published time."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatronapp.fidelity.fit import with_settings
from megatronapp.fidelity.published import published_runs

from .support import ROOT

README = "Megatron-LM README"


def test_each_readme_rows_layer_holds_its_per_rank_gemm_flops_three_times() -> None:
    from experiments.sustained_bench import row_shapes

    runs = {r.source: r.scenario for r in published_runs(ROOT)}
    rows = [r for r in row_shapes(ROOT, "h100-sxm") if r["source"].startswith(README)]
    assert len(rows) == 9
    for row in rows:
        s = runs[row["source"]]
        m, tp = s.model, s.parallel.tp
        # a GPT layer's GEMMs: QKV 3h², projection h², MLP 8h², over tp, on every token
        forward = 24 * m.micro_batch_size * m.seq_len * m.hidden ** 2 / tp
        flops = [2.0 * a * b * c for a, b, c in row["gemms"]]
        assert sum(flops) == 3 * forward, row["source"]
        at = row["attention"]
        assert (at["b"] * at["h"], at["sq"], at["sk"]) == (
            m.micro_batch_size * m.heads // tp, m.seq_len, m.seq_len)


def test_the_kept_measurement_timed_the_kernels_the_cost_model_lists_now() -> None:
    from experiments.sustained_bench import row_shapes

    kept = json.loads((ROOT / "experiments/data/sustained_shapes.json").read_text())
    now = json.loads(json.dumps(row_shapes(ROOT, "h100-sxm")))  # tuples as lists
    assert kept == now
    measured = json.loads((ROOT / "experiments/data/sustained_h200.json").read_text())
    assert [r["source"] for r in measured["rows"]] == [r["source"] for r in now]


def test_compare_prices_every_measured_row_from_the_kernel_table() -> None:
    from experiments.sustained_bench import comparison_rows, table_priced_s

    shapes = json.loads((ROOT / "experiments/data/sustained_shapes.json").read_text())
    result = json.loads((ROOT / "experiments/data/sustained_h200.json").read_text())
    rows = comparison_rows(shapes, result, ["h200-sxm"])
    assert len(rows) == len(result["rows"])
    small, large = shapes[0], shapes[8]  # the README's 1.7B and 462B layers
    assert table_priced_s(large, "h200-sxm") > 4 * table_priced_s(small, "h200-sxm")


def test_the_strong_scaling_points_keep_the_batch_and_the_replica() -> None:
    from experiments.h100_interleaving import STRONG_MFU, STRONG_ROW, at_gpus, with_constants

    run = next(r for r in published_runs(ROOT)
               if r.source.startswith(README) and r.source.endswith(STRONG_ROW))
    s = with_constants(run)
    for gpus in STRONG_MFU:
        at = at_gpus(s, gpus)
        assert at.world_size == gpus
        assert at.parallel.dp * at.parallel.microbatches * at.model.micro_batch_size == 1152
        assert (at.parallel.tp, at.parallel.pp) == (s.parallel.tp, s.parallel.pp)


def test_the_benchmark_keeps_a_file_it_did_not_write_and_names_bad_input(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from experiments.sustained_bench import main

    mine = tmp_path / "shapes.json"
    mine.write_text("a user's file")
    assert main(["shapes", "--out", str(mine)]) == 2
    assert mine.read_text() == "a user's file"
    assert "--force" in capsys.readouterr().err
    assert main(["shapes", "--out", str(mine), "--force"]) == 0
    assert json.loads(mine.read_text()) == json.loads(
        (ROOT / "experiments/data/sustained_shapes.json").read_text())
    broken = tmp_path / "result.json"
    broken.write_text("{not json")
    assert main(["compare", "--shapes", str(mine), "--result", str(broken)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--result" in err and "JSON" in err


def test_the_steady_state_of_a_row_without_a_pipeline_waits_on_the_weight_gather() -> None:
    from experiments.h100_interleaving import first_and_steady, with_constants

    run = next(r for r in published_runs(ROOT)
               if r.source.startswith(README) and r.source.endswith(", 32B"))
    first, steady = first_and_steady(with_constants(run))
    assert steady > first * 1.02  # 8 GB of weights per rank, half hidden by one forward

    apart = with_settings(with_constants(run), {"training.overlap_param_gather": False})
    no_overlap_first, no_overlap_steady = first_and_steady(apart)
    # blocking gathers: every iteration alike
    assert no_overlap_steady == pytest.approx(no_overlap_first, rel=1e-9)


@pytest.mark.parametrize("size", ["16B", "32B"])
def test_the_matching_factor_makes_the_row_take_its_published_time(size: str) -> None:
    from experiments.h100_interleaving import matching_factor, steady_at_factor, with_constants

    run = next(r for r in published_runs(ROOT)
               if r.source.startswith(README) and r.source.endswith(f", {size}"))
    s = with_constants(run)
    fitted = s.cluster.gpu.kernel_time_factor
    factor, at_fitted = matching_factor(s, run.iteration_s)
    assert steady_at_factor(s, factor) == pytest.approx(run.iteration_s, rel=1e-3)
    # both rows run slower than published at the fitted constant, so each alone
    # would choose a smaller one
    assert at_fitted == steady_at_factor(s, fitted) > run.iteration_s
    assert factor < fitted


def test_te_overlap_costs_follow_the_tp_traffic() -> None:
    from experiments.h100_interleaving import (TE_COMM_SMS, te_sm_share, te_split_ratio,
                                              with_constants)
    from megatronapp.costs.per_op import Efficiency

    run = next(r for r in published_runs(ROOT)
               if r.source.startswith(README) and r.source.endswith(", 177B"))
    s = with_constants(run)
    nvlink = s.cluster.links.intra_node_gbps
    slow = with_settings(s, {"cluster.links.intra_node_gbps": nvlink / 4})
    share, slow_share = te_sm_share(s, Efficiency.of(s)), te_sm_share(slow, Efficiency.of(slow))
    # longer collectives overlap more of the GEMMs, never more than all of them
    assert 0 < share < slow_share < TE_COMM_SMS / s.cluster.gpu.sm_count
    # the split GEMMs' price does not depend on the links
    assert te_split_ratio(s, Efficiency.of(s)) == te_split_ratio(slow, Efficiency.of(slow))
    assert te_split_ratio(s, Efficiency.of(s)) > 0.9


def test_the_script_refuses_two_modes_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    from experiments.h100_interleaving import main

    with pytest.raises(SystemExit) as exited:
        main(["--gathers", "--te-overlap"])
    assert exited.value.code == 2
    assert "--te-overlap: not allowed with argument --gathers" in capsys.readouterr().err
