"""The width-invariant MoE expert product (kernels/invariant_gather.py): the pure-MLX reference
against MLX's gather_mm / gather_qmm, the CPU path (MLX's own gather ops, measured invariant in the
number of tokens), the GPU body on CPU threads (parity, invariance, equality with the dense kernel
on each expert's weight), compile checks of its Metal and CUDA instances, compat's routing of
mlx-lm's SwitchLinear / QuantizedSwitchLinear (with a stand-in kernel on the CPU), and, on the
device (`pytest -m gpu`), the CUDA instance and MoE fixture targets on the kernel path."""

from __future__ import annotations

import os
import random

import kernel_text as kt
import mlx.core as mx
import pytest
from family_fixtures import write_family
from fixtures import scratch_dir
from forward_rows import first_moving_op
from mlx_lm.models.switch_layers import SwitchGLU, SwitchLinear

import mlx_dspark as md
from mlx_dspark import compat
from mlx_dspark.kernels import gpu_source as gs
from mlx_dspark.kernels import invariant
from mlx_dspark.kernels import invariant_gather as ig
from mlx_dspark.kernels import invariant_linear as il

SEED = int(os.environ.get("MLX_DSPARK_TEST_SEED", random.randrange(2**31)))
DTYPES = [mx.float32, mx.bfloat16, mx.float16]
DT_IDS = ["f32", "bf16", "f16"]
QUANTS = [(b, g) for b in il.BITS for g in il.GROUPS]
MAX_T = 17
_ROOT = scratch_dir("mlx-dspark-moe-gather-")


def rand(shape, dtype, i, scale=1.0):
    return (mx.random.normal(shape, key=mx.random.key(SEED * 1000 + i)) * scale).astype(dtype)


def experts(E, N, K, dtype, i, bits=0, group=64):
    """(weight, scales, biases) of E experts [E, N, K] (dense: scales = biases = None)."""
    w = rand((E, N, K), mx.float32, i, 0.05)
    if not bits:
        return w.astype(dtype), None, None
    wq, s, b = mx.quantize(w, group_size=group, bits=bits)
    return wq, s.astype(dtype), b.astype(dtype)


def routes(T, E, k, i):
    """[T, k] distinct experts per token, as a router picks them (uint32, as mlx-lm's argpartition)."""
    scores = mx.random.uniform(shape=(T, E), key=mx.random.key(SEED * 1000 + i))
    return mx.argsort(scores, axis=-1)[:, :k].astype(mx.uint32)


def inputs(layout, T, k, K, dtype, i):
    """x as SwitchGLU hands it to a projection: gate / up [T, 1, 1, K] (a token's x for its k
    experts), down [T, k, 1, K] (one x per pair)."""
    return rand((T, 1, 1, K) if layout == "gate" else (T, k, 1, K), dtype, i)


def assert_tokens_invariant(fn, x, idx, label):
    """fn(x[:t], idx[:t]) == the tokens alone, bitwise, for t = 1..MAX_T."""
    ones = [fn(x[j : j + 1], idx[j : j + 1]) for j in range(x.shape[0])]
    mx.eval(ones)
    for t in range(1, MAX_T + 1):
        got = fn(x[:t], idx[:t])
        mx.eval(got)
        for j in range(t):
            assert mx.array_equal(got[j], ones[j][0]).item(), f"{label}: token {j} of a {t}-token call (seed {SEED})"


