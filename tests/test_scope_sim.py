"""The simulator prices capture from the same scope: section: scope_capture
events sit where the captures happen, cost what the model says, and the
summary reports the predicted overhead."""
from __future__ import annotations

from typing import Any

import pytest

from megatronapp.scenario.config import parse_scenario
from megatronapp.trace.sections import ScopeOverhead
from sim import simulate as run_scenario

MODEL = {"layers": 4, "hidden": 256, "heads": 8, "seq_len": 128, "vocab": 1000}
FIXED = {"forward_s": 0.01, "backward_s": 0.02, "p2p_s": 0.0, "allreduce_s": 0.0,
         "optimizer_s": 0.0}


def run(scope: dict[str, Any], parallel: dict[str, int] | None = None, iterations: int = 1) -> Any:
    s = parse_scenario({"iterations": iterations, "parallel": parallel or {"microbatches": 2},
                        "model": MODEL, "costs": FIXED, "scope": scope})
    return run_scenario(s)


def overhead(result: Any) -> float:
    """The simulator's predicted capture overhead of a run that observes."""
    assert isinstance(result.scope, ScopeOverhead)
    return result.scope.predicted_capture_overhead


def captures(result: Any) -> list[tuple[int, Any]]:
    return [(rank, e) for rank, evs in result.events.items() for e in evs
            if e.name == "scope_capture"]


def test_a_capture_costs_exactly_its_hook_time_when_nothing_else_costs() -> None:
    cost = {"hook_us": 1000.0, "reduce_gbps": 1e12, "d2h_gbps": 1e12, "host_us_per_row": 0.0}
    result = run({"observe": [{"site": "resid_pre", "layers": [1, 3], "stats": ["mean"]}],
                  "cost": cost})
    got = captures(result)
    assert len(got) == 2  # one per forward task (2 microbatches), both layers in one op
    assert all(e.dur_s == pytest.approx(2e-3, rel=1e-6) for _, e in got)  # two hooks each
    scope = result.scope
    assert isinstance(scope, ScopeOverhead)
    base = 2 * (0.01 + 0.02)  # pp = 1: microbatches x (forward + backward)
    assert scope.iteration_s_without_capture == pytest.approx(base)
    assert scope.predicted_capture_overhead == pytest.approx(4e-3 / base, rel=1e-6)


def test_captures_sit_on_the_stages_tp_ranks_and_steps_that_capture() -> None:
    result = run({"observe": [
        {"site": "resid_post", "layers": [4], "every_n_steps": 2, "stats": ["std"]},
        {"site": "grad:mlp.pre", "layers": [1], "every_n_steps": 2, "stats": ["l2"]}]},
        parallel={"pp": 2, "tp": 2, "microbatches": 2}, iterations=3)
    where = {(rank, e.args["iteration"]) for rank, e in captures(result)}
    # ranks: tp fastest, then pp: stage 0 = ranks 0, 1; stage 1 = ranks 2, 3
    assert {r for r, _ in where} == {0, 1, 2}  # resid_post (replicated): tp rank 0 only
    assert {it for _, it in where} == {0, 2}
    forward = {r for r, e in captures(result) if e.args.get("microbatch") is not None
               and r >= 2}
    assert forward == {2}


@pytest.mark.parametrize("more, cost", [
    ({"stats": ["mean", "std", "hist", "topk(8)"]}, {}),
    ({"layers": [1, 2, 3, 4]}, {}),
    ({"keep_raw": True}, {}),  # copies hide behind the compute ...
    ({"keep_raw": True}, {"d2h_gbps": 0.001})])  # ... until the copy link saturates
def test_observing_more_never_costs_less(more: dict[str, Any], cost: dict[str, float]) -> None:
    base = {"site": "attn.probs", "layers": [2], "stats": ["entropy"]}
    low, high = (overhead(run({"observe": observe, "cost": cost}))
                 for observe in ([base], [{**base, **more}]))
    assert high >= low > 0
    if more != {"keep_raw": True} or cost:
        assert high > low


def test_a_scope_without_observations_costs_nothing() -> None:
    result = run({"perturb": [{"kind": "act_noise", "site": "resid_post", "sigma": 0.1}]})
    assert not captures(result) and result.scope is None


def test_the_prediction_reuses_a_noiseless_run_and_never_a_jittered_one() -> None:
    from sim import run_sim
    from megatronapp.scope.cost import predicted_overhead

    observe = {"observe": [{"site": "resid_post", "stats": ["mean", "hist"]}],
               "cost": {"hook_us": 500.0}}
    plain = parse_scenario({"iterations": 2, "parallel": {"pp": 2, "microbatches": 2},
                            "model": MODEL, "costs": FIXED, "scope": observe})
    fresh = predicted_overhead(plain, run_sim)
    assert predicted_overhead(plain, run_sim, run_sim(plain)) == fresh
    noisy = plain.model_copy(update={"cluster": plain.cluster.model_copy(update={
        "jitter": plain.cluster.jitter.model_copy(update={"compute_sigma": 0.5})})})
    jittered = run_sim(noisy)  # its iterations differ from the noiseless ones ...
    assert jittered.events != run_sim(plain).events
    assert predicted_overhead(noisy, run_sim, jittered) == fresh  # ... and are not used
