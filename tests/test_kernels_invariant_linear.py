"""The width-invariant linear op (kernels/invariant_linear.py): the pure-MLX reference against MLX's
own products, bitwise invariance of every path in the number of rows (row i of an M-row call ==
the same row alone, M = 1..17; the CPU kernels also up to 34 rows on odd shapes), the GPU body
run on CPU threads, compile checks of its Metal and CUDA instances (Linux, libclang), and (on the
device, `pytest -m gpu`) the CUDA instance."""

from __future__ import annotations

import os
import random

import kernel_text as kt
import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_dspark.kernels import gpu_source as gs
from mlx_dspark.kernels import invariant_linear as il
from mlx_dspark.kernels import native

SEED = int(os.environ.get("MLX_DSPARK_TEST_SEED", random.randrange(2**31)))
DTYPES = [mx.float32, mx.bfloat16, mx.float16]
DT_IDS = ["f32", "bf16", "f16"]
QUANTS = [(b, g) for b in il.BITS for g in il.GROUPS]
MAX_M = 17


def rand(shape, dtype, i, scale=1.0):
    return (mx.random.normal(shape, key=mx.random.key(SEED * 1000 + i)) * scale).astype(dtype)


def quantized(N, K, dtype, bits, group, i):
    w = rand((N, K), mx.float32, i, 0.05)
    wq, s, b = mx.quantize(w, group_size=group, bits=bits)
    return wq, s.astype(dtype), b.astype(dtype)


def assert_rows_invariant(fn, x, label):
    """fn(x[i:i+M]) row r == fn(x[i+r : i+r+1]) bitwise, for M = 1..MAX_M and several i."""
    ones = [fn(x[m : m + 1]) for m in range(x.shape[0])]
    mx.eval(ones)
    for M in range(1, MAX_M + 1):
        for i in sorted({0, x.shape[0] - M}):
            rows = fn(x[i : i + M])
            mx.eval(rows)
            for r in range(M):
                assert mx.array_equal(rows[r], ones[i + r][0]).item(), (
                    f"{label}: row {r} of an {M}-row call (seed {SEED})"
                )


# ------------------------------------------------------------------------------- reference
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_reference_matches_mlx_dense(dtype):
    x, w, b = rand((9, 264), dtype, 1), rand((70, 264), dtype, 2, 0.05), rand((70,), dtype, 3)
    want = (x.astype(mx.float32) @ w.astype(mx.float32).T + b.astype(mx.float32)).astype(dtype)
    got = il.invariant_linear_reference(x, w, bias=b)
    assert got.dtype == dtype and got.shape == (9, 70)
    tol = 1e-5 if dtype == mx.float32 else 1e-2
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=tol, rtol=tol).item()


@pytest.mark.parametrize("bits,group", QUANTS)
def test_reference_matches_mlx_quantized_matmul(bits, group):
    K = 384
    x = rand((5, K), mx.float32, 4)
    wq, s, b = quantized(48, K, mx.float32, bits, group, 5)
    want = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=group, bits=bits)
    got = il.invariant_linear_reference(x, wq, s, b, group_size=group, bits=bits)
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()


# ------------------------------------------------------------------------- CPU paths
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_rowwise_path_is_invariant(dtype):
    w, b = rand((40, 136), dtype, 6, 0.05), rand((40,), dtype, 7)
    x = rand((MAX_M + 3, 136), dtype, 8)
    assert_rows_invariant(lambda r: il.rowwise(r, lambda one: one @ w.T + b), x, f"rowwise {dtype}")


