"""The v2 GPU body of the invariant linear op (kernels/gpu/invariant_linear_v2.h, picked by
MLX_DSPARK_IL_KERNEL=v2|v2c1|v2c2|v2c4; v1 stays the default): its launch plans (a stand-in
kernel), compile checks of its Metal and CUDA instances for every C (libclang; nvcc where it is
installed, with the registers per instance and no spills), the Metal placeholder / grouping rule
for both bodies, and (on the device, `pytest -m gpu`) v2 == v1 bitwise and rows invariant in the
width for every dtype, affine bits x group, C and sibling group. The body's arithmetic against
v1 on CPU fibers: test_kernels_invariant_linear.py::test_v2_body_equals_v1_bitwise_on_cpu_fibers."""

from __future__ import annotations

import re
import shutil

import kernel_text as kt
import mlx.core as mx
import mlx.nn as nn
import pytest
from test_invariant_linear_groups import reference_outputs
from test_kernels_invariant_linear import DT_IDS, DTYPES, MAX_M, QUANTS, SEED, assert_rows_invariant, quantized, rand

from mlx_dspark.kernels import gpu_source as gs
from mlx_dspark.kernels import invariant_linear as il

COLS = (1, 2, 4)
V2 = tuple(f"v2c{c}" for c in COLS)
DT_NAMES = ("float32", "float16", "bfloat16")


# ------------------------------------------------------------------------- choice and plans
def test_kernel_choice_reads_the_env(monkeypatch):
    monkeypatch.delenv("MLX_DSPARK_IL_KERNEL", raising=False)
    assert il.kernel_choice() == "v1"  # the default
    for k in il.KERNELS:
        monkeypatch.setenv("MLX_DSPARK_IL_KERNEL", f" {k.upper()} ")
        assert il.kernel_choice() == k
    monkeypatch.setenv("MLX_DSPARK_IL_KERNEL", "v3")
    with pytest.warns(UserWarning, match="MLX_DSPARK_IL_KERNEL"):
        assert il.kernel_choice() == "v1"


