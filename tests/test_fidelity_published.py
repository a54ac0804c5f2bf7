"""Published runs: Narayanan et al. 2021 Table 1's constants fitted on two rows
(one without a pipeline, one with) predict others within 5%, strong scaling
loses throughput per GPU as the paper's does; the table of published rows
(scenarios/published/runs.yaml) keeps each device's fitted rows apart from the
held-out ones, and its figures agree with a second source where one exists."""
from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from sim import simulate_iteration_times
from megatronapp.scenario.config import Scenario
from megatronapp.scenario.devices import DEVICES
from megatronapp.costs.flops import hardware_flops_per_iteration, model_flops_per_iteration
from megatronapp.fidelity.fit import with_settings
from megatronapp.fidelity.predict import predict, steady_state_s
from megatronapp.fidelity.published import (GENERATION_KNOBS, LEFT_OUT, RUNS_FILE, PublishedRun,
                                            fit_flops_only_efficiency, fit_simulator,
                                            flops_only_iteration_s, held_out_errors,
                                            narayanan_row, narayanan_table1_tflops,
                                            published_iteration_s, published_runs,
                                            throughput_error)

from .support import ROOT


def row(i: int) -> Scenario:
    return narayanan_row(ROOT, i)


def replica_time(s: Scenario) -> float:
    return steady_state_s(simulate_iteration_times(s, replica=True))


def tflops_per_gpu(s: Scenario) -> float:
    return predict(s, simulate_iteration_times, replica=True).hardware_tflops_per_gpu


def fitted_rows(device: str, software: str = "") -> list[PublishedRun]:
    return [r for r in published_runs(ROOT)
            if r.fitted and r.device == device and software in ("", r.generation[1])]


@pytest.fixture(scope="module")
def fitted() -> dict[str, float]:
    return fit_simulator(fitted_rows("a100-80gb", "megatron-lm-2021"), replica_time).values


@pytest.mark.slow
@pytest.mark.parametrize("i", [2, 3, 5])
def test_rows_not_fitted_on_are_predicted_within_5_percent(fitted: dict[str, float],
                                                           i: int) -> None:
    predicted = tflops_per_gpu(with_settings(row(i), fitted))
    assert predicted == pytest.approx(narayanan_table1_tflops(ROOT)[i], rel=0.05)


