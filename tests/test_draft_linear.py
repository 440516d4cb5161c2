"""A drafter's linear layers on the CPU from float16 panels (csrc/draft_linear.cpp,
kernels/draft_linear.py): the op equals its pure-MLX reference on fresh random inputs, a row does
not depend on how many run together, and a drafter pass takes it for its float weights (packed at
load, packed again when a weight is replaced). Generations with it, and its portable tiles:
tests/test_draft_ops.py."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from test_draft_ops import _pair, counted  # noqa: F401  (the fixture: the ops' calls, counted)

from mlx_dspark.kernels import draft_linear, native, native_products

pytestmark = pytest.mark.skipif(
    mx.default_device() != mx.cpu or native.ext(warn=False) is None, reason="the native op runs on the CPU build"
)


@pytest.fixture
def ext():
    return native.ext(warn=False)


@pytest.mark.parametrize("seed", range(8))
def test_the_op_equals_its_reference(ext, seed):
    rng = np.random.default_rng(seed)
    m, k, n = int(rng.integers(1, 70)), int(rng.integers(1, 700)), int(rng.integers(1, 300))
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32) / 10)
    bias = mx.array(rng.standard_normal(n).astype(np.float32)) if seed % 2 else None
    panels = draft_linear.pack(w)
    assert panels.shape == ((n + 15) // 16, k, 16) and panels.dtype == mx.float16
    got = ext.draft_linear(x, panels, bias, n=n)
    want = draft_linear.draft_linear_reference(x, panels, n, bias)
    assert got.shape == (m, n) and got.dtype == mx.float32
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item(), mx.abs(got - want).max().item()
    # the float16 weight is the float32 one rounded: close to the float32 product too
    full = x @ w.T + (0 if bias is None else bias)
    assert mx.allclose(got, full, atol=2e-2, rtol=1e-2).item()


def test_a_row_equals_the_row_alone(ext):
    rng = np.random.default_rng(11)
    x = mx.array(rng.standard_normal((23, 300)).astype(np.float32))
    panels = draft_linear.pack(mx.array(rng.standard_normal((90, 300)).astype(np.float32)))
    together = ext.draft_linear(x, panels, None, n=90)
    for i in (0, 6, 7, 22):
        assert mx.array_equal(together[i : i + 1], ext.draft_linear(x[i : i + 1], panels, None, n=90)).item()


def test_pack_roundtrip_and_refusals(ext):
    w = mx.array(np.arange(40 * 3, dtype=np.float32).reshape(40, 3) / 8)
    assert mx.array_equal(draft_linear.unpack(draft_linear.pack(w), 40), w).item()  # exact in float16
    assert draft_linear.pack(w * 1e5) is None  # past float16's range: the float32 kernel keeps it
    panels = draft_linear.pack(w)
    with pytest.raises(ValueError, match="do not hold"):
        ext.draft_linear(mx.zeros((2, 4)), panels, None, n=40)
    with pytest.raises(ValueError, match="float16"):
        ext.draft_linear(mx.zeros((2, 3)), panels.astype(mx.float32), None, n=40)
    with pytest.raises(ValueError, match="float32"):
        ext.draft_linear(mx.zeros((2, 3), dtype=mx.float16), panels, None, n=40)


def test_a_drafter_pass_runs_its_float_weights_from_panels(counted, monkeypatch):  # noqa: F811
    _, _, d = _pair("dspark_qwen3")
    weights = d.product_weights()
    assert weights and all(id(w) in native_products._packs for w in weights)  # packed at load
    ctx = mx.random.normal((12, d.spec.backbone.context_dim), key=mx.random.key(5))
    with native_products.native_products():
        got = d.block_hidden(77, ctx, d.new_state())
        mx.eval(got)
    backbone = [m for top in (d.model.fc, *d.model.layers) for _, m in top.named_modules() if type(m) is nn.Linear]
    assert counted.count("draft_linear") == len(backbone) and "invariant_linear" not in counted  # no head yet
    # the same pass in MLX's ops on the float16-rounded weights
    originals = [(m, m.weight) for _, m in d.model.named_modules() if type(m) is nn.Linear]
    try:
        for m, w in originals:
            m.weight = w.astype(mx.float16).astype(mx.float32)
        want = d.block_hidden(77, ctx, d.new_state())
        mx.eval(want)
    finally:
        for m, w in originals:
            m.weight = w
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item(), mx.abs(got - want).max().item()
    # off: the float32 kernel
    monkeypatch.setenv("MLX_DSPARK_DRAFT_PANELS", "off")
    counted.clear()
    with native_products.native_products():
        mx.eval(d.block_hidden(77, ctx, d.new_state()))
    assert "draft_linear" not in counted and "invariant_linear" in counted


def test_a_replaced_weight_is_packed_again():
    layer = nn.Linear(40, 24, bias=True)
    x = mx.random.normal((3, 40))
    with native_products.native_products():
        first = native_products.linear(layer, x)
        layer.weight = layer.weight * 2  # what an optimiser step does: a new array
        second = native_products.linear(layer, x)
    want = x @ (layer.weight.astype(mx.float16).astype(mx.float32)).T + layer.bias
    assert mx.allclose(second, want, atol=1e-5).item() and not mx.allclose(first, second).item()


def test_a_weight_past_the_cap_keeps_the_float32_kernel(monkeypatch, counted):  # noqa: F811
    monkeypatch.setattr(native_products, "MAX_PANEL_ELEMENTS", 100)
    layer, x = nn.Linear(40, 24), mx.random.normal((3, 40))  # 960 elements
    with native_products.native_products():
        y = native_products.linear(layer, x)
    assert counted == ["invariant_linear"] and mx.allclose(y, layer(x), atol=1e-5).item()