def test_v2_cols_by_shape():
    for c in COLS:
        assert il.v2_cols((576,), f"v2c{c}") == c
    # "v2": the largest C that still leaves V2_MIN_WARPS warps
    assert il.v2_cols((576,)) == 1 and il.v2_cols((576, 192, 192)) == 1  # q/o, q/k/v of the 135M
    assert il.v2_cols((1536,)) == 2  # gate or up alone: 768 warps at C = 2, 384 at C = 4
    assert il.v2_cols((1536, 1536)) == 4 and il.v2_cols((49152,)) == 4  # gate+up, lm_head
    n = il.V2_MIN_WARPS
    assert il.v2_cols((4 * n,)) == 4 and il.v2_cols((4 * n - 4,)) == 2 and il.v2_cols((2 * n - 2,)) == 1
    assert il.grid((576,), 1) == (576 // 4 * 128, 1, 1)  # v1's: one warp per column
    assert il.grid((4, 3), 2) == (128, 1, 1) and il.grid((5, 3), 2) == (256, 1, 1)  # ceil per weight: 3 + 2


def _fake_kernels(calls):
    """Stand-ins for the JIT kernels (v1 and v2): the reference of each of the G weights, from
    exactly the inputs, template and launch shape the plan gives them."""

    def make(version):
        def fake(lang, kind, group=1):
            def run(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
                t = dict(template)
                x = inputs[0]
                Ns = [s[-1] for s in output_shapes]
                C = t.get("C", 1)
                assert ("C" in t) == (version == "v2") and C in COLS
                assert threadgroup == (il.THREADS, 1, 1) and len(Ns) == group == len(output_dtypes)
                warps = sum(-(-n // C) for n in Ns)
                assert grid == (-(-warps // 4) * il.THREADS, 1, 1) and t["T"] == x.dtype == output_dtypes[0]
                outs = reference_outputs(kind, group, inputs, t)
                calls.append((version, kind, group, C))
                return outs

            return run

        return fake

    return make("v1"), make("v2")


@pytest.fixture
def fake_gpu(monkeypatch):
    from mlx_dspark.compat import route_linears_to_invariant_op

    route_linears_to_invariant_op()
    calls = []
    v1, v2 = _fake_kernels(calls)
    monkeypatch.setattr(il, "_kernel", v1)
    monkeypatch.setattr(il, "_kernel_v2", v2)
    monkeypatch.setattr(il, "linear_path", lambda: "cuda")
    il.reset()
    yield calls
    il.reset()


@pytest.mark.parametrize("kernel", ["v1", "v2"] + list(V2))
def test_plans_launch_the_chosen_body(fake_gpu, monkeypatch, kernel):
    monkeypatch.setenv("MLX_DSPARK_IL_KERNEL", kernel)
    x = rand((2, 3, 64), mx.float32, 90)
    lin = nn.Linear(64, 37)
    assert mx.allclose(il.call(lin, x), lin(x), atol=1e-5).item()
    q = nn.QuantizedLinear(64, 16, bits=4, group_size=32)
    assert mx.allclose(il.call(q, x), q(x), atol=1e-4).item()
    want_c = {"v1": 1, "v2": 1}.get(kernel) or int(kernel[3:])
    version = "v1" if kernel == "v1" else "v2"
    assert fake_gpu == [(version, "dense", 1, want_c), (version, "affine", 1, want_c)]
    # an explicit kernel (benchmarks) over the env's; the sibling groups take the env's
    fake_gpu.clear()
    assert mx.allclose(il.layer_plan(lin, "v2c2")(x), lin(x), atol=1e-5).item()
    assert mx.allclose(il.layer_plan(lin, "v1")(x), lin(x), atol=1e-5).item()
    pair = [lin, nn.Linear(64, 5)]
    outs = il.layer_plan(pair, "v2c4")(x)  # a list of layers: their one launch
    assert len(outs) == 2 and all(mx.allclose(o, lay(x), atol=1e-5).item() for o, lay in zip(outs, pair))
    assert fake_gpu == [("v2", "dense", 1, 2), ("v1", "dense", 1, 1), ("v2", "dense", 2, 4)]
    fake_gpu.clear()
    xs = rand((4, 64), mx.float32, 91)
    ws = [rand((n, 64), mx.float32, 92 + n, 0.05) for n in (24, 9, 9)]
    bs = [rand((24,), mx.float32, 95), None, rand((9,), mx.float32, 96)]
    for o, w, b in zip(il.dense_gpu_group(xs, ws, bs), ws, bs):
        assert mx.allclose(o, il.invariant_linear_reference(xs, w, bias=b), atol=1e-5).item()
    assert fake_gpu == [(version, "dense", 3, want_c)]


def test_v2_siblings_share_one_launch(fake_gpu, monkeypatch, model_dir):
    import mlx_dspark as md
    from mlx_dspark.kernels import invariant

    monkeypatch.setenv("MLX_DSPARK_IL_KERNEL", "v2c4")
    path = model_dir("llama", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, seed=5)
    target, _ = md.load_target(str(path), dtype="float32", probe=False)
    assert il.group_siblings(target.model) == 4
    mlp = target.model.model.layers[0].mlp
    x = rand((1, 3, 64), mx.float32, 97)
    want = [mlp.gate_proj(x), mlp.up_proj(x)]
    with invariant.active():
        got = [mlp.gate_proj(x), mlp.up_proj(x)]
    assert fake_gpu == [("v2", "dense", 2, 4)]
    assert all(mx.allclose(g, w, atol=1e-4).item() for g, w in zip(got, want))


def test_the_verdict_key_knows_the_kernel(monkeypatch, model_dir):
    import mlx_dspark as md
    from mlx_dspark.models import invariance

    target, _ = md.load_target(str(model_dir("llama", layers=1, hidden=64, seed=3)), dtype="float32", probe=False)
    monkeypatch.delenv("MLX_DSPARK_IL_KERNEL", raising=False)
    a = invariance._verdict_key(target, "auto")
    monkeypatch.setenv("MLX_DSPARK_IL_KERNEL", "v2c2")
    b = invariance._verdict_key(target, "auto")
    assert a != b and b["env"]["MLX_DSPARK_IL_KERNEL"] == "v2c2"
    assert invariance._verdict_file(a) != invariance._verdict_file(b)


# ------------------------------------------------------------------ Metal placeholders / groups
def _parse_tools():
    import test_metal_check as tmc

    return tmc.parse, tmc.METAL_STUB, tmc.CUDA_STUB


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_metal_mixed_bias_group_needs_a_device_placeholder(v2):
    """A Metal group of a layer with a bias and one without: the placeholder must be a `device`
    buffer like the bias (>= 8 elements), else the body's one bias type does not deduce."""
    parse, metal_stub, _ = _parse_tools()
    assert il._no_bias(mx.float32).size >= il.MIN_DEVICE_ELEMS == 8
    tmpl = [("T", "float32")] + ([("C", 2)] if v2 else []) + [("HB", 1)]
    inst = il.instance("metal", "dense", 2, v2=v2)

    def src(placeholder):
        ins = [("float32", 2, 10**4)] * 3 + [("float32", 1, 64), ("float32", 1, placeholder)]
        return kt.metal_kernel_text(inst, ins, ["float32"] * 2, tmpl)

    assert parse(src(il.MIN_DEVICE_ELEMS), metal_stub, "il_mixed_ok") == []
    assert any("no matching function" in e for e in parse(src(1), metal_stub, "il_mixed_constant"))


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_metal_single_layer_takes_constant_buffers(v2):
    """One layer with arrays under 8 elements (a 4-wide bias, 2-bit 64 x 1 packs, one scale): Metal
    passes them `constant`; alone (each pointer repeated for the unused weights) it compiles."""
    parse, metal_stub, _ = _parse_tools()
    dt = "bfloat16"
    C = [("C", 4)] if v2 else []
    dense = il.instance("metal", "dense", 1, v2=v2)
    src = kt.metal_kernel_text(
        dense, [(dt, 2, 8 * 64), (dt, 2, 4 * 64), (dt, 1, 4)], [dt], [("T", dt)] + C + [("HB", 1)]
    )
    assert parse(src, metal_stub, "il_small_dense") == []
    affine = il.instance("metal", "affine", 1, v2=v2)
    ins = [(dt, 2, 8 * 64), ("uint32", 2, 4), (dt, 2, 1), (dt, 2, 1), (dt, 1, 1)]
    src = kt.metal_kernel_text(affine, ins, [dt], [("T", dt), ("BITS", 2)] + C + [("HB", 1)])
    assert parse(src, metal_stub, "il_small_affine") == []


def test_metal_groups_only_device_buffers(fake_gpu):
    big = [nn.Linear(64, 16), nn.Linear(64, 16, bias=False)]
    small = [nn.Linear(64, 16), nn.Linear(64, 4)]  # a 4-element bias: `constant` on Metal
    for path in ("cuda", "metal"):
        assert il._gpu_plan(big, False, path) is not None
        assert il._gpu_plan(small[1:], False, path) is not None  # alone: one pointer, any space
    assert il._gpu_plan(small, False, "cuda") is not None
    assert il._gpu_plan(small, False, "metal") is None
    q = [nn.QuantizedLinear(64, 1, bits=4, group_size=64), nn.QuantizedLinear(64, 16, bits=4, group_size=64)]
    assert il._gpu_plan(q, False, "metal") is None and il._gpu_plan(q, False, "cuda") is not None


# ------------------------------------------------------------------------------ compile checks
def _tmpl(dt, C, hb, bits=0):
    return [("T", dt)] + ([("BITS", bits)] if bits else []) + ([("C", C)] if C else []) + [("HB", hb)]


def metal_src(kind, G, dt, C, bits=4, hb=None):
    inst = il.instance("metal", kind, G, v2=bool(C))
    per = [("uint32", 2, 10**5), (dt, 2, 10**3), (dt, 2, 10**3)] if kind == "affine" else [(dt, 2, 10**5)]
    ins = [(dt, 2, 10**4)] + per * G + [(dt, 1, 64)] * G
    hb = (1 << G) - 1 if hb is None else hb
    return kt.metal_kernel_text(inst, ins, [dt] * G, _tmpl(dt, C, hb, bits if kind == "affine" else 0))


def cuda_src(kind, G, dt, C, bits=4, hb=None):
    inst = il.instance("cuda", kind, G, v2=bool(C))
    per = [("uint32", 2), (dt, 2), (dt, 2)] if kind == "affine" else [(dt, 2)]
    ins = [(dt, 2)] + per * G + [(dt, 1)] * G
    hb = (1 << G) - 1 if hb is None else hb
    return kt.cuda_kernel_text(inst, ins, [dt] * G, _tmpl(dt, C, hb, bits if kind == "affine" else 0))


@pytest.mark.parametrize("C", COLS)
@pytest.mark.parametrize("dt", DT_NAMES)
@pytest.mark.parametrize("lang", ["metal", "cuda"])
def test_v2_instances_parse(lang, dt, C):
    parse, metal_stub, cuda_stub = _parse_tools()
    src, stub = (metal_src, metal_stub) if lang == "metal" else (cuda_src, cuda_stub)
    for G, hb in ((1, 0), (1, 1), (2, 2), (3, 5)):
        assert parse(src("dense", G, dt, C, hb=hb), stub, f"il2_{lang}_{dt}_c{C}_g{G}") == []
    for bits in il.BITS:
        assert parse(src("affine", 1, dt, C, bits, hb=1), stub, f"il2q{bits}_{lang}_{dt}_c{C}") == []
    assert parse(src("affine", 3, dt, C, 8, hb=2), stub, f"il2q8g3_{lang}_{dt}_c{C}") == []


def test_a_broken_v2_body_fails_both_compile_checks():
    parse, metal_stub, cuda_stub = _parse_tools()
    call = "ds_il2_rows<R, C, VL>(x, m0, M, K, k, wv, acc);"
    for lang, stub, kt_text, ins in (
        ("metal", metal_stub, kt.metal_kernel_text, [("float32", 2, 10**4)] * 2 + [("float32", 1, 8)]),
        ("cuda", cuda_stub, kt.cuda_kernel_text, [("float32", 2)] * 2 + [("float32", 1)]),
    ):
        good = il.instance(lang, "dense", 1, v2=True)
        assert good.header.count(call) == 2  # the dense and the affine pass
        body = good.header.replace(call, "ds_il2_rows<R, C, VL>(x, m0, M, K, k, acc);")  # wv left out
        bad = gs.Instance(good.name, good.input_names, good.output_names, good.source, body)
        assert parse(kt_text(bad, ins, ["float32"], _tmpl("float32", 2, 0)), stub, f"il2_broken_{lang}")


def _nvcc_resources(sources: dict, tmp_path) -> dict:
    """nvcc (sm_90, device code) over kernel texts; name -> (registers, spill bytes)."""
    import subprocess

    from test_moe_invariant_gather import NVCC_PRELUDE

    src = NVCC_PRELUDE + "".join(re.sub(r"custom_kernel_\w+\(", f"k_{n}(", t, count=1) for n, t in sources.items())
    (tmp_path / "k.cu").write_text(src)
    run = subprocess.run(
        [shutil.which("nvcc"), "-std=c++17", "-arch=sm_90", "--resource-usage", "-c", str(tmp_path / "k.cu")]
        + ["-o", str(tmp_path / "k.o")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got, name = {}, None
    for line in (run.stdout + run.stderr).splitlines():
        m = re.search(r"Compiling entry function '_Z\w*?\d+k_(\w+?)E", line)
        if m:
            name = m.group(1)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            got.setdefault(name, [0, int(m.group(1)) + int(m.group(2))])
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            got.setdefault(name, [0, 0])[0] = int(m.group(1))
    return got


@pytest.mark.skipif(not shutil.which("nvcc"), reason="needs nvcc (the CUDA compiler; CI's machine has it)")
def test_v1_and_v2_compile_with_nvcc_without_spills(tmp_path):
    """Every C of v2 (and v1 beside it) through nvcc for the H200 (sm_90): compiles, and ptxas
    reports no spills. Registers (nvcc 13.0, sm_90, every dtype): v1 35-48, v2 C=1
    66-80, C=2 78-114, C=4 136-168: no spill, but at C = 4 three 128-thread blocks fit an SM."""
    srcs = {}
    for dt in DT_NAMES:
        for C in (0,) + COLS:
            v = f"c{C}" if C else "v1"
            srcs[f"{dt}_dense_{v}_g1_"] = cuda_src("dense", 1, dt, C, hb=1)
            srcs[f"{dt}_q4_{v}_g1_"] = cuda_src("affine", 1, dt, C, 4, hb=0)
            if dt == "bfloat16":
                srcs[f"{dt}_dense_{v}_g3_"] = cuda_src("dense", 3, dt, C, hb=5)
                srcs[f"{dt}_q8_{v}_g3_"] = cuda_src("affine", 3, dt, C, 8, hb=0)
                srcs[f"{dt}_q2_{v}_g1_"] = cuda_src("affine", 1, dt, C, 2, hb=1)
    res = _nvcc_resources(srcs, tmp_path)
    print("\nnvcc sm_90 registers / spill bytes:\n" + "\n".join(f"  {n:28s} {r} / {s}" for n, (r, s) in res.items()))
    assert sorted(n.rstrip("_") for n in res) == sorted(n.rstrip("_") for n in srcs), res
    assert all(s == 0 for _, s in res.values()), res
    assert all(r <= 200 for r, _ in res.values()), res


# ---------------------------------------------------------------------------------- on the GPU
needs_cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")
DENSE_SHAPES = [(576, 192), (1536, 576), (576, 49152), (520, 37)]  # (K, N): K past 256 steps, odd N


def _check_v2(fn, x, label):
    """fn(rows, kernel): every v2 output == v1's bitwise, and v2's rows invariant in the width."""
    want = fn(x, "v1")
    for kernel in V2:
        got = fn(x, kernel)
        mx.eval(got, want)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert mx.array_equal(got, want).item(), f"{label} {kernel}: differs from v1 (seed {SEED})"
        assert_rows_invariant(lambda r, k=kernel: fn(r, k), x, f"{label} {kernel}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("KN", DENSE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cuda_v2_dense_equals_v1(dtype, with_bias, KN):
    K, N = KN
    i = 200 + 10 * DENSE_SHAPES.index(KN)
    with mx.stream(mx.gpu):
        w = rand((N, K), dtype, i, 0.05)
        b = rand((N,), dtype, i + 1) if with_bias else None
        x = rand((MAX_M + 2, K), dtype, i + 2)
        _check_v2(lambda r, k: il.dense_gpu(r, w, b, kernel=k), x, f"cuda v2 dense {dtype} {KN}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("bits,group", QUANTS)
def test_cuda_v2_affine_equals_v1(dtype, bits, group):
    K, N = 1536, 579
    with mx.stream(mx.gpu):
        wq, s, z = quantized(N, K, dtype, bits, group, 240 + bits + group)
        b = rand((N,), dtype, 241) if bits == 4 else None
        x = rand((MAX_M + 2, K), dtype, 242)
        _check_v2(lambda r, k: il.affine_gpu(r, wq, s, z, bits, b, kernel=k), x, f"cuda v2 q{bits}g{group} {dtype}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_cuda_v2_groups_equal_v1(dtype):
    K = 576
    with mx.stream(mx.gpu):
        ws = [rand((n, K), dtype, 250 + i, 0.05) for i, n in enumerate((576, 192, 197))]
        bs = [rand((576,), dtype, 254), None, rand((197,), dtype, 255)]
        x = rand((MAX_M + 2, K), dtype, 256)
        for g in range(3):
            _check_v2(lambda r, k, g=g: il.dense_gpu_group(r, ws, bs, kernel=k)[g], x, f"cuda v2 group {g} {dtype}")
        for bits in il.BITS:
            qs = [quantized(n, K, dtype, bits, 64, 260 + i) for i, n in enumerate((1536, 1533))]
            qb = [None, rand((1533,), dtype, 263)]
            for g in range(2):
                _check_v2(
                    lambda r, k, g=g: il.affine_gpu_group(r, qs, bits, qb, kernel=k)[g], x, f"v2 q{bits} group {g}"
                )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_cuda_v2_unaligned_input_equals_v1(dtype):
    """x at an 8-byte offset (a view into a flat buffer; where MLX passes it as it is, CUDA's
    scalar-load path): still v1's bits."""
    K, N = 576, 1536
    with mx.stream(mx.gpu):
        w = rand((N, K), dtype, 270, 0.05)
        flat = rand(((MAX_M + 2) * K + 8,), dtype, 271)
        wq, s, z = quantized(N, K, dtype, 4, 64, 272)
        for off in (0, 8 // dtype.size):
            x = flat[off : off + (MAX_M + 2) * K].reshape(MAX_M + 2, K)
            _check_v2(lambda r, k: il.dense_gpu(r, w, kernel=k), x, f"cuda v2 dense off {off} {dtype}")
            _check_v2(lambda r, k: il.affine_gpu(r, wq, s, z, 4, kernel=k), x, f"cuda v2 q4 off {off} {dtype}")
