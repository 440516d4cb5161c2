"""A target's RoPE and RMS norms on the CPU as one native op each (csrc/target_rope.cpp,
kernels/target_ops.py, compat.route_target_norm_and_rope): parity with the pure-MLX references
and with MLX's own ops on fresh random inputs, rows that do not depend on the call's width, the
routing (only inside the target's decode forward, only what the op expresses), and generations
equal to plain decoding in tokens and text with the ops taken."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from drafter_fixtures import workspace

import mlx_dspark as md
from mlx_dspark.kernels import invariant, native, target_ops

pytestmark = pytest.mark.skipif(
    mx.default_device() != mx.cpu or native.ext(warn=False) is None, reason="the native ops run on the CPU build"
)


def _case(rng):
    B = int(rng.integers(1, 4))
    H, L = int(rng.integers(1, 10)), int(rng.integers(1, 20))
    D = int(rng.choice([16, 40, 64, 128]))
    dims = D if rng.random() < 0.6 else 2 * int(rng.integers(1, D // 2 + 1))
    x = mx.array(rng.standard_normal((B, H, L, D)).astype(np.float32) * 2)
    per_row = B > 1 and rng.random() < 0.5
    offset = mx.array(rng.integers(0, 4000, B).astype(np.int32)) if per_row else int(rng.integers(0, 4000))
    kw = dict(traditional=bool(rng.random() < 0.3), base=float(rng.choice([10000.0, 500000.0, 1e6])))
    kw["scale"] = float(rng.choice([1.0, 0.25]))
    return x, dims, offset, kw


@pytest.mark.parametrize("seed", range(10))
def test_rope_equals_its_reference_and_mlx(seed):
    rng = np.random.default_rng(seed)
    x, dims, offset, kw = _case(rng)
    got = target_ops.rope(x, dims, offset=offset, **kw)
    assert got is not None and got.shape == x.shape and got.dtype == mx.float32
    want = target_ops.rope_reference(x, dims, offset=offset, **kw)
    mlx = mx.fast.rope(x, dims, offset=offset, stream=mx.cpu, **kw)  # a stream: MLX's own op, never routed
    # float32 angles at positions up to ~4000 round to ~2e-4 rad: what MLX's own op differs by
    for other in (want, mlx):
        assert mx.allclose(got, other, atol=2e-3, rtol=1e-3).item(), mx.abs(got - other).max().item()
    if dims < x.shape[-1]:
        assert mx.array_equal(got[..., dims:], x[..., dims:]).item()  # the rest as it is


@pytest.mark.parametrize("seed", range(4))
def test_rope_rows_do_not_depend_on_the_calls_width(seed):
    """Each row as a one-row call at its own position gives the block's row bitwise, as a verify
    block's rows must give the plain steps'; a batch row with its own offset gives it alone."""
    rng = np.random.default_rng(100 + seed)
    x, dims, offset, kw = _case(rng)
    block = target_ops.rope(x, dims, offset=offset, **kw)
    offs = np.array(offset).reshape(-1) if isinstance(offset, mx.array) else np.full(x.shape[0], offset)
    for b in range(x.shape[0]):
        for t in range(x.shape[2]):
            row = target_ops.rope(x[b : b + 1, :, t : t + 1], dims, offset=int(offs[b]) + t, **kw)
            assert mx.array_equal(row[0, :, 0], block[b, :, t]).item(), (b, t)


@pytest.mark.parametrize("seed", range(4))
def test_rms_norm_equals_its_reference_and_mlx(seed):
    rng = np.random.default_rng(200 + seed)
    D = int(rng.choice([8, 64, 576, 1000]))
    x = mx.array(rng.standard_normal((int(rng.integers(1, 4)), int(rng.integers(1, 12)), D)).astype(np.float32) * 3)
    w = mx.array(rng.uniform(0.5, 1.5, D).astype(np.float32)) if seed % 2 == 0 else None
    got = target_ops.rms_norm(x, w, 1e-5)
    want = target_ops.rms_norm_reference(x, w, 1e-5)
    assert got is not None and mx.allclose(got, want, atol=1e-5, rtol=1e-5).item()
    if w is not None:
        mlx = mx.fast.rms_norm(x, w, 1e-5, stream=mx.cpu)
        assert mx.allclose(got, mlx, atol=1e-5, rtol=1e-5).item()


def test_what_the_ops_do_not_express_goes_to_mlx():
    x = mx.ones((1, 2, 3, 8))
    kw = dict(traditional=False, scale=1.0, offset=4)
    assert target_ops.rope(x, 8, base=None, freqs=mx.ones((4,)), **kw) is None  # freqs (Llama 3, YaRN)
    assert target_ops.rope(x.astype(mx.bfloat16), 8, base=10000.0, **kw) is None
    assert target_ops.rope(x, 8, base=10000.0, traditional=False, scale=1.0, offset=mx.array([1, 2])) is None
    assert target_ops.rms_norm(x.astype(mx.float16), None, 1e-5) is None
    assert target_ops.rms_norm(x, mx.ones((8,), mx.bfloat16), 1e-5) is None


def _counting(monkeypatch):
    taken = {"rope": 0, "rms_norm": 0}
    for name in taken:
        real = getattr(target_ops, name)

        def counted(*a, _real=real, _name=name, **k):
            y = _real(*a, **k)
            taken[_name] += y is not None
            return y

        monkeypatch.setattr(target_ops, name, counted)
    return taken


def test_the_targets_decode_forward_takes_the_ops_and_stays_equal_to_baseline(monkeypatch):
    """The Qwen3 fixture (q/k norms, RoPE) on the CPU's kernel path: every decode forward takes a
    native RoPE for its queries and keys in each layer and a native op for each norm; calls
    outside that forward stay MLX's; lookup and DSpark give baseline's tokens and text."""
    monkeypatch.setenv("MLX_DSPARK_INVARIANT", "kernels")
    tgt, tok = md.load_target(str(workspace()["target_qwen3"]), dtype="float32")
    assert tgt.invariance == "kernels", tgt.invariance
    taken = _counting(monkeypatch)
    mx.fast.rope(mx.ones((1, 1, 2, 8)), 8, traditional=False, base=10000.0, scale=1.0, offset=0)  # outside
    assert taken["rope"] == 0
    cache = tgt.make_cache()
    tgt.forward(mx.array([[3, 4, 5, 6]]), cache, last_only=True)
    before = dict(taken)
    out = tgt.forward(mx.array([[7, 8, 9]]), cache)
    mx.eval(out.logits)
    n = tgt.num_layers
    assert taken["rope"] - before["rope"] == 2 * n  # queries and keys, every layer
    assert taken["rms_norm"] - before["rms_norm"] >= 2 * n + 1  # the layers' two norms and the final one
    with invariant.active():
        assert target_ops.rope(mx.ones((1, 1, 2, 8)), 8, traditional=False, base=1e4, scale=1.0, offset=0) is not None

    prompt = "the fox the fox the fox jumps over"
    base = md.generate(tgt, tok, prompt, mode="baseline", max_new_tokens=24)
    look = md.generate(tgt, tok, prompt, mode="lookup", max_new_tokens=24)
    assert look.tokens == base.tokens and look.text == base.text


@pytest.mark.parametrize("switch", ["MLX_DSPARK_KERNELS=reference", "MLX_DSPARK_TARGET_OPS=off"])
def test_reference_kernels_or_the_switch_keep_mlxs_ops(monkeypatch, switch):
    if switch.startswith("MLX_DSPARK_KERNELS"):
        monkeypatch.setenv("MLX_DSPARK_KERNELS", "reference")
    else:
        monkeypatch.setattr(target_ops, "_ENABLED", False)  # the variable as read at import
    assert target_ops.rope(mx.ones((1, 1, 2, 8)), 8, traditional=False, base=1e4, scale=1.0, offset=0) is None
    assert target_ops.rms_norm(mx.ones((2, 8)), None, 1e-5) is None


def test_doctor_says_which_ops_the_targets_rope_and_norms_run(monkeypatch):
    from mlx_dspark.kernels import kernel_paths

    assert kernel_paths()["target_rope_norms"] == "native-cpu (float32)"
    monkeypatch.setattr(target_ops, "_ENABLED", False)  # MLX_DSPARK_TARGET_OPS=off at import
    assert "MLX_DSPARK_TARGET_OPS=off" in kernel_paths()["target_rope_norms"]
