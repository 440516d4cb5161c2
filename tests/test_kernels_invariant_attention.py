"""The width-invariant attention op (kernels/invariant.py): the pure-MLX reference against MLX's own
attention, its invariance, the compile checks of its Metal and CUDA instances (Linux, libclang),
and (on the device, `pytest -m gpu`) the CUDA instance against the reference, bitwise invariance
and strided cache reads."""

from __future__ import annotations

import os
import random

import kernel_text as kt
import mlx.core as mx
import pytest

from mlx_dspark.kernels import gpu_source as gs
from mlx_dspark.kernels import invariant as inv

SEED = int(os.environ.get("MLX_DSPARK_TEST_SEED", random.randrange(2**31)))
SHAPES = [
    (1, 4, 1, 2, 37, 64),
    (1, 4, 16, 2, 300, 64),
    (2, 9, 16, 3, 129, 64),
    (1, 8, 5, 8, 128, 128),
    (1, 2, 17, 1, 640, 256),
    (1, 6, 3, 2, 3, 80),
]  # B, H, Lq, Hkv, Lk, D


def inputs(B, H, Lq, Hkv, Lk, D, dtype, i):
    k1, k2, k3 = mx.random.split(mx.random.key(SEED * 100 + i), 3)
    return (
        mx.random.normal((B, H, Lq, D), key=k1).astype(dtype),
        mx.random.normal((B, Hkv, Lk, D), key=k2).astype(dtype),
        mx.random.normal((B, Hkv, Lk, D), key=k3).astype(dtype),
    )


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=["f32", "bf16", "f16"])
def test_reference_matches_mlx_attention(shape, dtype):
    q, k, v = inputs(*shape, dtype, 1)
    scale = shape[-1] ** -0.5
    mask = "causal" if shape[2] > 1 else None
    want = mx.fast.scaled_dot_product_attention(
        q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32), scale=scale, mask=mask
    )
    got = inv.invariant_attention_reference(q, k, v, scale)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    assert mx.allclose(got.astype(mx.float32), want, atol=tol, rtol=tol).item()


def check_invariance(fn, dtype):
    """Row i of a 16-query call over Lk keys == a 1-query call at the same position (keys up to it)."""
    B, H, Lq, Hkv, Lk, D = 1, 4, 16, 2, 333, 64
    q, k, v = inputs(B, H, Lq, Hkv, Lk, D, dtype, 2)
    full = fn(q, k, v, 0.125)
    mx.eval(full)
    for i in range(Lq):
        n = Lk - Lq + i + 1
        one = fn(q[:, :, i : i + 1], k[:, :, :n], v[:, :, :n], 0.125)
        assert mx.array_equal(one[:, :, 0], full[:, :, i]).item(), f"row {i}"
        # the same row inside a block that starts at that row, with more keys behind it
        if i + 4 <= Lq:
            blk = fn(q[:, :, i : i + 4], k[:, :, : n + 3], v[:, :, : n + 3], 0.125)
            assert mx.array_equal(blk[:, :, 0], full[:, :, i]).item(), f"row {i} in a 4-block"


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_reference_is_width_invariant(dtype):
    check_invariance(inv.invariant_attention_reference, dtype)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_cpu_row_form_matches_the_reference_and_is_width_invariant(dtype):
    """The CPU path (each query row alone through MLX's own attention over its causal keys: the
    plain step's call, whatever the block width; OpenBLAS rounds a row with the row count)."""
    q, k, v = inputs(1, 4, 16, 2, 300, 64, dtype, 6)
    got = inv.invariant_attention_rows(q, k, v, 0.125)
    want = inv.invariant_attention_reference(q, k, v, 0.125)
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=tol, rtol=tol).item()
    check_invariance(inv.invariant_attention_rows, dtype)


# ------------------------------------------------------------------------------ compile checks
def _parse_tools():
    import test_metal_check as tmc

    extra = "float expf(float);\n"
    return tmc.parse, tmc.METAL_STUB, tmc.CUDA_STUB + extra