needs_native = pytest.mark.skipif(
    native.ext(warn=False) is None or not hasattr(native.ext(warn=False), "invariant_linear"),
    reason="needs the built extension (pip install .)",
)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_native_cpu_matches_the_reference_and_is_invariant(dtype, with_bias):
    ext = native.ext(warn=False)
    K, N = 1544, 97  # K: past the kernel's vector blocks with a tail; N: not a multiple of anything
    w = rand((N, K), dtype, 9, 0.05)
    b = rand((N,), dtype, 10) if with_bias else None
    x = rand((MAX_M + 2, K), dtype, 11)
    with mx.stream(mx.cpu):
        got = ext.invariant_linear(x, w, b)
        want = il.invariant_linear_reference(x, w, bias=b)
        tol = 1e-5 if dtype == mx.float32 else 1e-2
        assert got.dtype == dtype and got.shape == (MAX_M + 2, N)
        assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=tol, rtol=tol).item()
        assert_rows_invariant(lambda r: ext.invariant_linear(r, w, b), x, f"native {dtype}")


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_native_cpu_takes_leading_axes_and_strided_inputs_as_they_come(dtype):
    """[..., M, K] in, [..., M, N] out, and an x that is a transposed view or a weight that is not
    contiguous give, bitwise, what the contiguous 2-D call gives (the op reads them through
    cpu::RowOrder instead of a contiguous node)."""
    ext = native.ext(warn=False)
    K, N = 72, 23
    w = rand((N, K), dtype, 12, 0.05)
    b = rand((N,), dtype, 13)
    x = rand((2, 5, 3, K), dtype, 14).transpose(0, 2, 1, 3)  # [2, 3, 5, K], not row-contiguous
    with mx.stream(mx.cpu):
        flat = ext.invariant_linear(mx.contiguous(x).reshape(-1, K), w, b)
        got = ext.invariant_linear(x, w, b)
        assert got.shape == (2, 3, 5, N) and mx.array_equal(got.reshape(-1, N), flat).item()
        wt = rand((K, N), dtype, 15, 0.05).T  # a column-major weight: made contiguous by the op
        assert mx.array_equal(
            ext.invariant_linear(x, wt, None), ext.invariant_linear(x, mx.contiguous(wt), None)
        ).item()
        mx.eval(x, w, b)  # evaluated inputs, as a layer's weight is: the product is the graph's one node
        assert _graph_nodes(lambda: ext.invariant_linear(x, w, b)) == 1


def _graph_nodes(make) -> int:
    import io

    dot = io.StringIO()
    mx.export_to_dot(dot, make())
    return dot.getvalue().count("label")


# odd shapes: K below one 8-lane step, K with a 1..7 tail, N of 1 and N not a multiple of the
# tile's weight rows; widths past one row tile and past MAX_M (33 = 11 tiles of 3, 32 and 34: the
# 2- and 1-row remainder tiles after full ones)
ODD_SHAPES = [(5, 3), (13, 1), (571, 37), (576, 50), (1543, 9)]
WIDE = (1, 2, 3, 4, 5, 7, 8, 16, 17, 32, 33, 34)


