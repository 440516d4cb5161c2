"""Sibling layers in one launch (kernels/invariant_linear.py): q/k/v and gate/up, which a decode
forward calls on the same input, computed by one GPU launch over G = 2 or 3 weights, each output
column the same arithmetic as its layer alone. The routing runs here with a stand-in kernel; the
body on CPU threads (test_kernels_invariant_linear.py's emulation: three weights in one launch
== each alone, bitwise); the compile checks of the G = 2, 3 instances; on the device, the CUDA
instance itself."""

from __future__ import annotations

import kernel_text as kt
import mlx.core as mx
import mlx.nn as nn
import pytest
from test_kernels_invariant_linear import MAX_M, QUANTS, assert_rows_invariant, quantized, rand

import mlx_dspark as md
from mlx_dspark.kernels import invariant
from mlx_dspark.kernels import invariant_linear as il


def reference_outputs(kind: str, group: int, inputs: list, t: dict) -> list:
    """What a launch of the dense or affine kernel over `group` weights must return: each weight's
    reference product, from the launch's inputs (x, the weights' arrays, the biases) and template."""
    x, outs = inputs[0], []
    for g in range(group):
        bias = inputs[1 + (1 if kind == "dense" else 3) * group + g] if t["HB"] >> g & 1 else None
        if kind == "dense":
            outs.append(il.invariant_linear_reference(x, inputs[1 + g], bias=bias))
        else:
            wq, s, z = inputs[1 + 3 * g : 4 + 3 * g]
            gs = x.shape[-1] // s.shape[1]
            outs.append(il.invariant_linear_reference(x, wq, s, z, bias=bias, group_size=gs, bits=t["BITS"]))
    return outs


