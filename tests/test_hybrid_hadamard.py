"""PrismML Bonsai's 2-bit Hadamard packs (mlx-lm `prism_hadamard_qwen35`, a qwen3_5 hybrid) on the
kernel path: compat routes HadamardQuantizedLinear through the same rotation and then the invariant
affine product of kernels/invariant_linear.py on a GPU (checked here with a stand-in kernel that
computes the reference from exactly what it is given), keeps mlx-lm's own call on the CPU, and on
the device (`pytest -m gpu`) the pack passes the self-check on the kernel path, bitwise."""

from __future__ import annotations

import os
import random

import mlx.core as mx
import pytest
from fixtures import scratch_dir
from ternary_fixtures import write_ternary

import mlx_dspark as md
from mlx_dspark import compat
from mlx_dspark.kernels import invariant
from mlx_dspark.kernels import invariant_linear as il

SEED = int(os.environ.get("MLX_DSPARK_TEST_SEED", random.randrange(2**31)))
_ROOT = scratch_dir("mlx-dspark-hadamard-")


def _pack(dtype="float32"):
    return md.load_target(str(write_ternary(_ROOT / f"t-{dtype}", seed=1)), dtype=dtype)


def _packed_layers(tgt):
    from mlx_lm.models.prism_hadamard_qwen35 import HadamardQuantizedLinear

    return [m for _, m in tgt.model.named_modules() if isinstance(m, HadamardQuantizedLinear)]


@pytest.fixture
def stand_in(monkeypatch):
    calls = []

    def fake(lang, kind, group=1):
        def run(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            t = dict(template)
            x, wq, s, z = inputs[:4]
            y = il.invariant_linear_reference(x, wq, s, z, group_size=x.shape[-1] // s.shape[1], bits=t["BITS"])
            calls.append((kind, t["BITS"], x.shape[-1] // s.shape[1]))
            return (y,)

        return run

    monkeypatch.setattr(il, "_kernel", fake)
    monkeypatch.setattr(il, "linear_path", lambda: "cuda")
    yield calls
    il.reset()


def test_packed_layers_run_the_rotation_then_the_invariant_product(stand_in):
    compat.route_linears_to_invariant_op()
    tgt, _ = _pack()
    layers = _packed_layers(tgt)
    assert {lay.block for lay in layers} == {0, 512}  # rotated and plain packed modules
    for lay in (next(x for x in layers if x.block), next(x for x in layers if not x.block)):
        x = (mx.random.normal((2, 3, lay.scales.shape[1] * 128), key=mx.random.key(SEED)) * 0.5).astype(mx.float32)
        want = lay(x)  # not active: mlx-lm's own call
        assert not stand_in
        with invariant.active():
            got = lay(x)
        assert stand_in == [("affine", 2, 128)]
        stand_in.clear()
        assert got.shape == want.shape and mx.allclose(got, want, atol=1e-3, rtol=1e-3).item()


def test_on_the_cpu_the_pack_keeps_mlx_lm_and_passes_the_kernel_path(monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_INVARIANT", "kernels")
    monkeypatch.setenv("MLX_DSPARK_INVARIANT_CACHE", "off")
    il.reset()
    tgt, tok = _pack()
    assert tgt.invariance == "kernels" and il.linear_path() in ("native", "rowwise")
    ids = md.encode_prompt(tok, "the fox def add hello world the fox the fox")
    base = md.generate(tgt, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=24)
    look = md.generate(tgt, tok, None, prompt_ids=ids, mode="lookup", max_new_tokens=24, max_draft=4)
    assert look.tokens == base.tokens


@pytest.mark.gpu
@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_pack_takes_the_kernel_path(dtype, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_INVARIANT_CACHE", "off")
    mx.set_default_device(mx.gpu)
    try:
        tgt, _ = _pack(dtype)
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
        for w in (2, 5, 8, 17):
            rows = tgt.forward(tokens[:, :w], prefilled()).logits
            for i in range(w):
                assert mx.array_equal(rows[:, i], ones[i][:, 0]).item(), f"row {i} of width {w}"
    finally:
        mx.set_default_device(mx.cpu)
