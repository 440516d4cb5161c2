"""The wide-GEMM prefill and MoE experts (kernels/wide_gemm.py): by default the experts keep
mx.gather_qmm (the policy says why: the dense form measured slower at real MoE shapes and is not
bitwise there); opted in (MLX_DSPARK_WIDE_GEMM_EXPERTS=on), QuantizedSwitchLinear runs as
dequantize-once + mx.gather_mm: against the layer on fresh random inputs at small shapes
(bitwise with MLX's bundled BLAS), and a quantized qwen3_moe / qwen3_5_moe target's prefill and
generation, token-identical to mlx-lm."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from family_fixtures import write_family
from fixtures import scratch_dir
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, _gather_sort
from test_loop import independent_greedy

import mlx_dspark as md
from mlx_dspark import kernels
from mlx_dspark.kernels import wide_gemm as wg

ON = {"enabled": True, "min_rows": 16, "compute": "model", "why": "test", "experts": True}
_ROOT = scratch_dir("mlx-dspark-moe-")


def same(a, b, tol=1e-5) -> bool:
    if wg._fast_cpu_blas():  # OpenBLAS / Accelerate: GEMM accumulation order differs
        return mx.allclose(a, b, rtol=tol, atol=tol).item()
    return mx.array_equal(a, b).item()


@pytest.mark.parametrize("bits,group", [(4, 64), (8, 32), (4, 128)])
@pytest.mark.parametrize("sort", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_experts_equal_gather_qmm(bits, group, sort, bias):
    for seed in range(3):
        mx.random.seed(seed)
        E, I, O, N, k = 8, 256, 192, 40, 2
        layer = QuantizedSwitchLinear(I, O, E, bias=bias, group_size=group, bits=bits)
        if bias:
            layer.bias = mx.random.normal((E, O))
        x = mx.expand_dims(mx.random.normal((N, I)), (-2, -3))
        idx = mx.random.randint(0, E, (N, k))
        if sort:
            x, idx, _ = _gather_sort(x, idx)
        ref = layer(x, idx, sorted_indices=sort)
        got = wg.dense_switch_linear(layer, x, idx, sort)
        assert got.shape == ref.shape and got.dtype == ref.dtype and same(got, ref)


def _moe(name, quantize=4):
    path = write_family(_ROOT / f"{name}-{quantize}", name, seed=3)
    return md.load_target(str(path), dtype="float32", quantize=quantize)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_5_moe"])
def test_a_quantized_moe_prefill_runs_its_experts_dense(name, monkeypatch):
    tgt, tok = _moe(name)
    switch = [m for _, m in tgt.model.named_modules() if type(m) is QuantizedSwitchLinear]
    assert switch
    calls = []
    real = wg.dense_switch_linear
    monkeypatch.setattr(wg, "dense_switch_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = mx.array(tok.encode("The quick brown fox jumps over the lazy dog. " * 6)[:64])[None]
    ref = tgt.model(ids, cache=tgt.make_cache())[:, -1]
    with kernels.prefill_context(tgt, ids.shape[1], cfg=ON):
        assert all(type(m) is wg.WideQuantizedSwitchLinear for m in switch)
        got = tgt.model(ids, cache=tgt.make_cache())[:, -1]
    assert all(type(m) is QuantizedSwitchLinear for m in switch)  # restored
    assert len(calls) == 3 * len([m for m in tgt.layers if hasattr(m, "mlp") and hasattr(m.mlp, "switch_mlp")])
    assert same(got, ref, tol=1e-4)  # after the whole stack
    calls.clear()
    with kernels.prefill_context(tgt, ids.shape[1], cfg=dict(ON, experts=False)):
        assert all(type(m) is QuantizedSwitchLinear for m in switch)  # experts off: untouched
        tgt.model(ids, cache=tgt.make_cache())
    assert calls == []


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_5_moe"])
def test_generation_with_dense_experts_is_token_identical(name, monkeypatch):
    tgt, tok = _moe(name)
    monkeypatch.setenv("MLX_DSPARK_WIDE_GEMM", "on")
    monkeypatch.setenv("MLX_DSPARK_WIDE_GEMM_MIN", "16")
    monkeypatch.setenv("MLX_DSPARK_WIDE_GEMM_EXPERTS", "on")
    assert wg.policy()["experts"]
    ids = md.encode_prompt(tok, "the fox def add hello world " * 4)
    stops = set(md.api.stop_token_ids(tgt, tok))
    base = md.generate(tgt, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=24)
    look = md.generate(tgt, tok, None, prompt_ids=ids, mode="lookup", max_new_tokens=24)
    assert look.tokens == base.tokens and look.text == base.text
    if not wg._fast_cpu_blas():  # bit-identical prefill: the same tokens as mlx-lm's own forward
        assert base.tokens == independent_greedy(tgt, ids, 24, stops)


def test_expert_policy_says_experts_are_not_covered_by_default(monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_WIDE_GEMM", "on")
    pol = wg.policy()
    assert pol["enabled"] and not pol["experts"] and "keep gather_qmm" in pol["experts_why"]
    monkeypatch.setenv("MLX_DSPARK_WIDE_GEMM_EXPERTS", "on")
    assert wg.policy()["experts"]
    monkeypatch.setenv("MLX_DSPARK_WIDE_GEMM_EXPERTS", "off")
    assert not wg.policy()["experts"]
    monkeypatch.setenv("MLX_DSPARK_WIDE_GEMM_EXPERTS", "maybe")
    with pytest.raises(ValueError, match="MLX_DSPARK_WIDE_GEMM_EXPERTS"):
        wg.policy()
    monkeypatch.setenv("MLX_DSPARK_WIDE_GEMM_EXPERTS", "on")
    monkeypatch.setenv("MLX_DSPARK_WIDE_GEMM", "off")
    assert not wg.policy()["experts"]  # never without the dense path itself


def test_experts_too_large_to_dequantize_keep_gather_qmm(monkeypatch):
    calls = []
    monkeypatch.setattr(wg, "dense_switch_linear", lambda *a, **k: calls.append(1))
    monkeypatch.setenv("MLX_DSPARK_WIDE_GEMM_EXPERT_MB", "0.01")
    layer = QuantizedSwitchLinear(256, 192, 8, bias=False)

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.sw = layer

    m = Tiny()
    x, idx = mx.random.normal((32, 1, 1, 256)), mx.random.randint(0, 8, (32, 2))
    with kernels.prefill_context(type("T", (), {"model": m})(), 64, cfg=ON):
        assert type(m.sw) is wg.WideQuantizedSwitchLinear
        m.sw(x, idx)
    assert calls == []


def test_by_default_a_moe_prefill_leaves_the_experts_alone(monkeypatch):
    tgt, tok = _moe("qwen3_moe")
    monkeypatch.setenv("MLX_DSPARK_WIDE_GEMM", "on")
    monkeypatch.setenv("MLX_DSPARK_WIDE_GEMM_MIN", "16")
    switch = [m for _, m in tgt.model.named_modules() if type(m) is QuantizedSwitchLinear]
    with kernels.prefill_context(tgt, 64):  # the product's own policy
        assert all(type(m) is QuantizedSwitchLinear for m in switch)
        assert any(type(m) is wg.WideQuantizedLinear for _, m in tgt.model.named_modules())