def _fake_kernel(calls):
    """A stand-in for the JIT kernel: the reference of each of the G weights, from exactly the
    inputs, template and launch shape the plan gives it."""

    def fake(lang, kind, group=1):
        def run(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            t = dict(template)
            x = inputs[0]
            assert threadgroup == (il.THREADS, 1, 1) and len(output_shapes) == group == len(output_dtypes)
            assert grid == (-(-sum(s[-1] for s in output_shapes) // il.COLS) * il.THREADS, 1, 1)
            outs = reference_outputs(kind, group, inputs, t)
            assert [y.shape for y in outs] == [tuple(s) for s in output_shapes]
            calls.append((kind, group, x.size // x.shape[-1]))
            return outs

        return run

    return fake


@pytest.fixture
def fake_gpu(monkeypatch):
    from mlx_dspark.compat import route_linears_to_invariant_op

    route_linears_to_invariant_op()  # what the kernel path installs at load
    calls = []
    monkeypatch.setattr(il, "_kernel", _fake_kernel(calls))
    monkeypatch.setattr(il, "linear_path", lambda: "cuda")
    il.reset()
    yield calls
    il.reset()


@pytest.fixture(scope="module")
def llama(model_dir):
    return str(model_dir("llama", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, seed=5))


@pytest.mark.parametrize("bits", [None, 4], ids=["dense", "q4"])
def test_siblings_share_one_launch(llama, fake_gpu, bits):
    target, _ = md.load_target(llama, dtype="float32", probe=False)
    if bits:
        nn.quantize(target.model, group_size=32, bits=bits)
    assert il.group_siblings(target.model) == 2 * 2  # q/k/v and gate/up in each of 2 layers
    layer = target.model.model.layers[0]
    group = il._sibling_of[id(layer.self_attn.q_proj)][1]
    assert il.group_siblings(target.model) == 4 and il._sibling_of[id(layer.self_attn.k_proj)][1] is group  # kept
    attn, mlp = layer.self_attn, layer.mlp
    x = rand((1, 3, 64), mx.float32, 60)
    want = [m(x) for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)]
    assert fake_gpu == []  # outside invariant.active(): MLX's own op
    with invariant.active():
        got = [m(x) for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)]
    kind = "affine" if bits else "dense"
    assert fake_gpu == [(kind, 3, 3), (kind, 2, 3)]  # two launches for five layers, 3 rows each
    for g, w in zip(got, want):
        assert g.shape == w.shape and mx.allclose(g, w, atol=1e-4).item()

    # another input for one sibling: computed for that input, not served from the last launch
    x2 = rand((1, 2, 64), mx.float32, 61)
    with invariant.active():
        q = attn.q_proj(x)
        k2 = attn.k_proj(x2)
    assert mx.allclose(k2, attn.k_proj(x2), atol=1e-4).item() and mx.allclose(q, want[0], atol=1e-4).item()
    assert fake_gpu[-2:] == [(kind, 3, 3), (kind, 3, 2)]


def test_a_sibling_with_a_new_weight_runs_alone(llama, fake_gpu):
    target, _ = md.load_target(llama, dtype="float32", probe=False)
    il.group_siblings(target.model)
    attn = target.model.model.layers[1].self_attn
    x = rand((1, 2, 64), mx.float32, 62)
    attn.k_proj.weight = rand(attn.k_proj.weight.shape, mx.float32, 63)  # e.g. a reloaded checkpoint
    with invariant.active():
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    assert mx.allclose(k, x @ attn.k_proj.weight.T, atol=1e-4).item()  # the new weight, not the grouped one
    assert mx.allclose(q, x @ attn.q_proj.weight.T, atol=1e-4).item()
    assert mx.allclose(v, x @ attn.v_proj.weight.T, atol=1e-4).item()
    assert ("dense", 1, 2) in fake_gpu


def test_groups_need_one_kind(fake_gpu):
    mixed = [nn.Linear(64, 16, bias=False), nn.QuantizedLinear(64, 16, bias=False, bits=4, group_size=32)]
    assert il._gpu_plan(mixed, False, "cuda") is None
    other_k = [nn.Linear(64, 16), nn.Linear(32, 16)]
    assert il._gpu_plan(other_k, False, "cuda") is None
    bits = [nn.QuantizedLinear(64, 16, bits=4, group_size=32), nn.QuantizedLinear(64, 16, bits=8, group_size=32)]
    assert il._gpu_plan(bits, False, "cuda") is None
    assert il.group_siblings(nn.Sequential(nn.Linear(64, 8))) == 0


def test_no_groups_without_a_gpu_path(llama):
    target, _ = md.load_target(llama, dtype="float32", probe=False)
    assert il.linear_path() in ("native", "rowwise")
    assert il.group_siblings(target.model) == 0


# ------------------------------------------------------------------------------ compile checks
def _parse_tools():
    import test_metal_check as tmc

    return tmc.parse, tmc.METAL_STUB, tmc.CUDA_STUB


@pytest.mark.parametrize("group", [2, 3])
@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_group_instances_parse(group, dt):
    parse, metal_stub, cuda_stub = _parse_tools()
    dense_in = [(dt, 2)] * (1 + group) + [(dt, 1)] * group
    affine_in = [(dt, 2)] + [("uint32", 2), (dt, 2), (dt, 2)] * group + [(dt, 1)] * group
    hb = [("HB", (1 << group) - 2)]
    src = kt.cuda_kernel_text(il.instance("cuda", "dense", group), dense_in, [dt] * group, [("T", dt)] + hb)
    assert parse(src, cuda_stub, f"ilg{group}_cuda_{dt}") == []
    src = kt.cuda_kernel_text(
        il.instance("cuda", "affine", group), affine_in, [dt] * group, [("T", dt), ("BITS", 4)] + hb
    )
    assert parse(src, cuda_stub, f"ilqg{group}_cuda_{dt}") == []
    m_dense = [(s[0], s[1], 10**4) for s in dense_in]
    m_affine = [(s[0], s[1], 10**4) for s in affine_in]
    src = kt.metal_kernel_text(il.instance("metal", "dense", group), m_dense, [dt] * group, [("T", dt)] + hb)
    assert parse(src, metal_stub, f"ilg{group}_metal_{dt}") == []
    src = kt.metal_kernel_text(
        il.instance("metal", "affine", group), m_affine, [dt] * group, [("T", dt), ("BITS", 8)] + hb
    )
    assert parse(src, metal_stub, f"ilqg{group}_metal_{dt}") == []


# ---------------------------------------------------------------------------------- on the GPU
needs_cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32], ids=["bf16", "f16", "f32"])
def test_cuda_dense_group_equals_each_alone(dtype):
    K = 576
    with mx.stream(mx.gpu):
        ws = [rand((n, K), dtype, 70 + i, 0.05) for i, n in enumerate((576, 192, 200))]
        bs = [rand((576,), dtype, 74), None, rand((200,), dtype, 75)]
        x = rand((MAX_M + 2, K), dtype, 76)
        outs = il.dense_gpu_group(x, ws, bs)
        for w, b, o in zip(ws, bs, outs):
            assert mx.array_equal(o, il.dense_gpu(x, w, b)).item()
        for g in range(3):
            assert_rows_invariant(lambda r, g=g: il.dense_gpu_group(r, ws, bs)[g], x, f"cuda dense group {g} {dtype}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("bits,group", [q for q in QUANTS if q[1] == 64])
def test_cuda_affine_group_equals_each_alone(bits, group):
    K, dtype = 1536, mx.bfloat16
    with mx.stream(mx.gpu):
        qs = [quantized(n, K, dtype, bits, group, 80 + i) for i, n in enumerate((576, 576))]
        bs = [None, rand((576,), dtype, 83)]
        x = rand((MAX_M + 2, K), dtype, 84)
        outs = il.affine_gpu_group(x, qs, bits, bs)
        for (wq, s, z), b, o in zip(qs, bs, outs):
            assert mx.array_equal(o, il.affine_gpu(x, wq, s, z, bits, b)).item()
        for g in range(2):
            assert_rows_invariant(
                lambda r, g=g: il.affine_gpu_group(r, qs, bits, bs)[g], x, f"cuda q{bits}g{group} group {g}"
            )