def sorted_call(fn, x, idx):
    """What SwitchGLU does from 64 pairs on: the pairs sorted by expert, one x row per pair
    (gate / up: the token's, down: the pair's own), then unsorted back to [T, k, 1, N]."""
    T, k = idx.shape
    flat = idx.flatten()
    order = mx.argsort(flat)
    rows = x.reshape(-1, 1, x.shape[-1])
    y = fn(rows[order // k if x.shape[1] == 1 else order], flat[order])
    return y[mx.argsort(order)].reshape(T, k, 1, -1)


# ------------------------------------------------------------------------------- reference
@pytest.mark.parametrize("layout", ["gate", "down"])
@pytest.mark.parametrize("bits,group", [(0, 0)] + QUANTS)
def test_reference_matches_mlx_gather(layout, bits, group):
    E, N, K, k, T = 6, 40, 256, 2, 9
    w, s, b = experts(E, N, K, mx.float32, 1, bits, group or 64)
    x, idx = inputs(layout, T, k, K, mx.float32, 2), routes(T, E, k, 3)
    if bits:
        want = mx.gather_qmm(x, w, s, b, rhs_indices=idx, transpose=True, group_size=group, bits=bits)
    else:
        want = mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=idx)
    got = ig.invariant_gather_reference(x, w, idx, s, b, group_size=group or 64, bits=bits)
    assert got.shape == want.shape == (T, k, 1, N) and got.dtype == mx.float32
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()


def test_operands_take_mlx_lm_layouts_without_copies_and_materialize_the_rest():
    x, idx = mx.zeros((5, 1, 1, 16)), mx.zeros((5, 2), dtype=mx.uint32)
    xo, io, S = ig.operands(x, idx)
    assert xo is x and S == (5, 2) and io.shape == (10,)  # gate / up: rep = 2, x as it comes
    x2 = mx.zeros((5, 2, 1, 16))
    assert ig.operands(x2, idx)[0] is x2  # down: one x per pair
    odd = mx.zeros((1, 2, 1, 16))  # broadcast over a leading dim: not p / rep, so materialized
    xo, io, S = ig.operands(odd, idx)
    assert S == (5, 2) and xo.shape == (5, 2, 1, 16)
    xo, io, S = ig.operands(mx.zeros((5, 1, 1, 16)), mx.zeros((2,), dtype=mx.uint32))  # idx broadcast
    assert S == (5, 2) and io.shape == (10,)
    with pytest.raises(ValueError, match="broadcast"):
        ig.operands(mx.zeros((3, 1, 16)), mx.zeros((4,), dtype=mx.uint32))


# ------------------------------------------------------------------------- CPU path
def _layer(E, N, K, dtype, i, bits=0, group=64, bias=False):
    lay = SwitchLinear(K, N, E, bias=bias)
    lay.weight = rand((E, N, K), mx.float32, i, 0.05)
    if bias:
        lay.bias = rand((E, N), mx.float32, i + 1)
    if bits:
        lay = lay.to_quantized(group_size=group, bits=bits)
        lay.scales, lay.biases = lay.scales.astype(dtype), lay.biases.astype(dtype)
        if bias:
            lay.bias = lay.bias.astype(dtype)
    else:
        lay.update({k: v.astype(dtype) for k, v in lay.parameters().items()})
    return lay


# MLX's CPU gather_mm takes float32 only ("Currently only supports float32"); gather_qmm any float
CPU_CASES = [(mx.float32, 0, 0)] + [(dt, b, g) for dt in DTYPES for b, g in [(4, 64), (8, 32), (2, 128)]]


@pytest.mark.parametrize("dtype,bits,group", CPU_CASES, ids=[f"{d}-q{b}g{g}" for d, b, g in CPU_CASES])
@pytest.mark.parametrize("layout", ["gate", "down"])
def test_cpu_gather_ops_are_invariant_in_the_tokens(dtype, bits, group, layout):
    """Why the CPU path is MLX's own op: each pair is its own product there, sorted or not."""
    E, N, K, k = 8, 48, 256, 2
    lay = _layer(E, N, K, dtype, 4, bits, group or 64)
    x, idx = inputs(layout, MAX_T + 2, k, K, dtype, 5), routes(MAX_T + 2, E, k, 6)
    with mx.stream(mx.cpu):
        assert_tokens_invariant(lambda a, i: lay(a, i), x, idx, f"cpu {dtype} q{bits}")
        assert_tokens_invariant(lambda a, i: sorted_call(lambda b, j: lay(b, j, True), a, i), x, idx, "cpu sorted")
        assert ig.gather_path() == "mlx" and ig.call(lay, x, idx) is None


def test_rowwise_path_is_the_layer_bitwise_on_the_cpu(monkeypatch):
    """The rowwise fallback (a GPU with MLX_DSPARK_KERNELS=reference): each pair alone through
    MLX's gather op; on the CPU that is the layer's own result, bitwise."""
    monkeypatch.setattr(ig, "gather_path", lambda: "rowwise")
    for bits in (0, 4):
        lay = _layer(5, 24, 64, mx.float32, 7, bits)
        for layout in ("gate", "down"):
            x, idx = inputs(layout, 6, 2, 64, mx.float32, 8), routes(6, 5, 2, 9)
            got = ig.call(lay, x, idx)
            assert got.shape == (6, 2, 1, 24) and mx.array_equal(got, lay(x, idx)).item()


# ------------------------------------------------------------------- the body on CPU threads
def test_gpu_body_runs_on_cpu_threads(tmp_path):
    """The body itself on the CPU (tests/emulation/invariant_gather_emu.cpp): matches a float64
    product for dense and 2/4/8-bit experts at every group size in both of mlx-lm's layouts, every
    row equals the dense body on its expert's weight bitwise, and the rows do not depend on how
    many tokens the call has nor on mlx-lm's sorting of the pairs."""
    kt.run_gpu_body_on_cpu("invariant_gather_emu.cpp", tmp_path)


# ------------------------------------------------------------------------------ compile checks
def _parse_tools():
    import test_metal_check as tmc

    return tmc.parse, tmc.METAL_STUB, tmc.CUDA_STUB


def _weight_specs(kind, dt, group):
    """(dtype, ndim) of the weight inputs of a `group`-weight instance."""
    per = [(dt, 3)] if kind == "dense" else [("uint32", 3), (dt, 3), (dt, 3)]
    return per * group


def _metal_src(inst, kind, dt, bits=4, idx="uint32", pairs=10**3, group=1):
    ins = [(dt, 4, 10**4), (idx, 1, pairs)] + [(d, n, 10**4) for d, n in _weight_specs(kind, dt, group)]
    tmpl = [("T", dt)] + ([("BITS", bits)] if kind == "affine" else [])
    return kt.metal_kernel_text(inst, ins, [dt] * group, tmpl)


@pytest.mark.parametrize("dt", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("idx", ["uint32", "int32"])
@pytest.mark.parametrize("group", [1, 2])
def test_metal_instances_parse(dt, idx, group):
    parse, metal_stub, _ = _parse_tools()
    # a one-pair call passes idx in Metal's constant address space: the body must take it too
    for pairs in (1, 10**3):
        src = _metal_src(ig.instance("metal", "dense", group), "dense", dt, idx=idx, pairs=pairs, group=group)
        assert parse(src, metal_stub, f"ig_metal_{dt}") == []
        for bits in il.BITS:
            inst = ig.instance("metal", "affine", group)
            src = _metal_src(inst, "affine", dt, bits, idx=idx, pairs=pairs, group=group)
            assert parse(src, metal_stub, f"igq{bits}_metal_{dt}") == []


def _cuda_src(inst, kind, dt, bits=4, idx="uint32", group=1):
    tmpl = [("T", dt)] + ([("BITS", bits)] if kind == "affine" else [])
    ins = [(dt, 4), (idx, 1)] + _weight_specs(kind, dt, group)
    return kt.cuda_kernel_text(inst, ins, [dt] * group, tmpl)


@pytest.mark.parametrize("dt", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("idx", ["uint32", "int32"])
@pytest.mark.parametrize("group", [1, 2])
def test_cuda_instances_parse(dt, idx, group):
    parse, _, cuda_stub = _parse_tools()
    src = _cuda_src(ig.instance("cuda", "dense", group), "dense", dt, idx=idx, group=group)
    assert parse(src, cuda_stub, f"ig_cuda_{dt}") == []
    for bits in il.BITS:
        src = _cuda_src(ig.instance("cuda", "affine", group), "affine", dt, bits, idx=idx, group=group)
        assert parse(src, cuda_stub, f"igq{bits}_cuda_{dt}") == []


def test_a_broken_body_fails_both_compile_checks():
    parse, metal_stub, cuda_stub = _parse_tools()
    for lang, stub, src_of in (("metal", metal_stub, _metal_src), ("cuda", cuda_stub, _cuda_src)):
        good = ig.instance(lang, "dense")
        body = good.header.replace("ds_il_accumulate(x, xo, k, wv, acc);", "ds_il_accumulate(xo, k, wv, acc);")
        assert body.count("ds_il_accumulate(xo, k, wv, acc);") >= 3  # the dense kernel's and both of ours
        bad = gs.Instance(good.name, good.input_names, good.output_names, good.source, body)
        assert parse(src_of(bad, "dense", "float32"), stub, f"ig_broken_{lang}")


NVCC_PRELUDE = (  # the part of MLX's default CUDA header the kernel text uses
    "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cooperative_groups.h>\n#include <cstdint>\n"
    "namespace mlx { namespace core { namespace cu {\n"
    "template <class T, int N> struct small_array {\n"
    "  T v[N];\n  __device__ T operator[](int i) const { return v[i]; }\n};\n"
    "using Shape = small_array<int32_t, 8>;\nusing Strides = small_array<int64_t, 8>;\n}}}\n"
)
needs_nvcc = pytest.mark.skipif(not __import__("shutil").which("nvcc"), reason="needs nvcc")


def nvcc_compiles(sources: dict, tmp_path) -> None:
    """Compile kernel texts (cuda_kernel_text; name -> text) with nvcc for sm_90, device code."""
    import re
    import shutil
    import subprocess

    src = NVCC_PRELUDE + "".join(re.sub(r"custom_kernel_\w+\(", f"k_{n}(", t, count=1) for n, t in sources.items())
    (tmp_path / "k.cu").write_text(src)
    run = subprocess.run(
        [shutil.which("nvcc"), "-std=c++17", "-arch=sm_90", "-c", str(tmp_path / "k.cu"), "-o", str(tmp_path / "k.o")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]


@needs_nvcc
@pytest.mark.parametrize("kind", ["dense", "affine"])
def test_cuda_instance_compiles_with_nvcc(kind, tmp_path):
    """The CUDA instance through a real CUDA compiler (nvcc, device code only)."""
    srcs = {
        f"{dt}_{b}": _cuda_src(ig.instance("cuda", kind), kind, dt, b) for dt in ("float32", "bfloat16") for b in (2, 8)
    }
    srcs["float16_4"] = _cuda_src(ig.instance("cuda", kind), kind, "float16", 4, idx="int32")
    srcs["bfloat16_4_pair"] = _cuda_src(ig.instance("cuda", kind, 2), kind, "bfloat16", 4, group=2)
    nvcc_compiles(srcs, tmp_path)


# ---------------------------------------------------------------- routing (stand-in kernel)
@pytest.fixture
def stand_in(monkeypatch):
    """The GPU path on the CPU with the JIT kernel replaced by a stand-in that computes the
    reference from exactly the inputs, template and launch shape it is given, and records them."""
    calls = []

    def fake(lang, kind, group=1):
        def run(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            t = dict(template)
            x, idx = inputs[0], inputs[1]
            *S, M, _ = output_shapes[0]
            Ns = [shape[-1] for shape in output_shapes]
            P = idx.size
            xb = 1
            for d in x.shape[:-2]:
                xb *= d
            assert len(output_shapes) == group and all(tuple(o[:-1]) == tuple(S) + (M,) for o in output_shapes)
            assert idx.ndim == 1 and P % xb == 0 and threadgroup == (il.THREADS, 1, 1)
            assert grid == (-(-sum(Ns) // il.COLS) * il.THREADS, -(-P * M // ig.ROWS), 1) and t["T"] == x.dtype
            xs = mx.repeat(x.reshape(xb, M, x.shape[-1]), P // xb, axis=0)  # pair p reads x batch p / rep
            outs = []
            for g in range(group):
                if kind == "dense":
                    y = ig.invariant_gather_reference(xs, inputs[2 + g], idx)
                else:
                    wq, s, z = inputs[2 + 3 * g : 5 + 3 * g]
                    y = ig.invariant_gather_reference(
                        xs, wq, idx, s, z, group_size=x.shape[-1] // s.shape[2], bits=t["BITS"]
                    )
                outs.append(y.reshape(output_shapes[g]))
            calls.append((kind, P // xb, tuple(S), group))
            return outs

        return run

    monkeypatch.setattr(ig, "_kernel", fake)
    monkeypatch.setattr(ig, "gather_path", lambda: "cuda")
    yield calls
    ig.reset()


@pytest.mark.parametrize("bits", [0, 4, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_routing_runs_switch_layers_through_the_op_only_while_active(stand_in, bits, bias):
    compat.route_linears_to_invariant_op()
    lay = _layer(6, 32, 64, mx.float32, 10, bits, 32, bias)
    for layout, rep in (("gate", 2), ("down", 1)):
        x, idx = inputs(layout, 5, 2, 64, mx.float32, 11), routes(5, 6, 2, 12)
        want = lay(x, idx)  # not active: mlx-lm's own call
        assert not stand_in
        with invariant.active():
            got = lay(x, idx)
        assert stand_in.pop() == ("affine" if bits else "dense", rep, (5, 2), 1)
        assert got.shape == want.shape and mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()
    with invariant.active():  # a SwitchGLU call past 64 pairs: the sorted layout, one x per pair
        glu = SwitchGLU(64, 32, 6)
        x = rand((40, 64), mx.float32, 13)
        idx = routes(40, 6, 2, 14)
        got = glu(x, idx)
    assert [c[1:] for c in stand_in] == [(1, (80,), 2), (1, (80,), 1)]  # gate + up in one launch, then down
    stand_in.clear()
    assert mx.allclose(got, glu(x, idx), atol=1e-4, rtol=1e-4).item() and not stand_in


def test_the_pair_shares_one_launch_only_for_the_same_arrays(stand_in):
    up, gate = _layer(6, 32, 64, mx.float32, 21), _layer(6, 40, 64, mx.float32, 22)
    x, idx = inputs("gate", 4, 2, 64, mx.float32, 23), routes(4, 6, 2, 24)
    with ig.pair(up, gate):
        a = ig.call(up, x, idx)
        b = ig.call(gate, x, idx)  # the second output of the first launch
    assert [c[3] for c in stand_in] == [2]
    assert mx.allclose(a, up(x, idx), atol=1e-4).item() and mx.allclose(b, gate(x, idx), atol=1e-4).item()
    stand_in.clear()
    with ig.pair(up, gate):
        ig.call(up, x, idx)
        other = inputs("gate", 4, 2, 64, mx.float32, 25)
        b2 = ig.call(gate, other, idx)  # other x: computed alone, not the stashed output
    assert [c[3] for c in stand_in] == [2, 1] and mx.allclose(b2, gate(other, idx), atol=1e-4).item()
    stand_in.clear()
    with ig.pair(up, _layer(6, 40, 64, mx.float32, 26, bits=4)):  # kinds differ: each alone
        ig.call(up, x, idx)
    assert [c[3] for c in stand_in] == [1]


def test_layers_the_op_does_not_take_keep_mlx(stand_in):
    x, idx = inputs("gate", 3, 2, 64, mx.float32, 15), routes(3, 4, 2, 16)
    q3 = _layer(4, 16, 64, mx.float32, 17, bits=3, group=32)  # 3-bit packing spans words
    assert ig.call(q3, x, idx) is None
    lay = _layer(4, 16, 64, mx.float32, 18)
    assert ig.call(lay, x.astype(mx.float16), idx) is None  # a dtype the weight does not have
    odd = _layer(4, 16, 60, mx.float32, 19)  # K = 60: not a multiple of the kernel's 8-element steps
    assert ig.call(odd, inputs("gate", 3, 2, 60, mx.float32, 20), idx) is None
    assert not stand_in


def test_a_moe_target_on_the_kernel_path_routes_its_experts(stand_in, monkeypatch):
    """qwen3_moe (float32, CPU) forced onto the kernel path with the stand-in expert kernel: the
    self-check passes, every expert call of a decode forward went through the op (gate and up in
    one launch with one x per token, down with one per pair), and lookup decoding equals baseline."""
    monkeypatch.setenv("MLX_DSPARK_INVARIANT", "kernels")
    monkeypatch.setenv("MLX_DSPARK_INVARIANT_CACHE", "off")
    path = write_family(_ROOT / "qwen3_moe", "qwen3_moe", seed=2)
    tgt, tok = md.load_target(str(path), dtype="float32")
    assert tgt.invariance == "kernels" and tgt.invariant_kernels
    stand_in.clear()
    cache = tgt.make_cache()
    mx.eval(tgt.forward(mx.array([[1, 2, 3, 4, 5]]), cache, last_only=True).logits)
    assert not stand_in  # prefill keeps MLX's own op
    mx.eval(tgt.forward(mx.array([[6, 7, 8]]), cache).logits)
    layers = tgt.num_layers
    # per layer: gate + up in one launch (one x per token), down alone (one x per pair)
    assert sorted(stand_in) == sorted([("dense", 2, (1, 3, 2), 2), ("dense", 1, (1, 3, 2), 1)] * layers)
    ids = md.encode_prompt(tok, "the fox def add hello world the fox the fox def add")
    base = md.generate(tgt, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=30)
    look = md.generate(tgt, tok, None, prompt_ids=ids, mode="lookup", max_new_tokens=30, max_draft=5)
    assert look.tokens == base.tokens and look.text == base.text


def test_cpu_kernel_path_keeps_mlx_experts_and_is_invariant(monkeypatch):
    """On the CPU the kernel path leaves the experts on MLX's gather ops (measured invariant above):
    a qwen3_moe target forced onto it passes the self-check, 4-bit included."""
    monkeypatch.setenv("MLX_DSPARK_INVARIANT", "kernels")
    monkeypatch.setenv("MLX_DSPARK_INVARIANT_CACHE", "off")
    ig.reset()
    path = write_family(_ROOT / "qwen3_moe-cpu", "qwen3_moe", seed=4)
    for quantize in (None, 4):
        tgt, _ = md.load_target(str(path), dtype="float32", quantize=quantize)
        assert tgt.invariance == "kernels"
        assert ig.gather_path() == "mlx"


# ---------------------------------------------------------------------------------- on the GPU
needs_cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")
# bf16 at every bits / group; float16 and float32 at two of them (the dtype only changes loads and the store)
GPU_QUANTS = [(mx.bfloat16, b, g) for b, g in QUANTS] + [
    (d, b, g) for d in (mx.float16, mx.float32) for b, g in [(4, 64), (8, 32)]
]
GPU_SHAPES = [(8, 768, 2048, 8), (16, 2048, 768, 4), (4, 72, 136, 2)]  # (E, N, K, top-k)


def _check_gpu(fn, dense_row, ref, x, idx, label, dtype):
    """parity with the reference, tokens invariance, sorted == unsorted, each row == the dense
    kernel on its expert's weight (bitwise)."""
    got = fn(x, idx)
    with mx.stream(mx.cpu):
        want = ref(x, idx)
    tol = 1e-4 if dtype == mx.float32 else 2e-2
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=tol, rtol=tol).item(), label
    assert_tokens_invariant(fn, x, idx, label)
    assert mx.array_equal(sorted_call(fn, x, idx), got).item(), f"{label}: sorted by expert"
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            row = x[t, 0 if x.shape[1] == 1 else j]
            assert mx.array_equal(got[t, j], dense_row(row, int(idx[t, j].item()))).item(), f"{label}: dense {t},{j}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("layout", ["gate", "down"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cuda_gather_dense(dtype, layout, shape):
    E, N, K, k = shape
    with mx.stream(mx.gpu):
        w, _, _ = experts(E, N, K, dtype, 30)
        x, idx = inputs(layout, MAX_T + 1, k, K, dtype, 31), routes(MAX_T + 1, E, k, 32)
        _check_gpu(
            lambda a, i: ig.gather_gpu(a, w, i),
            lambda row, e: il.dense_gpu(row, w[e]),
            lambda a, i: ig.invariant_gather_reference(a, w, i),
            x,
            idx,
            f"cuda gather {dtype} {layout} {shape}",
            dtype,
        )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "dtype,bits,group",
    GPU_QUANTS,
    ids=[f"{'bf16' if d == mx.bfloat16 else 'f16' if d == mx.float16 else 'f32'}-q{b}g{g}" for d, b, g in GPU_QUANTS],
)
@pytest.mark.parametrize("layout", ["gate", "down"])
def test_cuda_gather_affine(dtype, bits, group, layout):
    E, N, K, k = 8, 512, 1024, 4
    with mx.stream(mx.gpu):
        wq, s, b = experts(E, N, K, dtype, 33, bits, group)
        x, idx = inputs(layout, MAX_T + 1, k, K, dtype, 34), routes(MAX_T + 1, E, k, 35)
        _check_gpu(
            lambda a, i: ig.gather_affine_gpu(a, wq, s, b, i, bits),
            lambda row, e: il.affine_gpu(row, wq[e], s[e], b[e], bits),
            lambda a, i: ig.invariant_gather_reference(a, wq, i, s, b, group_size=group, bits=bits),
            x,
            idx,
            f"cuda q{bits}g{group} {dtype} {layout}",
            dtype,
        )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("bits", [0, 4])
def test_cuda_pair_launch_is_each_weight_alone(bits):
    """gate and up in one launch give, bitwise, what each gives alone."""
    E, K, k = 8, 1024, 4
    with mx.stream(mx.gpu):
        a, b = experts(E, 512, K, mx.bfloat16, 36, bits), experts(E, 384, K, mx.bfloat16, 37, bits)
        x, idx = inputs("gate", 9, k, K, mx.bfloat16, 38), routes(9, E, k, 39)
        if bits:
            both = ig.gather_affine_gpu(x, *a, idx, bits, second=b)
            alone = [ig.gather_affine_gpu(x, *w, idx, bits) for w in (a, b)]
        else:
            both = ig.gather_gpu(x, a[0], idx, second=b[0])
            alone = [ig.gather_gpu(x, w[0], idx) for w in (a, b)]
        for g in range(2):
            assert mx.array_equal(both[g], alone[g]).item(), f"weight {g} of the pair"


MOE_TARGETS = [("qwen3_moe", None), ("qwen3_moe", 4), ("qwen3_5_moe", None), ("qwen3_next", None)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name,quantize", MOE_TARGETS, ids=[f"{n}-q{q}" for n, q in MOE_TARGETS])
def test_cuda_moe_targets_take_the_kernel_path(name, quantize, monkeypatch):
    """A bf16 MoE fixture on CUDA: the load self-check picks the invariant kernels (it fell to a
    non-invariant path before the experts were routed), and row i of a width-w forward equals
    the width-1 forward bitwise, w = 1..17."""
    monkeypatch.setenv("MLX_DSPARK_INVARIANT_CACHE", "off")
    path = write_family(_ROOT / f"gpu-{name}", name, seed=3, hidden=128)
    mx.set_default_device(mx.gpu)
    try:
        tgt, _ = md.load_target(str(path), dtype="bfloat16", quantize=quantize)
        if tgt.invariance != "kernels":
            pytest.fail(f"the self-check chose {tgt.invariance}: {first_moving_op(tgt)}")
        rng = random.Random(SEED)
        prefix = [rng.randrange(tgt.vocab_size) for _ in range(40)]
        tokens = mx.array([[rng.randrange(tgt.vocab_size) for _ in range(MAX_T)]], dtype=mx.int32)

        def prefilled():
            cache = tgt.make_cache()
            mx.eval(tgt.forward(mx.array([prefix]), cache, last_only=True).logits)
            return cache

        cache = prefilled()
        ones = [tgt.forward(tokens[:, i : i + 1], cache).logits for i in range(MAX_T)]
        mx.eval(ones)
        for w in (1, 2, 3, 4, 5, 8, 9, 16, 17):
            rows = tgt.forward(tokens[:, :w], prefilled()).logits
            for i in range(w):
                assert mx.array_equal(rows[:, i], ones[i][:, 0]).item(), f"{name}: row {i} of width {w}"
    finally:
        mx.set_default_device(mx.cpu)
