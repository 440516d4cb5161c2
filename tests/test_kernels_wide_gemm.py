"""Dequantize-once wide GEMM (kernels/wide_gemm.py): numerics against the model's own quantized
layer at the same width, the per-instance / per-thread switch, and a quantized target's prefill."""

from __future__ import annotations

import threading

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_dspark import kernels
from mlx_dspark.kernels import wide_gemm as wg

ON = {"enabled": True, "min_rows": 16, "compute": "model", "why": "test"}


def layer(inp, out, bits, group, bias, dtype, seed):
    mx.random.seed(seed)
    ql = nn.QuantizedLinear(inp, out, bias=bias, group_size=group, bits=bits)
    ql.scales = ql.scales.astype(dtype)
    ql.biases = ql.biases.astype(dtype)
    if bias:
        ql.bias = mx.random.normal((out,)).astype(dtype)
    mx.eval(ql.parameters())
    return ql


@pytest.mark.parametrize("bits,group", [(4, 64), (8, 32), (4, 128)])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_dense_equals_quantized_layer(bits, group, bias):
    """float32: the dense path is the layer's own result: bit-identical with the reference BLAS
    MLX bundles on Linux, within 1e-5 relative when a fast BLAS (OpenBLAS) is loaded."""
    ql = layer(256, 384, bits, group, bias, mx.float32, bits * group)
    x = mx.random.normal((1, 300, 256))
    want, got = ql(x), wg.dense_quantized_linear(ql, x)
    mx.eval(want, got)
    assert got.dtype == want.dtype and got.shape == want.shape
    if wg._fast_cpu_blas():
        rel = (mx.abs(got - want).max() / mx.abs(want).max()).item()
        assert rel < 1e-5, rel
    else:
        assert mx.array_equal(got, want).item()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_half_precision_difference_is_bounded(dtype):
    """bf16/fp16 with the float32 GEMM (the CPU policy) is not bit-identical to the CPU
    mx.quantized_matmul, which accumulates in half precision: measured against the exact product
    (float64, same dequantized weights), the dense path's error is below the quantized kernel's
    own and within 2 output ulps of the largest output."""
    import numpy as np

    ql = layer(256, 256, 4, 64, False, dtype, 3)
    x = mx.random.normal((1, 64, 256)).astype(dtype)
    w = mx.dequantize(ql.weight, ql.scales, ql.biases, group_size=64, bits=4)
    exact = np.array(x.astype(mx.float32), np.float64) @ np.array(w.astype(mx.float32), np.float64).T
    scale = np.abs(exact).max()
    q_err = np.abs(np.array(ql(x).astype(mx.float32)) - exact).max() / scale
    got = wg.dense_quantized_linear(ql, x, compute="float32")
    assert got.dtype == dtype
    d_err = np.abs(np.array(got.astype(mx.float32)) - exact).max() / scale
    ulp = 2.0**-8 if dtype == mx.bfloat16 else 2.0**-11
    assert d_err <= 2 * ulp, (d_err, q_err)
    assert d_err <= q_err, (d_err, q_err)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = layer(128, 128, 4, 64, False, mx.float32, 5)
        self.b = [layer(128, 128, 8, 64, True, mx.float32, 6)]
        self.c = nn.Linear(128, 128)

    def __call__(self, x):
        return self.c(self.b[0](self.a(x)))


def test_switch_is_per_instance_per_thread_and_restored(monkeypatch):
    m = _Tiny()
    calls = []
    real = wg.dense_quantized_linear
    monkeypatch.setattr(wg, "dense_quantized_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    target = type("T", (), {"model": m})()
    wide, narrow = mx.random.normal((1, 32, 128)), mx.random.normal((1, 4, 128))
    other = []
    with kernels.prefill_context(target, 32, cfg=ON):
        assert type(m.a) is wg.WideQuantizedLinear and type(m.b[0]) is wg.WideQuantizedLinear
        assert type(m.c) is nn.Linear
        m(wide)
        assert len(calls) == 2
        m(narrow)  # below min_rows: the quantized kernel
        assert len(calls) == 2
        t = threading.Thread(target=lambda: other.append(m(wide)))  # another thread: never dense
        t.start()
        t.join()
        assert len(calls) == 2 and other
    assert type(m.a) is nn.QuantizedLinear and type(m.b[0]) is nn.QuantizedLinear
    with kernels.prefill_context(target, 8, cfg=ON):  # too narrow: nothing is switched
        assert type(m.a) is nn.QuantizedLinear
    with kernels.prefill_context(target, 32, cfg=dict(ON, enabled=False)):
        assert type(m.a) is nn.QuantizedLinear


def test_policy_from_environment(monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_WIDE_GEMM", "off")
    assert not wg.policy()["enabled"]
    monkeypatch.setenv("MLX_DSPARK_WIDE_GEMM", "on")
    monkeypatch.setenv("MLX_DSPARK_WIDE_GEMM_MIN", "100")
    assert wg.policy()["enabled"] and wg.policy()["min_rows"] == 100
    monkeypatch.setenv("MLX_DSPARK_WIDE_GEMM", "sometimes")
    with pytest.raises(ValueError, match="MLX_DSPARK_WIDE_GEMM"):
        wg.policy()
    monkeypatch.delenv("MLX_DSPARK_WIDE_GEMM")
    assert wg.policy()["enabled"] == wg._fast_cpu_blas()  # CPU auto: only with a fast BLAS


def test_quantized_target_prefill(model_dir, monkeypatch):
    """A 4-bit target loaded from disk: the prefill's last logits with the dense path against the
    model's own quantized forward (identical with the bundled BLAS), and the same greedy tokens."""
    from mlx_dspark.decode import loop
    from mlx_dspark.models.loading import load_target

    target, tok = load_target(str(model_dir("qwen3", hidden=128, intermediate=256)), quantize=4)
    assert any(type(m) is nn.QuantizedLinear for _, m in target.model.named_modules())
    prompt = (tok.encode("The quick brown fox jumps over the lazy dog. " * 12))[:96]
    ids = mx.array(prompt)[None]
    ref = target.model(ids, cache=target.make_cache())[:, -1]
    with kernels.prefill_context(target, ids.shape[1], cfg=ON):
        got = target.model(ids, cache=target.make_cache())[:, -1]
    mx.eval(ref, got)
    if wg._fast_cpu_blas():
        assert mx.allclose(got, ref, rtol=1e-4, atol=1e-4).item()
    else:
        assert mx.array_equal(got, ref).item()
        monkeypatch.setenv("MLX_DSPARK_WIDE_GEMM", "on")
        monkeypatch.setenv("MLX_DSPARK_WIDE_GEMM_MIN", "16")
        on = loop.run(target, prompt, max_new_tokens=8).tokens
        monkeypatch.setenv("MLX_DSPARK_WIDE_GEMM", "off")
        off = loop.run(target, prompt, max_new_tokens=8).tokens
        assert on == off and len(on) == 8
