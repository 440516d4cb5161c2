"""The width-invariant masked attention (kernels/invariant_masked.py) that a sliding window's verify
layout (models/sliding.py: a boolean mask [w, L]) runs on the kernel path: row i equals the plain
step's op over exactly its visible keys (bitwise), parity with MLX's masked attention, the routing
in compat.py, compile checks of its Metal and CUDA launchers, a gemma3_text / gemma4_text target
passing the load self-check with OpenBLAS (it found no invariant path before), and, on the device
(`pytest -m gpu`), the CUDA instance and those targets on CUDA."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import kernel_text as kt
import mlx.core as mx
import numpy as np
import pytest
from family_fixtures import write_family
from fixtures import scratch_dir

import mlx_dspark as md
from mlx_dspark import blas
from mlx_dspark.kernels import gpu_source as gs
from mlx_dspark.kernels import invariant as inv
from mlx_dspark.kernels import invariant_masked as im

SEED = int(os.environ.get("MLX_DSPARK_TEST_SEED", random.randrange(2**31)))
SHAPES = [(1, 4, 6, 2, 13, 32), (1, 8, 16, 1, 300, 64), (2, 4, 3, 4, 9, 128), (1, 2, 8, 1, 140, 256)]
_ROOT = scratch_dir("mlx-dspark-masked-")


def case(B, H, w, Hkv, L, D, dtype, i):
    """q, k, v and a random boolean mask [w, L] (every row sees at least one key)."""
    k1, k2, k3 = mx.random.split(mx.random.key(SEED * 100 + i), 3)
    q = mx.random.normal((B, H, w, D), key=k1).astype(dtype)
    k = mx.random.normal((B, Hkv, L, D), key=k2).astype(dtype)
    v = mx.random.normal((B, Hkv, L, D), key=k3).astype(dtype)
    rng = np.random.default_rng(SEED + i)
    m = rng.random((w, L)) < 0.6
    m[np.arange(w), rng.integers(0, L, w)] = True
    return q, k, v, mx.array(m)


def inv_visible(mask, i) -> mx.array:
    return mx.array(np.flatnonzero(np.array(mask[i])).astype(np.int32))


def row_alone(q, k, v, mask, i, scale, op):
    vis = inv_visible(mask, i)
    return op(q[:, :, i : i + 1], mx.take(k, vis, axis=2), mx.take(v, vis, axis=2), scale)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_cpu_rows_are_the_plain_op_over_their_visible_keys(shape, dtype):
    q, k, v, mask = case(*shape, dtype, 1)
    scale = shape[-1] ** -0.5
    assert im.supported(q, k, v, mask)
    got = im.attention(q, k, v, scale, mask)
    assert got.shape == q.shape and got.dtype == dtype
    for i in range(q.shape[2]):  # the CPU plain step: the native op in float32, else MLX's single-query attention
        alone = row_alone(q, k, v, mask, i, scale, inv.one_row)
        assert mx.array_equal(got[:, :, i : i + 1], alone).item(), f"row {i} (seed {SEED})"
        plain = inv.invariant_attention(q[:, :, i : i + 1], mx.take(k, inv_visible(mask, i), axis=2),
                                        mx.take(v, inv_visible(mask, i), axis=2), scale)  # fmt: skip
        assert mx.array_equal(alone, plain).item()  # what a plain step's routed call computes
    f32 = [a.astype(mx.float32) for a in (q, k, v)]
    want = inv._MLX_SDPA(*f32, scale=scale, mask=mask)
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    assert mx.allclose(got.astype(mx.float32), want, atol=tol, rtol=tol).item()


def test_reference_path_matches_mlx_masked_attention(monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_KERNELS", "reference")
    q, k, v, mask = case(*SHAPES[1], mx.float32, 2)
    got = im.attention(q, k, v, 0.125, mask)
    assert mx.allclose(got, inv._MLX_SDPA(q, k, v, scale=0.125, mask=mask), atol=1e-5, rtol=1e-5).item()


def test_the_compaction_is_read_once_per_mask_and_what_it_declines():
    q, k, v, mask = case(*SHAPES[0], mx.float32, 3)
    assert im.rows_of(mask) is im.rows_of(mask)
    rows = im.rows_of(mask)
    m = np.array(mask)
    assert rows.lens == [int(r.sum()) for r in m]
    assert all(np.array_equal(np.array(e), np.flatnonzero(r)) for e, r in zip(rows.each, m))
    assert im.supported(q, k, v, mask[None, None])  # leading ones are fine
    assert not im.supported(q, k, v, mask.astype(mx.float32))  # an additive mask: MLX's own
    assert not im.supported(q, k, v, mx.broadcast_to(mask, (1, 4) + mask.shape))  # per head
    assert not im.supported(q, k, v, mask[:, :-1])  # not over these keys
    blind = np.array(mask)
    blind[0] = False  # a row that sees nothing: MLX's own result (it defines that case)
    got = im.attention(q, k, v, 0.5, mx.array(blind))
    assert mx.array_equal(got, inv._MLX_SDPA(q, k, v, scale=0.5, mask=mx.array(blind)), equal_nan=True).item()


def _gemma(name: str, seed: int = 11) -> str:
    return str(write_family(_ROOT / name, name, seed=seed, window=8))


@pytest.mark.parametrize("name", ["gemma3_text", "gemma4_text"])
def test_a_sliding_window_target_on_the_kernel_path_routes_its_verify_layout(name, monkeypatch):
    """Forced onto the kernel path, a verify round over a full ring calls the masked op (the verify
    layout's mask), the self-check passes, and a scripted draft (every accept length) equals baseline."""
    monkeypatch.setenv("MLX_DSPARK_INVARIANT", "kernels")
    monkeypatch.setenv("MLX_DSPARK_INVARIANT_CACHE", "off")
    tgt, tok = md.load_target(_gemma(name), dtype="float32")
    assert tgt.invariance == "kernels"
    calls = []
    real = im.attention
    monkeypatch.setattr(im, "attention", lambda *a: calls.append(a[0].shape[2]) or real(*a))
    cache = tgt.make_cache()
    mx.eval(tgt.forward(mx.array([list(range(3, 23))]), cache, last_only=True).logits)
    mx.eval(tgt.forward(mx.array([[5, 6, 7, 8, 9]]), cache).logits)  # a verify past the window of 8
    assert calls and set(calls) == {5}
    from test_loop import _ScriptedProposer

    ids = md.encode_prompt(tok, "the fox def add hello world the fox the fox def add hello world")
    base = md.generate(tgt, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=40)
    prop = _ScriptedProposer(base.tokens + [0] * 64)
    res = md.generate(tgt, tok, None, prompt_ids=ids, proposer=prop, max_new_tokens=40, max_draft=6)
    assert res.tokens == base.tokens and res.text == base.text and max(res.accept_lengths) > 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is Linux's")
@pytest.mark.parametrize("name", ["gemma3_text", "gemma4_text"])
def test_sliding_window_targets_pass_the_self_check_with_openblas(name):
    """With OpenBLAS (what the CLI preloads on Linux) MLX's masked attention differs with the width,
    so these targets found no invariant path ("none") before the verify layout was routed."""
    lib = next((c for c in blas.CANDIDATES if os.path.exists(c)), None)
    if lib is None:
        pytest.skip("no system OpenBLAS on this machine")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.update({k: v for k, v in blas.preload_env(lib, {}).items() if k in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS")})
    env["MLX_DSPARK_INVARIANT_CACHE"] = "off"
    code = (
        "import json, sys, mlx_dspark as md; from mlx_dspark.blas import active_blas; "
        f"t, _ = md.load_target({_gemma(name, seed=12)!r}, dtype='float32'); "
        "print(json.dumps({'verdict': t.invariance, 'blas': active_blas()['name']}))"
    )
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["blas"] == "openblas" and got["verdict"] in ("native", "kernels"), got


# ------------------------------------------------------------------------------ compile checks
def _parse_tools():
    import test_metal_check as tmc

    return tmc.parse, tmc.METAL_STUB, tmc.CUDA_STUB + "float expf(float);\n"  # the body's exp on CUDA


def _metal_src(inst, dt, w):
    ins = [(dt, 4, 10**4), (dt, 5, 10**5), (dt, 5, 10**5), ("int32", 1, w), ("float32", 1, 1)]
    return kt.metal_kernel_text(inst, ins, [dt], [("T", dt)])


def _cuda_src(inst, dt):
    return kt.cuda_kernel_text(inst, [(dt, 4), (dt, 5), (dt, 5), ("int32", 1), ("float32", 1)], [dt], [("T", dt)])


@pytest.mark.parametrize("dt", ["float32", "float16", "bfloat16"])
def test_instances_parse(dt):
    parse, metal_stub, cuda_stub = _parse_tools()
    for w in (2, 16):  # lens of fewer than 8 rows is passed in Metal's constant address space
        assert parse(_metal_src(im.instance("metal"), dt, w), metal_stub, f"im_metal_{dt}") == []
    assert parse(_cuda_src(im.instance("cuda"), dt), cuda_stub, f"im_cuda_{dt}") == []


def test_cuda_instance_compiles_with_nvcc(tmp_path):
    from test_moe_invariant_gather import needs_nvcc, nvcc_compiles

    if needs_nvcc.args[0]:
        pytest.skip("needs nvcc")
    nvcc_compiles({dt: _cuda_src(im.instance("cuda"), dt) for dt in ("float32", "float16", "bfloat16")}, tmp_path)


def test_a_broken_launcher_fails_both_compile_checks():
    parse, metal_stub, cuda_stub = _parse_tools()
    for lang, stub in (("metal", metal_stub), ("cuda", cuda_stub)):
        good = im.instance(lang)
        bad = gs.Instance(
            good.name, good.input_names, good.output_names, good.source.replace("lens[i]", "row_lens[i]"), good.header
        )
        src = _metal_src(bad, "float32", 16) if lang == "metal" else _cuda_src(bad, "float32")
        assert parse(src, stub, f"im_broken_{lang}")


# ---------------------------------------------------------------------------------- on the GPU
needs_cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=["f32", "bf16", "f16"])
def test_cuda_rows_are_the_invariant_op_over_their_visible_keys(shape, dtype):
    with mx.stream(mx.gpu):
        q, k, v, mask = case(*shape, dtype, 4)
        scale = shape[-1] ** -0.5
        got = im.masked_gpu(q, k, v, scale, im.rows_of(mask))
        for i in range(q.shape[2]):  # the GPU plain step: the invariant op, one query over its keys
            alone = row_alone(q, k, v, mask, i, scale, inv.invariant_attention_gpu)
            assert mx.array_equal(got[:, :, i : i + 1], alone).item(), f"row {i} (seed {SEED})"
        with mx.stream(mx.cpu):
            want = inv._MLX_SDPA(*[a.astype(mx.float32) for a in (q, k, v)], scale=scale, mask=mask)
        tol = 1e-4 if dtype == mx.float32 else 2e-2
        assert mx.allclose(got.astype(mx.float32), want, atol=tol, rtol=tol).item()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["gemma3_text", "gemma4_text"])
def test_cuda_sliding_window_targets_take_the_kernel_path(name, monkeypatch):
    """bf16 on CUDA: the self-check picks the invariant kernels, and past the window row i of a
    width-w forward equals the width-1 forward bitwise (w up to 7: a verify layout holds a width
    up to the ring's 8 slots; real windows are 512 and more)."""
    monkeypatch.setenv("MLX_DSPARK_INVARIANT_CACHE", "off")
    path = _gemma(name, seed=13)
    mx.set_default_device(mx.gpu)
    try:
        tgt, _ = md.load_target(path, dtype="bfloat16")
        assert tgt.invariance == "kernels", tgt.invariance
        rng = random.Random(SEED)
        prefix = [rng.randrange(tgt.vocab_size) for _ in range(30)]
        tokens = mx.array([[rng.randrange(tgt.vocab_size) for _ in range(17)]], dtype=mx.int32)

        def prefilled():
            cache = tgt.make_cache()
            mx.eval(tgt.forward(mx.array([prefix]), cache, last_only=True).logits)
            return cache

        cache = prefilled()
        ones = [tgt.forward(tokens[:, i : i + 1], cache).logits for i in range(17)]
        mx.eval(ones)
        for w in (2, 3, 5, 7):  # a verify layout needs width <= the window's ring (8)
            rows = tgt.forward(tokens[:, :w], prefilled()).logits
            for i in range(w):
                assert mx.array_equal(rows[:, i], ones[i][:, 0]).item(), f"{name}: row {i} of width {w}"
    finally:
        mx.set_default_device(mx.cpu)
