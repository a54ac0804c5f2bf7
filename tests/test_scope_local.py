"""MegaScope on one megatron-core GPTModel in this process (a one-rank gloo
group): the model's parameters are the ones the schema knows, each activation
and parameter perturbation changes exactly what it says, capture leaves the
outputs alone, and generation records what it should."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.torch.scope import RankPlace, session_for
from backends.torch.scope_generate import (build_model, generate, initial_state,
                                          local_scenario, one_rank)
from backends.torch.scope_perturb import (BITS_AS, HeldParam, P2PInjector, ParamInjector,
                                          flip_bits, generator_for)
from backends.torch.stages import partition_dim_of
from backends.torch.megatron_compat import causal_mask
from megatronapp.scenario.checkpoint import read_checkpoint, write_checkpoint
from megatronapp.scenario.config import Data, Scenario, parse_scenario
from megatronapp.errors import UserError
from megatronapp.scope.cost import model_shape
from megatronapp.scope.generate import PcaBasis
from megatronapp.scope.storage import Capture
from megatronapp.scenario.scope_spec import Scope, parameter_shapes
from tests.support import run_cli

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
MODEL = {"layers": 2, "hidden": 32, "heads": 4, "seq_len": 12, "vocab": 40}
SEQ = 10


@pytest.fixture(scope="module")
def rank() -> Iterator[None]:
    with one_rank():
        yield


def scen(scope: dict[str, Any] | None = None, seed: int = 4) -> Scenario:
    return parse_scenario({"seed": seed, "model": MODEL, "data": {"kind": "random"},
                           **({"scope": scope} if scope is not None else {})})


def random_state(s: Scenario) -> dict[str, np.ndarray]:
    return initial_state(s)


def run_model(s: Scenario, state: dict[str, np.ndarray], step: int = 0,
              root: Path | None = None) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
    """Logits of one forward, and the raw captures by "site@layer"."""
    model = build_model(s, state)
    session = session_for(s.scope or Scope(), model_shape(s), s.seed,
                          RankPlace(0, 1, 0, 0, torch.device("cpu")), root, live=False)
    session.attach(model, list(model.named_parameters()), partition_dim_of)
    session.start()
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, s.model.vocab, (1, SEQ)))
    with torch.no_grad(), session.task("forward", step, 0):
        logits = model(ids, torch.arange(SEQ)[None], causal_mask(SEQ))
    session.capture_handoff()
    raws = {f"{r.key.site}@{r.key.layer}": r.array for r in session.sink.last_raw}
    session.close()
    return logits, raws


def observe(*sites_layers: tuple[str, int]) -> list[dict[str, Any]]:
    return [{"site": site, "layers": [layer], "stats": ["mean"], "keep_raw": True}
            for site, layer in sites_layers]


# ------------------------------------------------------------------ model
def test_the_schema_knows_the_models_parameters(rank: None) -> None:
    s = scen()
    model = build_model(s, random_state(s))
    real = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert real == parameter_shapes(model_shape(s))


def test_capture_leaves_the_outputs_bitwise_alone(rank: None) -> None:
    s_off = scen()
    state = random_state(s_off)
    every = [{"site": site, "stats": ["mean", "std", "topk(2)", "hist"], "keep_raw": True}
             for site in ("resid_pre", "attn.q", "attn.k", "attn.v", "attn.out", "resid_mid",
                          "mlp.pre", "mlp.post", "mlp.out", "resid_post", "logits")]
    every.append({"site": "attn.probs", "stats": ["entropy", "sink_mass"], "keep_raw": True})
    plain, _ = run_model(s_off, state)
    watched, raws = run_model(scen({"observe": every}), state)
    assert torch.equal(plain, watched)
    assert len(raws) == 12 * 2 - 1  # logits once, after the last layer


# ------------------------------------------------------------ activations
def clean_and_perturbed(watch: list[dict[str, Any]], perturb: dict[str, Any]) -> tuple[
        dict[str, np.ndarray], dict[str, np.ndarray], Scenario, dict[str, np.ndarray]]:
    """Raw captures of one forward without and with ``perturb`` (same weights)."""
    s_clean = scen({"observe": watch})
    state = random_state(s_clean)
    _, clean = run_model(s_clean, state)
    pert = scen({"observe": watch, "perturb": [perturb]})
    _, got = run_model(pert, state)
    return clean, got, pert, state


def test_offset_changes_its_site_by_exactly_the_offset_and_nothing_upstream(rank: None) -> None:
    clean, got, pert, state = clean_and_perturbed(
        observe(("resid_pre", 1), ("resid_post", 1), ("resid_pre", 2)),
        {"kind": "act_offset", "site": "resid_post", "layers": [1], "value": 0.375})
    np.testing.assert_array_equal(got["resid_pre@1"], clean["resid_pre@1"])
    np.testing.assert_array_equal(got["resid_post@1"], clean["resid_post@1"] + np.float32(0.375))
    np.testing.assert_array_equal(got["resid_pre@2"], got["resid_post@1"])  # what flows on
    _, later = run_model(pert.model_copy(update={"scope": pert.scope.model_copy(update={
        "perturb": (pert.scope.perturb[0].model_copy(update={"step": 3}),)})}), state, step=2)
    np.testing.assert_array_equal(later["resid_post@1"], clean["resid_post@1"])  # not its step


def test_mask_zeroes_exactly_its_channels(rank: None) -> None:
    clean, got, _, _ = clean_and_perturbed(observe(("mlp.pre", 2)), {
        "kind": "act_mask", "site": "mlp.pre", "layers": [2], "channels": [0, 5, 127]})
    want = clean["mlp.pre@2"].copy()
    want[..., [0, 5, 127]] = 0
    np.testing.assert_array_equal(got["mlp.pre@2"], want)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_quantize_rounds_to_its_grid_and_no_further(rank: None, fmt: str) -> None:
    clean, got, _, _ = clean_and_perturbed(observe(("attn.out", 1)), {
        "kind": "quantize", "site": "attn.out", "layers": [1], "format": fmt})
    x, q = clean["attn.out@1"], got["attn.out@1"]
    assert not np.array_equal(x, q)
    if fmt == "int8":
        scale = np.abs(x).max() / 127
        k = q / scale
        np.testing.assert_allclose(k, np.round(k), atol=1e-3)
        assert np.abs(k).max() <= 127 + 1e-3
        assert np.abs(q - x).max() <= scale / 2 * (1 + 1e-5)
    else:
        dtype = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[fmt]
        tq = torch.from_numpy(q)
        assert torch.equal(tq.to(dtype).to(torch.float32), tq)  # on the grid
        mantissa, min_normal = {"fp8_e4m3": (3, -6), "fp8_e5m2": (2, -14)}[fmt]
        # round to nearest: half a unit in the last place, subnormals included
        bound = np.maximum(np.abs(x) * 2.0 ** -(mantissa + 1), 2.0 ** (min_normal - mantissa - 1))
        assert (np.abs(q - x) <= bound * (1 + 1e-6)).all()


def test_noise_is_the_seeded_draw_scaled_by_the_tensors_rms(rank: None) -> None:
    clean, got, s, _ = clean_and_perturbed(observe(("mlp.out", 2), ("resid_pre", 2)), {
        "kind": "act_noise", "site": "mlp.out", "layers": [2], "sigma": 0.25})
    np.testing.assert_array_equal(got["resid_pre@2"], clean["resid_pre@2"])
    x = torch.from_numpy(clean["mlp.out@2"]).transpose(0, 1)  # back to [s, b, h]
    g = generator_for(torch.device("cpu"), s.seed, 23, 0, 0, 0, 2, 0, 0)
    want = x + torch.randn(x.shape, generator=g) * (0.25 * x.pow(2).mean().sqrt())
    np.testing.assert_array_equal(got["mlp.out@2"], want.transpose(0, 1).numpy())


def test_head_mask_removes_exactly_those_heads_contribution(rank: None) -> None:
    watch = observe(("attn.probs", 1), ("attn.v", 1), ("attn.out", 1))
    s = scen({"observe": watch, "perturb": [{"kind": "head_mask", "layers": [1], "heads": [2]}]})
    state = random_state(s)
    _, got = run_model(s, state)
    probs, v = got["attn.probs@1"][0], got["attn.v@1"][0]  # (heads, q, k), (heads, s, d)
    ctx = np.einsum("hqk,hkd->qhd", probs, v)
    ctx[:, 2] = 0
    w = state["decoder.layers.0.self_attention.linear_proj.weight"]
    b = state["decoder.layers.0.self_attention.linear_proj.bias"]
    want = ctx.reshape(SEQ, -1) @ w.T + b
    np.testing.assert_allclose(got["attn.out@1"][0], want, rtol=1e-5, atol=1e-6)
    _, clean = run_model(scen({"observe": watch}), state)
    assert not np.allclose(clean["attn.out@1"][0], want, atol=1e-4)


# ------------------------------------------------------------- parameters
@settings(max_examples=50, deadline=None)
@given(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), st.integers(0, 63),
       st.integers(0, 15), st.data())
def test_a_bit_flip_changes_exactly_one_bit_of_one_element(dtype: torch.dtype, index: int,
                                                           bit: int, data: Any) -> None:
    width = torch.finfo(dtype).bits
    bit = data.draw(st.integers(0, width - 1))
    x = torch.randn(64, generator=torch.Generator().manual_seed(index)).to(dtype)
    before = x.view(BITS_AS[dtype]).clone()
    (flip,) = flip_bits(x, [index], bit)
    diff = (x.view(BITS_AS[dtype]) ^ before).to(torch.int64) & ((1 << width) - 1)
    assert diff[index] == 1 << bit and int((diff != 0).sum()) == 1
    assert flip["bit"] == bit and flip["before_bits"] != flip["after_bits"]


def held(model_params: dict[str, torch.Tensor]) -> dict[str, HeldParam]:
    return {n: HeldParam(torch.nn.Parameter(p.clone()), None, 1, 0) for n, p in model_params.items()}


def injector(perturb: list[dict[str, Any]], params: dict[str, HeldParam],
             records: list[dict[str, Any]]) -> ParamInjector:
    scope = scen({"perturb": perturb}).scope
    return ParamInjector(list(enumerate(scope.perturb)), params, 4, 0, 0, records.append)


def snapshot(params: dict[str, HeldParam]) -> dict[str, torch.Tensor]:
    return {n: h.param.detach().clone() for n, h in params.items()}


def test_parameter_perturbations_hit_only_their_targets_and_steps(rank: None) -> None:
    state = {n: torch.from_numpy(a) for n, a in random_state(scen()).items()}
    params = held(state)
    records: list[dict[str, Any]] = []
    fc1 = "decoder.layers.{}.mlp.linear_fc1.weight"
    inj = injector([
        {"kind": "param_bitflip", "target": "mlp.linear_fc1.weight", "layers": [2], "bit": 30,
         "index": 7, "step": 2},
        {"kind": "param_stuck", "target": "mlp.linear_fc1.weight", "layers": [1], "value": 9.0,
         "index": 3, "step": 1, "persistent": False},
        {"kind": "param_stuck", "target": "output_layer.weight", "value": -2.0, "count": 2,
         "step": 1},
        {"kind": "param_noise", "target": "self_attention.linear_qkv.weight", "layers": [2],
         "sigma": 0.1, "step": 3}], params, records)
    clean = held(state)  # the same updates, never perturbed
    history, clean_history = [], []
    for step in range(5):  # iteration `step` runs, then its optimizer writes back
        history.append(snapshot(params))  # what iteration `step` computes with
        clean_history.append(snapshot(clean))
        inj.before_update(step)
        with torch.no_grad():
            for h in [*params.values(), *clean.values()]:
                h.param.add_(0.5)
        inj.write_back(step + 1)

    def changed(step: int) -> set[str]:
        """Parameters that iteration `step` sees corrupted."""
        return {n for n, v in history[step].items() if not torch.equal(v, clean_history[step][n])}

    assert changed(0) == set()
    assert changed(1) == {fc1.format(0), "output_layer.weight"}
    assert history[1][fc1.format(0)].view(-1)[3] == 9.0  # stuck for iteration 1 only
    assert changed(2) == {fc1.format(1), "output_layer.weight"}
    flipped = (history[2][fc1.format(1)].view(torch.int32)
               ^ clean_history[2][fc1.format(1)].view(torch.int32))
    assert int((flipped != 0).sum()) == 1 and int(flipped.view(-1)[7]) == 1 << 30
    out = history[4]["output_layer.weight"].view(-1)
    stuck_idx = sorted({el["index"] for r in records if r["param"] == "output_layer.weight"
                        for el in r["elements"]})
    assert len(stuck_idx) == 2 and all(out[i] == -2.0 for i in stuck_idx)  # forced every step
    qkv = "decoder.layers.1.self_attention.linear_qkv.weight"
    assert qkv not in changed(2) and qkv in changed(3)
    qkv1 = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert all(qkv1 not in changed(s) for s in range(5))
    kinds = [(r["kind"], r["step"]) for r in records]
    assert ("param_bitflip", 2) in kinds and ("param_noise", 3) in kinds
    assert kinds.count(("param_stuck", 1)) == 2 and ("param_stuck", 4) in kinds


def test_a_flip_in_a_tensor_parallel_slice_lands_where_the_whole_tensor_has_it() -> None:
    full = torch.randn(6, 4)
    want = full.clone()
    flip_bits(want.view(-1), [13], 2)
    shards = list(full.clone().chunk(2, dim=0))
    p = scen({"perturb": [{"kind": "param_bitflip", "target": "output_layer.weight",
                           "bit": 2, "index": 13}]}).scope.perturb[0]
    for tp_rank, shard in enumerate(shards):
        held_param = HeldParam(torch.nn.Parameter(shard), 0, 2, tp_rank)
        ParamInjector([(0, p)], {"output_layer.weight": held_param}, 0, tp_rank, 0,
                      lambda r: None).write_back(0)
        shards[tp_rank] = held_param.param.detach()
    assert torch.equal(torch.cat(shards), want)


# ------------------------------------------------------------ point to point
def test_received_tensors_are_corrupted_only_where_asked() -> None:
    scope = parse_scenario({"parallel": {"pp": 2}, "model": MODEL, "scope": {"perturb": [
        {"kind": "p2p_offset", "direction": "forward", "value": 1.5, "step": 1, "microbatch": 0},
        {"kind": "p2p_zero", "direction": "backward", "stage": 0},
        {"kind": "p2p_bitflip", "direction": "forward", "bit": "sign", "count": 3, "step": 2}]}}
                           ).scope
    records: list[dict[str, Any]] = []
    inj = P2PInjector(list(enumerate(scope.perturb)), 4, 1, records.append)

    def receive(tag: tuple, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(5, 2, 3, generator=torch.Generator().manual_seed(step))
        y = x.clone()
        inj.on_receive(tag, {"iteration": step}, 0, y)
        return x, y

    x, y = receive(("F", 0, 1), 1)
    assert torch.equal(y, x + 1.5)
    x, y = receive(("F", 1, 1), 1)
    assert torch.equal(x, y)  # another microbatch
    x, y = receive(("B", 3, 0), 0)
    assert torch.equal(y, torch.zeros_like(x))
    x, y = receive(("F", 0, 1), 2)
    diff = x.view(torch.int32) ^ y.view(torch.int32)
    assert int((diff != 0).sum()) == 3 and set(diff[diff != 0].tolist()) == {-(1 << 31)}
    assert [r["kind"] for r in records] == ["p2p_offset", "p2p_zero", "p2p_bitflip"]


# -------------------------------------------------------------- generation
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, rank: None) -> Path:
    s = scen()
    out = tmp_path_factory.mktemp("ckpt")
    write_checkpoint(out, random_state(s), s.model, Data(kind="text"), {"iterations": 0})
    return out


def greedy(ckpt_dir: Path, prompt: str, n: int) -> list[int]:
    ckpt = read_checkpoint(ckpt_dir)
    model = build_model(local_scenario(ckpt, Scope(), 0), ckpt.state)
    ids = [int(i) for i in ckpt.vocab.encode(prompt)]
    for _ in range(n):
        w = ids[-ckpt.model.seq_len:]
        with torch.no_grad():
            logits = model(torch.tensor([w]), torch.arange(len(w))[None], causal_mask(len(w)))
        ids.append(int(torch.argmax(logits[0, -1])))
    return ids[-n:]


def test_generation_records_match_a_plain_greedy_decode(checkpoint: Path, tmp_path: Path) -> None:
    ckpt = read_checkpoint(checkpoint)
    scope = scen({"observe": [{"site": "resid_post", "stats": ["mean", "std"]}],
                  "perturb": [{"kind": "act_offset", "site": "resid_post", "layers": [1],
                               "value": 0.0}]}).scope
    steps = list(generate(ckpt, "def f(x):", 14, scope, out=tmp_path))  # past seq_len: slides
    assert [r.clean.token_id for r in steps] == greedy(checkpoint, "def f(x):", 14)
    for r in steps:
        probs = [t.prob for t in r.clean.topk]
        assert probs == sorted(probs, reverse=True) and r.clean.prob == probs[0]
        assert r.kl == 0.0 and set(r.delta_h.values()) == {0.0}  # a zero offset changes nothing
        assert r.perturbed is not None and r.perturbed.token_id == r.clean.token_id
        assert set(r.clean.attention) == {1, 2} and set(r.clean.pca) == {1, 2}
        assert r.clean.attention[1].shape == (4, len(r.window), len(r.window))
        assert r.clean.pca[2].shape == (len(r.window), 2)
        json.dumps(r.to_json())
    assert len(steps[-1].window) == MODEL["seq_len"]
    table = Capture(tmp_path / "clean").stats()
    assert sorted(set(table.column("step").to_pylist())) == list(range(14))
    assert (tmp_path / "perturbed" / "stats.parquet").is_file()


def test_generation_with_noise_reports_kl_and_the_layers_it_reaches(checkpoint: Path) -> None:
    ckpt = read_checkpoint(checkpoint)
    scope = scen({"observe": [{"site": "logits", "stats": ["max"]}],
                  "perturb": [{"kind": "act_noise", "site": "resid_post", "layers": [2],
                               "sigma": 1.0}]}).scope
    for r in generate(ckpt, "class A:", 3, scope):
        assert r.kl is not None and r.kl > 0
        assert r.delta_h[1] == 0.0 and r.delta_h[2] > 0.1  # layer 1 is upstream of the noise


def test_pca_basis_is_orthonormal_and_fixed_in_sign() -> None:
    x = np.random.default_rng(0).normal(size=(200, 6)) * [5, 3, 1, 1, 1, 1]
    b = PcaBasis.fit(x)
    np.testing.assert_allclose(b.axes @ b.axes.T, np.eye(2), atol=1e-12)
    assert (b.axes.sum(axis=1) >= 0).all() and b.explained[0] > b.explained[1]
    np.testing.assert_allclose(b.project(x[:3]), (x[:3] - x.mean(0)) @ b.axes.T)


# --------------------------------------------------------------- bad input
def test_corrupt_checkpoints_are_one_line_errors(checkpoint: Path, tmp_path: Path) -> None:
    import shutil

    cases = {}
    for name in ("truncated", "shape", "json", "empty"):
        d = tmp_path / name
        shutil.copytree(checkpoint, d)
        cases[name] = d
    weights = cases["truncated"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    from safetensors.numpy import load_file, save_file
    state = load_file(str(cases["shape"] / "model.safetensors"))
    state["output_layer.weight"] = state["output_layer.weight"][:3]
    save_file(state, str(cases["shape"] / "model.safetensors"))
    (cases["json"] / "checkpoint.json").write_text("{not json")
    (cases["empty"] / "model.safetensors").unlink()
    for name, d in cases.items():
        with pytest.raises(UserError, match="CHECKPOINT") as err:
            read_checkpoint(d)
        assert "\n" not in str(err.value), name


@pytest.mark.slow
def test_cli_generate_runs_and_refuses_bad_input(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "gen"
    ok = run_cli("scope", "generate", str(checkpoint), "--prompt", "import", "--tokens", "3",
                 "--perturb", "{kind: act_noise, site: attn.out, layers: [1], sigma: 0.5}",
                 "--out", str(out))
    assert ok.returncode == 0, ok.stderr
    assert len((out / "generation.jsonl").read_text().splitlines()) == 3
    assert "KL" in ok.stdout and (out / "clean" / "manifest.json").is_file()
    for args, field in [(["--perturb", "{kind: p2p_zero, direction: forward}"], "scope.perturb"),
                        (["--perturb", "{kind: act_noise, site: nowhere, sigma: 1}"], "site"),
                        (["--tokens", "0"], "--tokens"),
                        (["--tokens", "10000000000"], "limits: decoding")]:
        bad = run_cli("scope", "generate", str(checkpoint), "--prompt", "x", "--out",
                      str(tmp_path / "no"), *args)
        assert bad.returncode == 2 and field in bad.stderr, bad.stderr
        assert bad.stderr.strip().count("\n") == 0 and not (tmp_path / "no").exists()
    bad = run_cli("scope", "generate", str(tmp_path), "--prompt", "x")
    assert bad.returncode == 2 and "CHECKPOINT" in bad.stderr