@needs_native
@pytest.mark.parametrize("kernel", ["tiled", "rows"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("KN", ODD_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_native_cpu_kernels_on_odd_shapes_and_wide_calls(kernel, dtype, with_bias, KN):
    """Both CPU kernels: every row of an M-row call (M up to 34, at offsets 0 and the last)
    equals the row alone bitwise, a half-precision call is the float32 call on the widened inputs
    (rounded once), and the product is the float64 one within float tolerance."""
    import numpy as np

    ext = native.ext(warn=False)
    if os.environ.get("MLX_DSPARK_CPU_ISA"):  # the run of test_native_cpu_portable_tiles below
        assert ext.invariant_linear_isa() == os.environ["MLX_DSPARK_CPU_ISA"]
    K, N = KN
    i = 100 + 10 * ODD_SHAPES.index(KN)
    w = rand((N, K), dtype, i, 0.05)
    b = rand((N,), dtype, i + 1) if with_bias else None
    x = rand((max(WIDE) + 3, K), dtype, i + 2)
    with mx.stream(mx.cpu):
        fn = lambda r: ext.invariant_linear(r, w, b, kernel=kernel)  # noqa: E731
        ones = [fn(x[m : m + 1]) for m in range(x.shape[0])]
        mx.eval(ones)
        for M in WIDE:
            for at in sorted({0, x.shape[0] - M}):
                rows = fn(x[at : at + M])
                mx.eval(rows)
                for r in range(M):
                    assert mx.array_equal(rows[r], ones[at + r][0]).item(), (
                        f"{kernel} {dtype} {KN}: row {r} of a {M}-row call at {at} (seed {SEED})"
                    )
        if dtype != mx.float32:  # half inputs widen exactly: the float32 call on the widened values, rounded once
            f32 = lambda a: None if a is None else a.astype(mx.float32)  # noqa: E731
            widened = ext.invariant_linear(f32(x), f32(w), f32(b), kernel=kernel).astype(dtype)
            assert mx.array_equal(fn(x), widened).item(), f"{kernel} {dtype} {KN}: not the widened float32 call"
        f64 = lambda a: np.array(a.astype(mx.float32)).astype(np.float64)  # noqa: E731
        want = f64(x) @ f64(w).T + (f64(b) if with_bias else 0.0)
        got = f64(fn(x))
        tol = 1e-5 if dtype == mx.float32 else 1e-2
        assert np.allclose(got, want, atol=tol * max(1.0, np.abs(want).max()), rtol=tol), (
            f"{kernel} {dtype} {KN}: max error {np.abs(got - want).max():.3g} (seed {SEED})"
        )


@needs_native
@pytest.mark.skipif(os.environ.get("MLX_DSPARK_CPU_ISA") is not None, reason="already the portable run")
def test_native_cpu_portable_tiles():
    """The portable tiles (what a CPU without AVX2 + FMA runs; forced by MLX_DSPARK_CPU_ISA): the
    odd-shape test above in a process that picked them."""
    import subprocess
    import sys

    env = dict(os.environ, MLX_DSPARK_CPU_ISA="portable", MLX_DSPARK_TEST_SEED=str(SEED))
    k = "odd_shapes_and_wide_calls and tiled"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k", k],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]


@needs_native
def test_native_cpu_kernel_choice():
    ext = native.ext(warn=False)
    assert ext.invariant_linear_isa() in ("avx2", "portable")
    with pytest.raises(ValueError, match="kernel must be"):
        ext.invariant_linear(mx.zeros((2, 8)), mx.zeros((4, 8)), None, kernel="fast")


@needs_native
def test_native_cpu_refuses_mismatched_shapes():
    ext = native.ext(warn=False)
    with pytest.raises(ValueError, match="invariant_linear"):
        ext.invariant_linear(mx.zeros((2, 8)), mx.zeros((4, 16)), None)


def test_call_routes_layers_and_declines_what_it_cannot_take():
    lin = nn.Linear(64, 24)
    x = rand((3, 64), mx.float32, 12)
    got = il.call(lin, x)
    assert got is not None and mx.allclose(got, lin(x), atol=1e-5).item()
    emb = nn.Embedding(50, 64)
    assert mx.allclose(il.call(emb, x, as_linear=True), emb.as_linear(x), atol=1e-5).item()
    odd = nn.Linear(60, 8)  # K = 60 is not a multiple of the kernel's 8-element steps
    assert il.call(odd, rand((2, 60), mx.float32, 13)) is None
    q3 = nn.QuantizedLinear(64, 16, bits=3, group_size=32)
    assert il.call(q3, x) is None  # 3-bit packing spans words: MLX's own op (the self-check judges)


# ------------------------------------------------------------------- the body on CPU threads
def test_gpu_body_runs_on_cpu_threads(tmp_path):
    """The body itself on the CPU (tests/emulation/invariant_linear_emu.cpp): matches a float64
    product for dense and 2/4/8-bit weights at every group size, and is bitwise invariant in M."""
    kt.run_gpu_body_on_cpu("invariant_linear_emu.cpp", tmp_path)


def test_v2_body_equals_v1_bitwise_on_cpu_fibers(tmp_path):
    """The faster body (kernels/gpu/invariant_linear_v2.h, not launched yet) against v1 on CPU fibers
    (tests/emulation/invariant_linear_v2_emu.cpp): every output byte equal, random dtypes, kinds, G, C,
    K, N and M = 1..33, its scalar-load path too, rows invariant."""
    kt.run_gpu_body_on_cpu("invariant_linear_v2_emu.cpp", tmp_path)


# ------------------------------------------------------------------------------ compile checks
def _parse_tools():
    import test_metal_check as tmc

    return tmc.parse, tmc.METAL_STUB, tmc.CUDA_STUB


def _metal_src(kind, dt, has_bias, bits=4):
    inst = il.instance("metal", kind)
    if kind == "dense":
        ins = [(dt, 2, 10**4), (dt, 2, 10**5), (dt, 1, 1 if not has_bias else 64)]
        tmpl = [("T", dt), ("HB", int(has_bias))]
    else:
        ins = [(dt, 2, 10**4), ("uint32", 2, 10**5), (dt, 2, 10**3), (dt, 2, 10**3), (dt, 1, 64 if has_bias else 1)]
        tmpl = [("T", dt), ("BITS", bits), ("HB", int(has_bias))]
    return kt.metal_kernel_text(inst, ins, [dt], tmpl)


@pytest.mark.parametrize("dt", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
def test_metal_instances_parse(dt, has_bias):
    parse, metal_stub, _ = _parse_tools()
    assert parse(_metal_src("dense", dt, has_bias), metal_stub, f"il_metal_{dt}") == []
    for bits in il.BITS:
        assert parse(_metal_src("affine", dt, has_bias, bits), metal_stub, f"ilq{bits}_metal_{dt}") == []


@pytest.mark.parametrize("dt", ["float32", "float16", "bfloat16"])
def test_cuda_instances_parse(dt):
    parse, _, cuda_stub = _parse_tools()
    src = kt.cuda_kernel_text(il.instance("cuda", "dense"), [(dt, 2), (dt, 2), (dt, 1)], [dt], [("T", dt), ("HB", 1)])
    assert parse(src, cuda_stub, f"il_cuda_{dt}") == []
    for bits in il.BITS:
        src = kt.cuda_kernel_text(
            il.instance("cuda", "affine"),
            [(dt, 2), ("uint32", 2), (dt, 2), (dt, 2), (dt, 1)],
            [dt],
            [("T", dt), ("BITS", bits), ("HB", 0)],
        )
        assert parse(src, cuda_stub, f"ilq{bits}_cuda_{dt}") == []


def test_a_broken_body_fails_both_compile_checks():
    parse, metal_stub, cuda_stub = _parse_tools()
    good = il.instance("metal", "dense")
    body = good.header.replace("ds_il_accumulate(x, xo, k, wv, acc);", "ds_il_accumulate(xo, k, wv, acc);")
    assert body != good.header
    bad = gs.Instance(good.name, good.input_names, good.output_names, good.source, body)
    src = kt.metal_kernel_text(
        bad, [("float32", 2, 10**4)] * 2 + [("float32", 1, 1)], ["float32"], [("T", "float32"), ("HB", 0)]
    )
    assert parse(src, metal_stub, "il_broken_metal")
    cg = il.instance("cuda", "dense")
    c = gs.Instance(cg.name, cg.input_names, cg.output_names, cg.source, body)
    src = kt.cuda_kernel_text(c, [("float32", 2)] * 3, ["float32"], [("T", "float32"), ("HB", 0)])
    assert parse(src, cuda_stub, "il_broken_cuda")


# ---------------------------------------------------------------------------------- on the GPU
needs_cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(
    "KN", [(576, 1536), (1536, 576), (576, 49152), (4096, 1024)], ids=lambda s: "x".join(map(str, s))
)
def test_cuda_dense(dtype, with_bias, KN):
    K, N = KN
    with mx.stream(mx.gpu):
        w = rand((N, K), dtype, 20, 0.05)
        b = rand((N,), dtype, 21) if with_bias else None
        x = rand((MAX_M + 2, K), dtype, 22)
        got = il.dense_gpu(x, w, b)
        with mx.stream(mx.cpu):  # float32 on the GPU matmul may round through TF32
            want = il.invariant_linear_reference(x, w, bias=b)
        tol = 1e-4 if dtype == mx.float32 else 2e-2
        assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=tol, rtol=tol).item()
        assert_rows_invariant(lambda r: il.dense_gpu(r, w, b), x, f"cuda dense {dtype} {KN}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("bits,group", QUANTS)
def test_cuda_affine(dtype, bits, group):
    K, N = 1536, 576
    with mx.stream(mx.gpu):
        wq, s, b = quantized(N, K, dtype, bits, group, 23)
        x = rand((MAX_M + 2, K), dtype, 24)
        got = il.affine_gpu(x, wq, s, b, bits)
        with mx.stream(mx.cpu):
            want = il.invariant_linear_reference(x, wq, s, b, group_size=group, bits=bits)
        tol = 1e-4 if dtype == mx.float32 else 2e-2
        assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=tol, rtol=tol).item()
        assert_rows_invariant(lambda r: il.affine_gpu(r, wq, s, b, bits), x, f"cuda q{bits}g{group} {dtype}")


def test_gpu_plans_launch_what_the_instances_take(monkeypatch):
    """The per-layer launch plans of the GPU path, with the JIT kernel replaced by a stand-in that
    computes the reference from exactly the inputs, template and launch shape it is given (the
    kernel itself is tested on the device above and on CPU threads)."""
    calls = []

    def fake(lang, kind, group=1):
        def run(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            t = dict(template)
            x = inputs[0]
            *lead, N = output_shapes[0]
            M = 1
            for d in lead:
                M *= d
            assert tuple(x.shape[:-1]) == tuple(lead) and threadgroup == (il.THREADS, 1, 1)
            assert grid == (-(-N // il.COLS) * il.THREADS, 1, 1) and t["T"] == x.dtype == output_dtypes[0]
            if kind == "dense":
                w, b = inputs[1], inputs[2]
                y = il.invariant_linear_reference(x, w, bias=b if t["HB"] & 1 else None)
            else:
                wq, s, bb, b = inputs[1:]
                group = x.shape[-1] // s.shape[1]
                y = il.invariant_linear_reference(
                    x, wq, s, bb, bias=b if t["HB"] & 1 else None, group_size=group, bits=t["BITS"]
                )
            calls.append((kind, M, t.get("BITS")))
            return (y,)

        return run

    monkeypatch.setattr(il, "_kernel", fake)
    monkeypatch.setattr(il, "linear_path", lambda: "cuda")
    il.reset()
    try:
        x = rand((2, 3, 64), mx.float32, 40)
        lin = nn.Linear(64, 24)
        assert mx.allclose(il.call(lin, x), lin(x), atol=1e-5).item()
        emb = nn.Embedding(50, 64)
        assert mx.allclose(il.call(emb, x, as_linear=True), emb.as_linear(x), atol=1e-5).item()
        for bits in il.BITS:
            q = nn.QuantizedLinear(64, 16, bits=bits, group_size=32)
            assert mx.allclose(il.call(q, x), q(x), atol=1e-4).item()
        assert [c[0] for c in calls] == ["dense", "dense"] + ["affine"] * len(il.BITS)
        assert all(c[1] == 6 for c in calls)  # [2, 3, K] runs as one 6-row launch, no reshape
        assert il.call(nn.QuantizedLinear(64, 16, bits=3, group_size=32), x) is None
        assert il.call(lin, x.astype(mx.float16)) is None  # a dtype the weight does not have: MLX's op
    finally:
        il.reset()


def test_plans_do_not_keep_layers_alive():
    """The per-layer launch plans go with their layer (a server that swaps models frees them)."""
    import gc
    import weakref

    layer = nn.Linear(64, 8)
    alive = weakref.ref(layer)
    assert il.call(layer, rand((2, 64), mx.float32, 50)) is not None
    before = len(il._plans)
    del layer
    gc.collect()
    assert alive() is None and len(il._plans) == before - 1