FORMS = ["", "shared", "rows"]
FORM_IDS = ["end-aligned", "offset", "row-offsets"]


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("dt", ["float32", "float16", "bfloat16"])
def test_metal_instance_parses(dt, form):
    parse, metal_stub, _ = _parse_tools()
    n_off = 4 if form == "rows" else 1
    ins = [(dt, 4, 10**4), (dt, 4, 10**5), (dt, 4, 10**5), ("float32", 1, 1)] + [("int32", 1, n_off)] * bool(form)
    src = kt.metal_kernel_text(inv.metal_instance(form), ins, [dt], [("T", dt)])
    assert "q_strides" in src and "constant float* scale" in src
    assert ("constant int* off" in src) == bool(form)
    assert ("off[b]" in src) == (form == "rows")
    assert parse(src, metal_stub, f"ia_metal_{dt}_{form}") == []


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("dt", ["float32", "float16", "bfloat16"])
def test_cuda_instance_parses(dt, form):
    parse, _, cuda_stub = _parse_tools()
    ins = [(dt, 4), (dt, 4), (dt, 4), ("float32", 1)] + [("int32", 1)] * bool(form)
    src = kt.cuda_kernel_text(inv.cuda_instance(form), ins, [dt], [("T", dt)])
    assert parse(src, cuda_stub, f"ia_cuda_{dt}_{form}") == []


def test_an_unknown_offset_form_is_refused():
    with pytest.raises(ValueError, match="offset form"):
        inv.cuda_instance("per-row")


def _buffer_with_stale_tail(k, v, extra, i):
    """k / v written into a longer KV buffer whose positions past them hold other values (what a
    compiled decode step's buffer holds after a rollback)."""
    B, Hkv, Lk, D = k.shape
    s1, s2 = mx.random.split(mx.random.key(SEED * 7 + i))
    tail_k = (mx.random.normal((B, Hkv, extra, D), key=s1) * 50).astype(k.dtype)
    tail_v = (mx.random.normal((B, Hkv, extra, D), key=s2) * 50).astype(v.dtype)
    return mx.concatenate([k, tail_k], axis=2), mx.concatenate([v, tail_v], axis=2)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_offset_form_reads_only_the_rows_keys(shape, dtype):
    """The offset form over a buffer with a stale tail equals the end-aligned form over exactly
    the valid keys, bitwise (the reference; the CUDA instance below)."""
    i = SHAPES.index(shape)
    q, k, v = inputs(*shape, dtype, i)
    kb, vb = _buffer_with_stale_tail(k, v, 128 + 3 * i, i)
    off = mx.array(k.shape[2] - q.shape[2], dtype=mx.int32)
    want = inv.invariant_attention_reference(q, k, v, 0.125)
    got = inv.invariant_attention_reference(q, kb, vb, 0.125, off)
    assert mx.array_equal(got, want).item()


def _rows_case(dtype, i, B=4, H=6, Hkv=2, Lq=5, D=64, cap=300):
    """B rows' queries and one shared [B, Hkv, cap, D] buffer, each row at its own position (one
    near the buffer's end, one at 0) with a stale tail past it."""
    ks = mx.random.split(mx.random.key(SEED * 11 + i), 3)
    q = mx.random.normal((B, H, Lq, D), key=ks[0]).astype(dtype)
    kb = (mx.random.normal((B, Hkv, cap, D), key=ks[1]) * 3).astype(dtype)
    vb = (mx.random.normal((B, Hkv, cap, D), key=ks[2]) * 3).astype(dtype)
    offs = [cap - Lq, 0] + [int(x) for x in mx.random.randint(1, cap - Lq, (B - 2,), key=ks[0]).tolist()]
    return q, kb, vb, offs


def _each_row(attention, q, kb, vb, offs):
    """Row b alone through the shared-position form over its own slice of the buffer."""
    rows = [
        attention(q[b : b + 1], kb[b : b + 1], vb[b : b + 1], mx.array(o, dtype=mx.int32)) for b, o in enumerate(offs)
    ]
    return mx.concatenate(rows, axis=0)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_row_offsets_compute_each_row_as_its_own_offset_form(dtype):
    """The "rows" form (a position per batch row, one buffer for all rows) equals each row's own
    shared-position call bitwise, whatever the other rows' positions (the reference)."""
    for i in range(3):
        q, kb, vb, offs = _rows_case(dtype, i)
        ref = lambda q_, k_, v_, off: inv.invariant_attention_reference(q_, k_, v_, 0.125, off)
        got = inv.invariant_attention_reference(q, kb, vb, 0.125, mx.array(offs, dtype=mx.int32))
        assert mx.array_equal(got, _each_row(ref, q, kb, vb, offs)).item(), offs


