"""MegaScope during real pipeline-parallel training (spawned gloo ranks,
megatron-core stages): captured tensors equal a manual forward and backward,
capture changes nothing, recomputation does not capture twice, corruption
between stages is exact under 1F1B and MegaDPP's adaptive schedule, a bit flip
at write-back flips one bit, and the checkpoint is the trained model."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from backends.torch.launch import spawn_run
from backends.torch.scope_run import finalize
from backends.torch.stages import TrainOptions
from megatronapp.scenario.checkpoint import read_checkpoint
from megatronapp.scenario.config import Scenario, parse_scenario
from megatronapp.scenario.data import random_tokens
from megatronapp.scope.storage import Capture
from tests.support import full_model, run_cli

pytestmark = pytest.mark.slow
MODEL = {"layers": 2, "hidden": 32, "heads": 4, "seq_len": 8, "vocab": 64, "micro_batch_size": 2}


def scen(parallel: dict[str, int], scope: dict[str, Any] | None, **top: Any) -> Scenario:
    return parse_scenario({"seed": 5, "iterations": 1, "schedule": "1f1b", "data": {"kind": "random"},
                           "parallel": parallel, "model": MODEL, **top,
                           **({"scope": scope} if scope is not None else {})})


def train(s: Scenario, tmp: Path, **options: Any) -> tuple[Any, list[Any], Capture | None]:
    tmp.mkdir(parents=True, exist_ok=True)
    opts = TrainOptions(optimizer="sgd", lr=0.5, capture_first_step=True, workdir=str(tmp),
                        **options)
    run, results = spawn_run(s, opts)
    finalize(s, tmp, run.training.loss_per_iteration)
    return run, results, Capture(tmp / "scope") if (tmp / "scope").is_dir() else None


def raws(capture: Capture) -> dict[tuple[str, int, int], np.ndarray]:
    """(site, layer, microbatch) -> the merged raw tensor of step 0."""
    return {(e["site"], e["layer"], e["microbatch"]): capture.raw(e)
            for e in capture.raw_index() if e["step"] == 0}


# ---------------------------------------------------------------- by hand
def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, eps=1e-5)


def manual(state: dict[str, np.ndarray], tokens: np.ndarray, heads: int) -> dict[str, Any]:
    """GPT forward and backward written out from the weights (float64), in
    megatron's [s, b, ...] layout, the fused QKV split per query group."""
    p = {k: torch.from_numpy(v).double().requires_grad_(False) for k, v in state.items()}
    ids = torch.from_numpy(tokens[:, :-1]).T  # [s, b]
    labels = torch.from_numpy(tokens[:, 1:]).T
    s, b = ids.shape
    out: dict[str, Any] = {}
    x = p["embedding.word_embeddings.weight"][ids] + p["embedding.position_embeddings.weight"][
        torch.arange(s)][:, None]
    keep: list[tuple[str, torch.Tensor]] = []
    for i in range(len([k for k in p if k.endswith("input_layernorm.weight")])):
        L, pre = i + 1, f"decoder.layers.{i}."
        x = x.detach().requires_grad_() if i == 0 else x
        out[("resid_pre", L)] = x
        h = layer_norm(x, p[pre + "input_layernorm.weight"], p[pre + "input_layernorm.bias"])
        qkv = h @ p[pre + "self_attention.linear_qkv.weight"].T + p[pre + "self_attention.linear_qkv.bias"]
        hn = qkv.shape[-1] // (3 * heads)
        q, k, v = qkv.view(s, b, heads, 3 * hn).split(hn, dim=-1)  # per query group: [q k v]
        out[("attn.q", L)], out[("attn.k", L)], out[("attn.v", L)] = q, k, v
        scores = torch.einsum("sbnd,tbnd->bnst", q, k) / hn ** 0.5
        scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), -1e30)
        probs = torch.softmax(scores, dim=-1)
        out[("attn.probs", L)] = probs
        ctx = torch.einsum("bnst,tbnd->sbnd", probs, v).reshape(s, b, -1)
        attn = ctx @ p[pre + "self_attention.linear_proj.weight"].T + p[pre + "self_attention.linear_proj.bias"]
        out[("attn.out", L)] = attn
        mid = x + attn
        out[("resid_mid", L)] = mid
        h2 = layer_norm(mid, p[pre + "pre_mlp_layernorm.weight"], p[pre + "pre_mlp_layernorm.bias"])
        pre_act = h2 @ p[pre + "mlp.linear_fc1.weight"].T + p[pre + "mlp.linear_fc1.bias"]
        pre_act.retain_grad()
        keep.append((f"mlp.pre{L}", pre_act))
        post = torch.nn.functional.gelu(pre_act)
        mlp = post @ p[pre + "mlp.linear_fc2.weight"].T + p[pre + "mlp.linear_fc2.bias"]
        out[("mlp.pre", L)], out[("mlp.post", L)], out[("mlp.out", L)] = pre_act, post, mlp
        x = mid + mlp
        out[("resid_post", L)] = x
    final = layer_norm(x, p["decoder.final_layernorm.weight"], p["decoder.final_layernorm.bias"])
    logits = final @ p["output_layer.weight"].T
    out[("logits", len(keep) + 1)] = logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             labels.reshape(-1))
    loss.backward()
    out[("grad:resid_pre", 1)] = out[("resid_pre", 1)].grad
    for name, t in keep:
        out[("grad:mlp.pre", int(name[-1]))] = t.grad
    return {k: v.detach() for k, v in out.items()}