@pytest.mark.slow
def test_strong_scaling_loses_throughput_per_gpu(fitted: dict[str, float]) -> None:
    """Fixed global batch on more replicas: fewer microbatches each, a larger
    pipeline bubble, so TFLOP/s per GPU falls (Narayanan et al. §5.2)."""
    s = row(5)
    batch = s.parallel.dp * s.parallel.microbatches
    series = [tflops_per_gpu(with_settings(s, {**fitted, "parallel.dp": dp,
                                               "parallel.microbatches": batch // dp}))
              for dp in (s.parallel.dp // 2, s.parallel.dp, s.parallel.dp * 2)]
    assert series[0] > series[1] > series[2]


@pytest.mark.slow
def test_the_a100_profile_holds_the_constants_the_fit_finds(fitted: dict[str, float]) -> None:
    profile = DEVICES["a100-80gb"].fits["megatron-lm-2021"].constants
    for key, value in fitted.items():
        assert profile[key.split(".")[-1]] == pytest.approx(value, rel=1e-3)


def test_each_generation_is_fitted_on_rows_of_its_own_source_and_the_rest_are_held_out() -> None:
    runs = published_runs(ROOT)
    assert [r.source for r in fitted_rows("a100-80gb", "megatron-lm-2021")] == [
        "Narayanan et al. 2021, Table 1, row 1", "Narayanan et al. 2021, Table 1, row 7"]
    assert [r.source.rsplit(", ", 1)[1] for r in fitted_rows("h100-sxm", "megatron-core-0.8")] \
        == ["1.7B", "16B", "70B", "177B", "462B"]
    for generation in GENERATION_KNOBS:
        rows = [r for r in runs if r.generation == generation]
        sources = {r.source.split(",")[0] for r in rows if r.fitted}
        assert len(sources) == 1, generation  # one source per generation's fit
        assert any(not r.fitted for r in rows if r.source.split(",")[0] in sources), generation
    assert not any(r.fitted for r in runs if r.generation not in GENERATION_KNOBS)
    assert len({r.source for r in runs}) == len(runs)
    assert all(left.missing for left in LEFT_OUT)


def test_every_row_runs_with_the_constants_of_its_generation_or_its_devices_default() -> None:
    for r in published_runs(ROOT):
        profile = DEVICES[r.device]
        assert r.scenario.cluster.gpu.tflops == profile.gpu["tflops"], r.source
        fit = profile.fit_for(r.generation[1])
        assert fit is not None, r.source
        for key, value in fit.constants.items():
            assert getattr(r.scenario.cluster.gpu, key) == value, (r.source, key)


def test_korthikanti_table5_times_give_the_megatron_readme_mfu_of_the_same_runs() -> None:
    """Two sources for one run: Table 5's iteration times (with the paper's
    model sizes, GPUs and batch) reproduce the MFU the Megatron-LM README (2022)
    lists for the same configurations at data-parallel size one."""
    readme_mfu = {"22B": 0.415, "175B": 0.514, "530B": 0.560, "1T": 0.563}
    rows = {r.source.split(", ")[2]: r for r in published_runs(ROOT)
            if r.source.startswith("Korthikanti") and "selective" in r.source}
    assert sorted(rows) == sorted(readme_mfu)
    for size, r in rows.items():
        s = r.scenario
        peak_flops = r.iteration_s * s.world_size * s.cluster.gpu.tflops * 1e12
        mfu = model_flops_per_iteration(s) / peak_flops
        assert mfu == pytest.approx(readme_mfu[size], abs=0.005), size


def runs_from(source: str) -> list[PublishedRun]:
    return [r for r in published_runs(ROOT) if r.source.startswith(source)]


def test_blooms_published_time_and_throughput_agree_with_its_configuration() -> None:
    """BLOOM's log gives both 104.70 s per iteration and 149.77 TFLOP/s per GPU
    (recomputation counted): the scenario's layers, batch and full recomputation
    turn the one into the other."""
    (bloom,) = runs_from("BigScience")
    assert bloom.iteration_s == pytest.approx(
        published_iteration_s(bloom.scenario, "tflops_per_gpu", 149.77), rel=1e-3)


def test_llama3_rows_hold_table_4s_16m_tokens_per_batch_on_its_gpus() -> None:
    rows = runs_from("Llama 3")
    assert [r.scenario.world_size for r in rows] == [8192, 16384, 16384]
    for r in rows:
        s = r.scenario
        tokens = s.parallel.dp * s.parallel.microbatches * s.model.micro_batch_size * s.model.seq_len
        assert tokens == 16 * 2**20, r.source


def test_the_readme_h100_rows_overlap_their_tp_collectives_as_its_text_says() -> None:
    """The README ran with --tp-comm-overlap: every row with tensor parallelism
    runs its sequence-parallel collectives under the GEMMs (the 1.7B row has none)."""
    for r in runs_from("Megatron-LM README"):
        q = r.scenario.parallel
        assert q.tp_comm_overlap == (q.tp > 1), r.source


def test_llama3_rows_sit_in_its_pods_of_3072_gpus_oversubscribed_1_to_7() -> None:
    """Section 3.3.1's network: in Megatron's rank order (tp, cp, dp, pp) some
    pipeline neighbours sit in different pods, so the oversubscription reaches
    the row's traffic."""
    for r in runs_from("Llama 3"):
        s, q = r.scenario, r.scenario.parallel
        net = s.cluster.network
        assert net.pod_nodes is not None and net.oversubscription == 7, r.source
        pod_gpus = net.pod_nodes * s.cluster.gpus_per_node
        assert pod_gpus == 3072, r.source
        stage_gpus = q.tp * q.cp * q.dp
        pods_of_stages = [stage * stage_gpus // pod_gpus for stage in range(q.pp)]
        assert len(set(pods_of_stages)) > 1, r.source


def test_a_published_throughput_becomes_the_time_its_flops_take() -> None:
    """TFLOP/s with recomputation counted divide the hardware FLOPs, model
    TFLOP/s the model's alone; a published time is kept as it is."""
    s = row(4)
    assert published_iteration_s(s, "tflops_per_gpu", 135) * s.world_size * 135e12 == \
        pytest.approx(hardware_flops_per_iteration(s), rel=1e-12)
    ratio = (published_iteration_s(s, "model_tflops_per_gpu", 135)
             / published_iteration_s(s, "tflops_per_gpu", 135))
    assert ratio == pytest.approx(model_flops_per_iteration(s) / hardware_flops_per_iteration(s))
    assert published_iteration_s(s, "iteration_s", 9.5) == 9.5


def test_a_throughput_error_is_positive_when_the_prediction_is_faster() -> None:
    assert throughput_error(10.0, 8.0) > 0 > throughput_error(10.0, 12.5)
    assert throughput_error(10.0, 10.0) == 0


def _write_runs(root: Path, entry: str) -> None:
    (root / RUNS_FILE).parent.mkdir(parents=True)
    (root / RUNS_FILE).write_text(entry)
    src = ROOT / RUNS_FILE.parent / "narayanan2021" / "row01.yaml"
    (root / RUNS_FILE.parent / "row01.yaml").write_text(src.read_text())


@pytest.mark.parametrize("entry, error", [
    ("- {source: x, scenario: row01.yaml, device: a100-80gb, published: {tflops_per_gpu: 1}, "
     "role: fitted, note: y}\n", ValidationError),
    ("- {source: x, scenario: row01.yaml, device: a100-80gb, published: {tflops: 1}, "
     "role: fitted}\n", ValidationError),
    ("- {source: x, scenario: row01.yaml, device: a100-80gb, "
     "published: {tflops_per_gpu: 1, iteration_s: 2}, role: fitted}\n", ValueError),
    ("- {source: x, scenario: row01.yaml, device: a100, published: {tflops_per_gpu: 1}, "
     "role: fitted}\n", ValueError),
])
def test_a_published_row_with_an_unknown_key_device_or_not_one_figure_is_refused(
        tmp_path: Path, entry: str, error: type[Exception]) -> None:
    _write_runs(tmp_path, entry)
    with pytest.raises(error):
        published_runs(tmp_path)


def test_the_flops_only_peer_does_not_see_the_parallel_layout() -> None:
    """6·N·tokens at one efficiency: the same model and global batch on another
    layout predicts the same iteration time (no bubble, no communication)."""
    s = row(5)
    other = with_settings(s, {"parallel.pp": 1, "parallel.dp": s.parallel.dp * 2,
                              "parallel.microbatches": s.parallel.microbatches // 2})
    assert flops_only_iteration_s(other, 0.4) == pytest.approx(flops_only_iteration_s(s, 0.4),
                                                               rel=1e-12)


def test_the_flops_only_peer_counts_8_flops_per_parameter_with_full_recompute() -> None:
    full = row(1)
    none = with_settings(full, {"training.recompute": "none"})
    ratio = flops_only_iteration_s(full, 0.4) / flops_only_iteration_s(none, 0.4)
    assert ratio == pytest.approx(8 / 6, rel=1e-12)


def test_the_flops_only_efficiency_is_recovered_from_exact_figures() -> None:
    runs = [PublishedRun(f"row {i}", row(i), "iteration_s", flops_only_iteration_s(row(i), 0.37),
                         fitted=True) for i in (1, 4, 7)]
    assert fit_flops_only_efficiency(runs) == pytest.approx(0.37, rel=1e-12)


def test_the_worst_held_out_error_keeps_its_sign() -> None:
    assert held_out_errors([0.02, -0.3, 0.1]) == (pytest.approx(0.14), -0.3)


def test_mtnlg_rows_keep_its_global_batch_of_1920_at_every_micro_batch_tried() -> None:
    from experiments.mtnlg_microbatch import SOURCE, with_micro_batch
    mtnlg = [r for r in published_runs(ROOT) if r.source.startswith(SOURCE)]
    assert sorted(r.scenario.parallel.dp for r in mtnlg) == [8, 10, 12]
    for r in mtnlg:
        for size in (1, 2, 4):
            s = with_micro_batch(r.scenario, size)
            assert s.model.micro_batch_size == size
            assert s.parallel.dp * s.parallel.microbatches * size == 1920
        with pytest.raises(ValueError, match="does not divide"):
            with_micro_batch(r.scenario, 7)


def test_h100_interleaving_tries_only_the_splits_megatron_core_accepts() -> None:
    from experiments.h100_interleaving import SOURCE, valid_vpps, with_vpp
    readme = [r.scenario for r in published_runs(ROOT) if r.source.startswith(SOURCE)]
    assert readme
    for s in readme:
        per_stage = s.model.layers // s.parallel.pp
        splits = valid_vpps(s)
        if s.parallel.pp == 1:
            assert splits == [1]
            continue
        assert splits[0] == 1 and splits[-1] == per_stage and s.parallel.vpp in splits
        assert all(per_stage % v == 0 for v in splits)
        assert len(splits) == sum(per_stage % v == 0 for v in range(1, per_stage + 1))
        assert with_vpp(s, 1).schedule == "1f1b" and with_vpp(s, 1).parallel.vpp == 1
        assert with_vpp(s, splits[-1]).schedule == "interleaved"


def test_h100_interleaving_names_an_unknown_row_in_one_line(capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    from experiments.h100_interleaving import main
    with pytest.raises(SystemExit) as exit_info:
        main(["--only", "70B,999B"])
    assert exit_info.value.code == 2
    assert "no README row 999B" in capsys.readouterr().err