def test_row_offsets_must_name_every_row():
    q, kb, vb, _ = _rows_case(mx.float32, 0)
    with pytest.raises(ValueError, match="row positions"):
        inv.invariant_attention_gpu(q, kb, vb, 0.125, offset=mx.array([1, 2], dtype=mx.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=["f32", "bf16", "f16"])
def test_cuda_row_offsets_equal_each_rows_own_launch(dtype):
    try:
        mx.set_default_device(mx.gpu)
        for i in range(3):
            q, kb, vb, offs = _rows_case(dtype, i)
            gpu = lambda q_, k_, v_, off: inv.invariant_attention_gpu(q_, k_, v_, 0.125, offset=off)
            got = inv.invariant_attention_gpu(q, kb, vb, 0.125, offset=mx.array(offs, dtype=mx.int32))
            assert mx.array_equal(got, _each_row(gpu, q, kb, vb, offs)).item(), offs
    finally:
        mx.set_default_device(mx.cpu)


@pytest.mark.gpu
@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=["f32", "bf16", "f16"])
def test_cuda_offset_form_equals_the_end_aligned_kernel(shape, dtype):
    i = SHAPES.index(shape)
    try:
        mx.set_default_device(mx.gpu)
        q, k, v = inputs(*shape, dtype, i)
        kb, vb = _buffer_with_stale_tail(k, v, 200 + i, i)
        off = mx.array(k.shape[2] - q.shape[2], dtype=mx.int32)
        want = inv.invariant_attention_gpu(q, k, v, 0.125)
        got = inv.invariant_attention_gpu(q, kb, vb, 0.125, offset=off)
        assert mx.array_equal(got, want).item()
    finally:
        mx.set_default_device(mx.cpu)


def test_a_broken_body_fails_both_compile_checks():
    parse, metal_stub, cuda_stub = _parse_tools()
    good = inv.metal_instance()
    body = good.header.replace("ds_ia_block_max(c, s, red)", "ds_ia_block_max(c, s)")
    assert body != good.header
    m = gs.Instance(good.name, good.input_names, good.output_names, good.source, body)
    src = kt.metal_kernel_text(m, [("float32", 4, 10**4)] * 3 + [("float32", 1, 1)], ["float32"], [("T", "float32")])
    assert parse(src, metal_stub, "ia_broken_metal")
    cg = inv.cuda_instance()
    c = gs.Instance(cg.name, cg.input_names, cg.output_names, cg.source, body)
    assert parse(
        kt.cuda_kernel_text(c, [("float32", 4)] * 4, ["float32"], [("T", "float32")]), cuda_stub, "ia_broken_cuda"
    )


def test_gpu_body_runs_on_cpu_threads(tmp_path):
    """The body itself (not a reference) on the CPU: one std::thread per GPU thread, barriers and
    SIMD shuffles emulated (tests/emulation/invariant_attention_emu.cpp): matches a float64
    attention and is bitwise width-invariant. g++ is needed anyway: MLX's CPU backend compiles with it."""
    kt.run_gpu_body_on_cpu("invariant_attention_emu.cpp", tmp_path)


# ---------------------------------------------------------------------------------- on the GPU
cuda = [pytest.mark.gpu, pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")]


@pytest.fixture
def on_gpu():
    mx.set_default_device(mx.gpu)
    yield
    mx.set_default_device(mx.cpu)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.gpu
@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")
def test_cuda_matches_reference(shape, dtype, on_gpu):
    q, k, v = inputs(*shape, dtype, 3)
    scale = shape[-1] ** -0.5
    got = inv.invariant_attention_gpu(q, k, v, scale, lang="cuda")
    want = inv.invariant_attention_reference(q, k, v, scale)
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    assert (
        got.dtype == dtype and mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=tol, rtol=tol).item()
    )


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
@pytest.mark.gpu
@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")
def test_cuda_is_width_invariant(dtype, on_gpu):
    check_invariance(lambda q, k, v, s: inv.invariant_attention_gpu(q, k, v, s, lang="cuda"), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")
def test_cuda_reads_a_cache_slice_through_its_strides(on_gpu):
    q, k, v = inputs(1, 4, 16, 2, 512, 64, mx.bfloat16, 4)
    ks, vs = k[:, :, :300], v[:, :, :300]  # a KV-cache view: rows of a longer buffer
    got = inv.invariant_attention_gpu(q, ks, vs, 0.125, lang="cuda")
    want = inv.invariant_attention_gpu(q, ks + 0, vs + 0, 0.125, lang="cuda")
    assert mx.array_equal(got, want).item()