def as_captured(site: str, t: torch.Tensor, heads: list[int] | None) -> np.ndarray:
    """The manual tensor in the capture's layout."""
    if site.endswith("attn.probs"):
        return t.numpy()  # [b, n, q, k]
    if site.split(":")[-1] in ("attn.q", "attn.k", "attn.v"):
        return t.permute(1, 2, 0, 3)[:, heads].numpy()  # [b, n', s, d]
    return t.transpose(0, 1).numpy()  # [b, s, C]


FORWARD_SITES = ["resid_pre", "attn.q", "attn.k", "attn.v", "attn.probs", "attn.out",
                 "resid_mid", "mlp.pre", "mlp.post", "mlp.out", "resid_post", "logits"]


@pytest.mark.parametrize("pp, tp", [(1, 1), (2, 2)])
def test_every_site_equals_a_manual_forward_and_backward(pp: int, tp: int, tmp_path: Path) -> None:
    observe = [{"site": site, "stats": ["mean"], "keep_raw": True,
                **({"heads": [1, 2]} if site in ("attn.q", "attn.k") else {})}
               for site in FORWARD_SITES]
    observe += [{"site": "mlp.pre", "stats": ["std", "topk(2)"]},
                {"site": "grad:mlp.pre", "stats": ["l2"], "keep_raw": True},
                {"site": "grad:resid_pre", "layers": [1], "stats": ["l2"], "keep_raw": True}]
    s = scen({"pp": pp, "tp": tp}, {"observe": observe})
    _, results, capture = train(s, tmp_path)
    state = full_model(results, s, "before")
    tokens = random_tokens(s.seed, 0, 0, MODEL["micro_batch_size"], MODEL["seq_len"] + 1,
                           MODEL["vocab"])
    want = manual(state, tokens, MODEL["heads"])
    got = {(e["site"], e["layer"]): (capture.raw(e), e) for e in capture.raw_index()}
    assert set(got) == set(want)
    for (site, layer), (array, entry) in got.items():
        expect = as_captured(site, want[(site, layer)], entry["heads"])
        assert array.shape == expect.shape, (site, layer)
        np.testing.assert_allclose(array, expect, rtol=1e-4, atol=2e-5, err_msg=f"{site}@{layer}")
    stats = capture.stats()
    rows = [r for r in stats.to_pylist() if r["site"] == "mlp.pre" and r["stat"] == "std"
            and r["layer"] == 2]
    pre = want[("mlp.pre", 2)].numpy()  # [s, b, ffn], split over TP ranks
    for r in rows:  # the TP slices' moments merged into the whole row's
        assert r["value"] == pytest.approx(pre[r["token"], r["sample"]].std(), rel=1e-5)
    (top,) = [r for r in stats.to_pylist() if r["site"] == "mlp.pre" and r["stat"] == "topk(2)"
              and r["layer"] == 2 and r["token"] == 3 and r["sample"] == 1]
    row = pre[3, 1]  # the two largest |x| of the whole row, across both TP slices
    assert sorted(top["index"]) == sorted(np.argsort(-np.abs(row))[:2].tolist())
    np.testing.assert_allclose(top["values"], row[top["index"]], rtol=1e-5)


