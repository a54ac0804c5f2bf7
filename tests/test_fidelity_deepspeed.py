"""parallel.pipeline_engine: deepspeed, DeepSpeed's PipelineEngine as
Megatron-DeepSpeed ran it (costs/deepspeed_pipe.py): its TrainSchedule, its
blocking sends, its per-microbatch gradient accumulation pass and its
gradient all-reduce (bf16 and fp16 ZeRO 1 alike)."""
from __future__ import annotations

from typing import Any

import pytest
import yaml
from hypothesis import given, settings, strategies as st

from megatronapp.costs.deepspeed_pipe import train_schedule_order
from megatronapp.costs.memory import stage_params
from megatronapp.parallel.ops import AllGather, AllReduce, ISend, ReduceScatter, Send
from megatronapp.parallel.schedules import PipeShape, one_f_one_b_order
from megatronapp.program.compiled import record
from megatronapp.program.ranks import static_compute_ops, static_programs
from megatronapp.scenario.config import ScenarioError, parse_scenario
from megatronapp.fidelity.published import published_runs
from sim import simulate_iteration_times

from .support import ROOT, fixed_cost_scenario, run_cli

PP, MICROBATCHES = 3, 5


def scenario(engine: str, precision: str = "bf16", **parallel: Any) -> Any:
    return parse_scenario({
        "schedule": "1f1b",
        "parallel": {"tp": 2, "pp": PP, "dp": 2, "microbatches": MICROBATCHES,
                     "pipeline_engine": engine, **parallel},
        "model": {"layers": 6, "hidden": 512, "heads": 8, "seq_len": 256, "vocab": 4096},
        "training": {"precision": precision, "distributed_optimizer": True},
    })


@settings(max_examples=60, deadline=None)
@given(pp=st.integers(1, 40), microbatches=st.integers(1, 300), data=st.data())
def test_deepspeeds_train_schedule_runs_megatrons_1f1b_order_task_for_task(
        pp: int, microbatches: int, data: st.DataObject) -> None:
    """TrainSchedule's 2·(m + p − 1) lock-step steps, idle ones left out, are
    the non-interleaved 1F1B order on every stage."""
    shape = PipeShape(pp, 1, microbatches)
    rank = data.draw(st.integers(0, pp - 1))
    assert train_schedule_order(rank, shape) == one_f_one_b_order(rank, shape)


# bytes per parameter: bf16's cast and add 2 + 4 + 4 + 4 + 4, AccumulateGrad's in-place
# add 3 × the gradient's bytes
@pytest.mark.parametrize("precision, per_param, first", [("bf16", 18, 0), ("fp16", 6, 1),
                                                         ("fp32", 12, 1)])
def test_each_backward_folds_its_gradients_in_by_a_pass_over_the_stages_parameters(
        precision: str, per_param: int, first: int) -> None:
    """Per stage, the backward compute grows by the accumulation pass: bytes per
    parameter × the stage's parameters ÷ HBM bandwidth, on every microbatch
    (bf16's fp32 copy) or from the second on (AccumulateGrad keeps the first)."""
    ds, mg = scenario("deepspeed", precision), scenario("megatron", precision)
    hbm = ds.cluster.gpu.hbm_tbps * 1e12
    ranks = [4 * pp_rank for pp_rank in range(PP)]  # tp 0, dp 0 of each stage (tp, dp 2)
    ds_ops, mg_ops = static_compute_ops(ds, ranks), static_compute_ops(mg, ranks)
    for rank in ranks:
        pp_rank = rank // 4
        extra = (sum(op.cost_s for op in ds_ops[rank] if op.name == "backward")
                 - sum(op.cost_s for op in mg_ops[rank] if op.name == "backward"))
        per_pass = per_param * stage_params(ds, pp_rank) / hbm
        assert extra == pytest.approx((MICROBATCHES - first) * per_pass, rel=1e-9)


def test_deepspeeds_sends_block_and_megatrons_do_not() -> None:
    for engine, kind in (("deepspeed", Send), ("megatron", ISend)):
        ops = record(static_programs(scenario(engine))[0])
        sends = [op for op in ops if isinstance(op, ISend)]
        assert len(sends) == MICROBATCHES and all(type(op) is kind for op in sends), engine


def test_a_blocking_send_delays_the_senders_next_task_by_its_transfer() -> None:
    """pp 2, two microbatches, forward 1, backward 2, each message c: Megatron's
    1F1B takes 9 + 2c; DeepSpeed's last stage waits c more on the first
    gradient it sends before its second forward: 9 + 3c."""
    c = 0.25
    times = {engine: simulate_iteration_times(fixed_cost_scenario(
        parallel={"pp": 2, "microbatches": 2, "pipeline_engine": engine},
        costs={"forward_s": 1.0, "backward_s": 2.0, "p2p_s": c, "allreduce_s": 0.0,
               "optimizer_s": 0.0}))[0] for engine in ("megatron", "deepspeed")}
    assert times == {"megatron": pytest.approx(9 + 2 * c), "deepspeed": pytest.approx(9 + 3 * c)}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_bf16_and_fp16_zero1_all_reduce_the_whole_gradient_then_gather_the_weights(
        precision: str) -> None:
    """bf16's ZeRO 0 and fp16's ZeRO 1 (contiguous_gradients forced off, so
    buffered_reduce_fallback) all-reduce the stage's whole gradient; each rank
    steps its partition and all-gathers the weights. Megatron's distributed
    optimizer reduce-scatters."""
    s = scenario("deepspeed", precision)
    weights = stage_params(s, 0) * 2  # 16-bit weights of stage 0
    grads = weights * (2 if precision == "bf16" else 1)  # Megatron's rule: bf16 reduced in fp32
    ops = record(static_programs(s)[0])
    dp = [(type(o), o.nbytes) for o in ops if getattr(o, "name", "").startswith("dp_")]
    assert dp == [(AllReduce, grads), (AllGather, weights)]
    megatron = record(static_programs(scenario("megatron", precision))[0])
    assert [type(o) for o in megatron
            if getattr(o, "name", "").startswith("dp_")] == [ReduceScatter, AllGather]


@pytest.mark.parametrize("change, reason", [
    ({"schedule": "interleaved", "parallel": {"vpp": 2}}, "1f1b with vpp 1"),
    ({"schedule": "gpipe"}, "1f1b with vpp 1"),
    ({"training": {"overlap_grad_reduce": True}}, "after the pipeline flush"),
])
def test_what_deepspeeds_engine_cannot_run_is_refused_naming_the_option(
        change: dict[str, Any], reason: str) -> None:
    data: dict[str, Any] = {"schedule": "1f1b", "parallel": {"pp": 2, "microbatches": 4,
                                                             "pipeline_engine": "deepspeed"}}
    for key, value in change.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    with pytest.raises(ScenarioError) as err:
        parse_scenario(data)
    assert err.value.field == "parallel.pipeline_engine" and reason in err.value.reason


def test_an_unknown_engine_exits_2_with_one_line_naming_the_option(tmp_path: Any) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text(yaml.safe_dump({"parallel": {"pp": 2, "pipeline_engine": "fairscale"}}))
    proc = run_cli("predict", str(path))
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1 and "parallel.pipeline_engine" in proc.stderr


def test_the_rows_trained_with_megatron_deepspeed_and_only_they_use_its_engine() -> None:
    for r in published_runs(ROOT):
        megatron_deepspeed = r.source.startswith(("Smith et al. 2022", "BigScience 2022"))
        assert (r.scenario.parallel.pipeline_engine == "deepspeed") == megatron_deepspeed, r.source