def test_capture_changes_nothing_and_recomputation_captures_once(tmp_path: Path) -> None:
    observe = [{"site": "resid_pre", "stats": ["mean", "std"], "keep_raw": True},
               {"site": "attn.probs", "stats": ["entropy"]},
               {"site": "grad:mlp.post", "stats": ["l2", "absmax"]},
               {"site": "grad:params", "stats": ["l2"]}]
    parallel = {"pp": 2, "microbatches": 2}
    two = {"iterations": 2}
    plain, plain_results, _ = train(scen(parallel, None, **two), tmp_path / "off")
    seen, seen_results, cap = train(scen(parallel, {"observe": observe}, **two), tmp_path / "on")
    assert plain.training.loss_per_iteration == seen.training.loss_per_iteration
    s = scen(parallel, None)
    after_off, after_on = (full_model(r, s, "after") for r in (plain_results, seen_results))
    for name, value in after_off.items():
        assert np.array_equal(value, after_on[name]), name
    again, _, recap = train(scen(parallel, {"observe": observe}, training={"recompute": True},
                                 **two), tmp_path / "recompute")
    t1, t2 = cap.stats(), recap.stats()
    key = ["step", "dp", "microbatch", "sample", "layer", "site", "head", "token", "stat", "index"]
    k2 = [tuple(r[k] for k in key) for r in t2.to_pylist()]
    assert len(k2) == len(set(k2)) == t1.num_rows  # every row once, none twice
    np.testing.assert_allclose(t2.column("value").to_numpy(), t1.column("value").to_numpy(),
                               rtol=1e-5, atol=1e-7)
    assert recap.manifest["raw_tensors"] == cap.manifest["raw_tensors"]
    recomputed = [c["recomputed_hooks"] for c in recap.manifest["ranks"].values()]
    assert all(n > 0 for n in recomputed)  # the forward really ran again, inside backward
    assert all(c["recomputed_hooks"] == 0 for c in cap.manifest["ranks"].values())


P2P = [{"kind": "p2p_offset", "direction": "backward", "microbatch": 0, "value": -0.5},
       {"kind": "p2p_offset", "direction": "forward", "microbatch": 1, "value": 0.25},
       {"kind": "p2p_bitflip", "direction": "forward", "microbatch": 2, "bit": 30, "count": 2}]
BOUNDARY = [{"site": "resid_post", "layers": [1], "stats": ["mean"], "keep_raw": True},
            {"site": "resid_pre", "layers": [2], "stats": ["mean"], "keep_raw": True},
            {"site": "grad:resid_post", "layers": [1], "stats": ["l2"], "keep_raw": True},
            {"site": "grad:resid_pre", "layers": [2], "stats": ["l2"], "keep_raw": True}]


def test_corruption_between_stages_is_exact_under_1f1b_and_adaptive(tmp_path: Path) -> None:
    parallel = {"pp": 2, "microbatches": 3}
    _, _, clean = train(scen(parallel, {"observe": BOUNDARY}), tmp_path / "clean")
    c = raws(clean)
    for schedule in ("1f1b", "adaptive"):
        _, _, cap = train(scen(parallel, {"observe": BOUNDARY, "perturb": P2P},
                               schedule=schedule), tmp_path / schedule)
        g = raws(cap)
        for mb in range(3):  # nothing upstream of a corruption changes
            np.testing.assert_array_equal(g[("resid_post", 1, mb)], c[("resid_post", 1, mb)])
        np.testing.assert_array_equal(g[("resid_pre", 2, 0)], c[("resid_pre", 2, 0)])
        np.testing.assert_array_equal(g[("resid_pre", 2, 1)],
                                      c[("resid_pre", 2, 1)] + np.float32(0.25))
        diff = g[("resid_pre", 2, 2)].view(np.int32) ^ c[("resid_pre", 2, 2)].view(np.int32)
        assert np.count_nonzero(diff) == 2 and set(diff[diff != 0].tolist()) == {1 << 30}
        np.testing.assert_array_equal(g[("grad:resid_pre", 2, 0)], c[("grad:resid_pre", 2, 0)])
        np.testing.assert_array_equal(g[("grad:resid_post", 1, 0)],
                                      c[("grad:resid_post", 1, 0)] + np.float32(-0.5))
        inj = cap.injections()
        assert sorted((i["kind"], i["microbatch"], i["stage"], i["direction"]) for i in inj) == [
            ("p2p_bitflip", 2, 1, "forward"), ("p2p_offset", 0, 0, "backward"),
            ("p2p_offset", 1, 1, "forward")]
        (flip,) = [i for i in inj if i["kind"] == "p2p_bitflip"]
        assert [e["bit"] for e in flip["elements"]] == [30, 30]


def test_bitflip_at_write_back_and_the_checkpoint_across_splits(tmp_path: Path) -> None:
    parallel = {"pp": 2, "tp": 2}
    clean_s = scen(parallel, None, training={"checkpoint": True})
    _, clean, _ = train(clean_s, tmp_path / "clean")
    ckpt = read_checkpoint(tmp_path / "clean" / "checkpoint")
    after = full_model(clean, clean_s, "after")
    assert ckpt.state.keys() == after.keys()
    for name, value in after.items():  # the saved model is the trained one, unsplit
        assert np.array_equal(ckpt.state[name], value), name
    name, index = "decoder.layers.1.mlp.linear_fc1.weight", 100 * 32 + 7  # row 100: TP rank 1
    flip = {"kind": "param_bitflip", "target": "mlp.linear_fc1.weight", "layers": [2],
            "bit": 22, "index": index}
    s = scen(parallel, {"perturb": [flip]})
    _, flipped, cap = train(s, tmp_path / "flip")
    before_clean = full_model(clean, clean_s, "before")
    before = full_model(flipped, s, "before")
    for n, value in before.items():
        diff = value.view(np.int32) ^ before_clean[n].view(np.int32)
        if n == name:
            assert np.count_nonzero(diff) == 1 and diff.reshape(-1)[index] == 1 << 22
        else:
            assert not diff.any(), n
    (inj,) = cap.injections()
    assert inj["param"] == name and inj["elements"][0]["index"] == index


def test_megatronapp_run_writes_the_capture_and_traces_its_handoffs(tmp_path: Path) -> None:
    import yaml

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({
        "seed": 1, "iterations": 2, "parallel": {"pp": 2, "microbatches": 2},
        "model": {**MODEL, "vocab": 40}, "training": {"checkpoint": True},
        "scope": {"observe": [{"site": "attn.probs", "stats": ["prev_token_mass"],
                               "every_n_steps": 2}]}}))
    out = tmp_path / "run"
    res = run_cli("run", str(path), "--backend", "torch", "--out", str(out), "--quiet")
    assert res.returncode == 0, res.stderr
    assert "scope:" in res.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["scope"]["rows"] > 0 and summary["scope"]["dropped_records"] == 0
    trace = json.loads((out / "trace.json").read_text())["traceEvents"]
    handoffs = [e for e in trace if e.get("name") == "scope_capture"]
    assert {e["args"]["iteration"] for e in handoffs} == {0}  # every 2 steps: step 0 only
    assert {e["pid"] for e in handoffs} == {0, 1}
    assert run_cli("scope", "summary", str(out)).returncode == 0
    gen = run_cli("scope", "generate", str(out), "--prompt", "def", "--tokens", "2",
                  "--out", str(tmp_path / "gen"))
    assert gen.returncode == 0, gen.stderr


@pytest.mark.gpu
def test_gpu_capture_never_synchronises_the_training_stream(tmp_path: Path) -> None:
    """On CUDA, hooks reduce on the device and hand off behind an event:
    ``set_sync_debug_mode("error")`` turns any host sync into an exception."""
    from backends.torch.scope import RankPlace, session_for
    from backends.torch.scope_generate import build_model, initial_state, one_rank
    from backends.torch.megatron_compat import causal_mask
    from backends.torch.stages import partition_dim_of
    from megatronapp.scope.cost import model_shape
    from megatronapp.scope.storage import merge_capture

    s = scen({}, {"observe": [{"site": site, "stats": ["mean", "std", "topk(2)", "hist",
                                                        "pixels_absmax(8)"], "keep_raw": True}
                              for site in ("resid_pre", "mlp.pre", "resid_post")]
                  + [{"site": "attn.probs", "stats": ["entropy", "prev_token_mass"]}]})
    with one_rank():
        model = build_model(s, initial_state(s)).cuda()
        session = session_for(s.scope, model_shape(s), 0, RankPlace(0, 1, 0, 0, torch.device(
            "cuda")), tmp_path)
        session.attach(model, list(model.named_parameters()), partition_dim_of)
        ids = torch.randint(0, 64, (2, 8), device="cuda")
        pos, mask = torch.arange(8, device="cuda")[None], causal_mask(8, "cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step in range(3):
                with session.task("forward", step, 0):
                    model(ids, pos, mask)
                session.capture_handoff()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        session.close()
    manifest = merge_capture(tmp_path, {})
    assert manifest["rows"] > 0 and manifest["raw_tensors"] == 9
