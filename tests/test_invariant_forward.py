"""Width invariance of the target forward (models/invariance.py, kernels/invariant.py): over a
random cache, row i of a width-w forward equals, bit for bit, the width-1 forward of the same token
at the same position, for w = 1..17, in every dtype and MLX affine quantization.

The CPU instances run in CI; the `gpu` instances run on the device (`pytest -m gpu`), where the
forward is not width-invariant without the fixed-width path."""

from __future__ import annotations

import os
import random

import mlx.core as mx
import mlx.nn as nn
import pytest
from forward_rows import first_moving_op

import mlx_dspark as md
from mlx_dspark.models import invariance
from mlx_dspark.models.loading import cast_scales_f32

SEED = int(os.environ.get("MLX_DSPARK_TEST_SEED", random.randrange(2**31)))
PRECISIONS = [("float32", None, None), ("bfloat16", None, None), ("float16", None, None)] + [
    (dt, bits, group) for dt in ("bfloat16", "float32") for bits in (4, 8) for group in (32, 64, 128)
]
MAX_W = 17

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("gpu", id="gpu", marks=[gpu, needs_cuda])]


@pytest.fixture(scope="module")
def path(model_dir):
    # hidden 128 so that group 128 divides every projection; GQA (4 heads, 2 kv heads), 3 layers
    return str(
        model_dir(
            "llama", layers=3, hidden=128, heads=4, kv_heads=2, intermediate=256, scale=2.0, seed=21, vocab_size=512
        )
    )


def load(path, dtype, bits, group, device):
    mx.set_default_device(mx.cpu if device == "cpu" else mx.gpu)
    target, tok = md.load_target(path, dtype=dtype, probe=False)
    if bits:
        nn.quantize(target.model, group_size=group, bits=bits)
        if device == "cpu":
            cast_scales_f32(target.model)  # as the loader does on the CPU
    target.probe()
    return target


def check_property(target, rng):
    vocab = target.vocab_size
    prefix = [rng.randrange(vocab) for _ in range(rng.randrange(5, 300))]
    tokens = mx.array([[rng.randrange(vocab) for _ in range(MAX_W)]], dtype=mx.int32)

    def prefilled():
        cache = target.make_cache()
        mx.eval(target.forward(mx.array([prefix]), cache, last_only=True).logits)
        return cache

    cache = prefilled()
    ones = [target.forward(tokens[:, i : i + 1], cache).logits for i in range(MAX_W)]
    keys_one = [c.state[0][..., : c.offset, :] for c in cache]
    mx.eval(ones, keys_one)
    for w in range(1, MAX_W + 1):
        cache = prefilled()
        rows = target.forward(tokens[:, :w], cache).logits
        mx.eval(rows)
        for i in range(w):
            assert mx.array_equal(rows[:, i], ones[i][:, 0]).item(), (
                f"row {i} of a width-{w} forward differs from the width-1 forward (prefix {len(prefix)}, seed {SEED})"
            )
        if w == MAX_W:  # and the KV written by one wide forward equals the KV of the width-1 steps
            for a, c in zip(keys_one, cache):
                assert mx.array_equal(a, c.state[0][..., : c.offset, :]).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype,bits,group", PRECISIONS, ids=[f"{d}" + (f"-q{b}g{g}" if b else "") for d, b, g in PRECISIONS]
)
def test_rows_are_width_invariant(path, dtype, bits, group, device):
    try:
        target = load(path, dtype, bits, group, device)
        assert target.invariance in ("native", "kernels", "fixed-width"), target.invariance
        check_property(target, random.Random(SEED))
    finally:
        mx.set_default_device(mx.cpu)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype,bits,group",
    [("float32", None, None), ("bfloat16", None, None), ("bfloat16", 4, 64), ("float16", 8, 32)],
    ids=["float32", "bfloat16", "bf16-q4g64", "fp16-q8g32"],
)
def test_fixed_width_path_is_invariant(path, dtype, bits, group, device, monkeypatch):
    """The fixed-width path itself (padding, blocks wider than W, the invariant attention), forced
    where the native forward would already do: W = 16, so w = 17 runs as two blocks."""
    monkeypatch.setenv("MLX_DSPARK_INVARIANT", "force")
    try:
        target = load(path, dtype, bits, group, device)
        assert target.invariance == "forced" and target.decode_width == invariance.DEFAULT_WIDTH
        check_property(target, random.Random(SEED + 1))
    finally:
        mx.set_default_device(mx.cpu)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype,bits,group", PRECISIONS, ids=[f"{d}" + (f"-q{b}g{g}" if b else "") for d, b, g in PRECISIONS]
)
def test_kernel_path_is_width_invariant(path, dtype, bits, group, device, monkeypatch):
    """The invariant-kernel path itself (real widths, kernels/invariant_linear.py and the invariant
    attention), chosen even where the native forward would already do."""
    monkeypatch.setenv("MLX_DSPARK_INVARIANT", "kernels")
    try:
        target = load(path, dtype, bits, group, device)
        if target.invariance != "kernels":
            invariance._enable_kernels(target)
            pytest.fail(f"the load's self-check chose {target.invariance!r}: {first_moving_op(target)}")
        assert target.invariant_kernels and target.decode_width == 0
        if device == "gpu":  # what the GPU decodes with: the compiled graphs (models/compiled_decode.py)
            assert target.compiled_decode is not None
        check_property(target, random.Random(SEED + 2))
    finally:
        mx.set_default_device(mx.cpu)


def test_first_moving_op_names_the_op_whose_rows_move(path, monkeypatch):
    """The locator a failing kernel-path test reports: nothing on an invariant forward, and the
    attention where a stand-in makes it depend on the width."""
    from mlx_dspark.kernels import invariant

    monkeypatch.setenv("MLX_DSPARK_INVARIANT", "kernels")
    target = load(path, "float32", None, None, "cpu")
    assert target.invariance == "kernels" and first_moving_op(target).startswith("no op")
    real = invariant.invariant_attention
    monkeypatch.setattr(invariant, "invariant_attention", lambda q, k, v, s: real(q, k, v, s) + 1e-3 * (q.shape[2] > 1))
    got = first_moving_op(target)
    assert "(attention, output (1, 4, 6, 32)) first differs, at row 0" in got, got


def test_kernel_path_runs_at_the_real_width_through_the_kernels(path, monkeypatch):
    from mlx_dspark.kernels import invariant, invariant_linear

    monkeypatch.setenv("MLX_DSPARK_INVARIANT", "kernels")
    target = load(path, "float32", None, None, "cpu")
    attn, lin = [], []
    real_attn, real_call = invariant.invariant_attention, invariant_linear.call
    monkeypatch.setattr(invariant, "invariant_attention", lambda *a: attn.append(a[0].shape) or real_attn(*a))
    monkeypatch.setattr(invariant_linear, "call", lambda *a, **k: lin.append(a[1].shape) or real_call(*a, **k))
    cache = target.make_cache()
    target.forward(mx.array([[1, 2, 3, 4, 5]]), cache, last_only=True)  # prefill: MLX's own kernels
    assert attn == [] and lin == []
    out = target.forward(mx.array([[6, 7, 8]]), cache)
    assert out.logits.shape[1] == 3 and target.cache_len(cache) == 8
    assert len(attn) == 3 and all(s[2] == 3 for s in attn)  # one per layer, the block's own 3 queries
    # q, k, v, o, gate, up, down per layer and the lm_head, every one at 3 rows
    assert len(lin) == 3 * 7 + 1 and all(s[-2] == 3 for s in lin)


def test_fixed_width_path_routes_attention_and_trims_the_pad(path, monkeypatch):
    from mlx_dspark.kernels import invariant

    monkeypatch.setenv("MLX_DSPARK_INVARIANT", "force")
    target = load(path, "float32", None, None, "cpu")
    calls = []
    real = invariant.invariant_attention
    monkeypatch.setattr(invariant, "invariant_attention", lambda *a: calls.append(a[0].shape) or real(*a))
    cache = target.make_cache()
    target.forward(mx.array([[1, 2, 3, 4, 5]]), cache, last_only=True)  # prefill: MLX's own attention
    assert calls == []
    out = target.forward(mx.array([[6, 7, 8]]), cache)
    assert out.logits.shape[1] == 3 and target.cache_len(cache) == 8
    assert len(calls) == 3 and all(s[2] == invariance.DEFAULT_WIDTH for s in calls)  # one per layer, W queries


def test_modes_identical_on_the_fixed_width_path(path, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_INVARIANT", "force")
    target, tok = md.load_target(path, dtype="bfloat16")
    assert target.decode_width == invariance.DEFAULT_WIDTH
    prompt = "repeat: the fox the fox the fox def add(a, b)"
    base = md.generate(target, tok, prompt, mode="baseline", max_new_tokens=48)
    look = md.generate(target, tok, prompt, mode="lookup", max_new_tokens=48)
    assert look.tokens == base.tokens and look.text == base.text


def test_the_rows_check_prefills_once_and_still_catches_a_row_that_depends_on_width(path, monkeypatch):
    """rows_match prefills its prefix once and starts each variant from it after a trim (a prefill
    costs seconds on MLX's reference BLAS); it passes on CPU float32's native forward and fails
    when a row's logits depend on the forward's width, or when the split block's second half
    does not read the KV its first half wrote."""
    monkeypatch.setenv("MLX_DSPARK_INVARIANT", "off")
    target, _ = md.load_target(path, dtype="float32")
    prefills = []
    real = target.forward

    def counted(tokens, cache, taps=(), last_only=False):
        prefills.extend([1] if last_only else [])
        return real(tokens, cache, taps=taps, last_only=last_only)

    monkeypatch.setattr(target, "forward", counted)
    assert invariance.rows_match(target) and len(prefills) == 1

    def width_dependent(tokens, cache, taps=(), last_only=False):
        out = real(tokens, cache, taps=taps, last_only=last_only)
        if tokens.shape[1] > 1 and not last_only:
            out.logits = out.logits + 1e-6 * tokens.shape[1]
        return out

    monkeypatch.setattr(target, "forward", width_dependent)
    assert not invariance.rows_match(target)

    def forgets_its_kv(tokens, cache, taps=(), last_only=False):
        if tokens.shape[1] == 2:  # the split block's second half (6 = 4 + 2) reads no KV
            cache = target.make_cache()
        return real(tokens, cache, taps=taps, last_only=last_only)

    monkeypatch.setattr(target, "forward", forgets_its_kv)
    assert not invariance.rows_match(target)


def test_a_forward_that_is_not_invariant_is_reported(path, monkeypatch):
    """Where neither path is invariant, load warns (the drafting modes may differ) and keeps the
    native forward: nothing silently lossy."""
    monkeypatch.setattr(invariance, "rows_match", lambda target: False)
    monkeypatch.setattr(invariance, "_warned", set())
    with pytest.warns(UserWarning, match="may differ from --mode baseline"):
        target, _ = md.load_target(path, dtype="bfloat16")
    assert target.invariance == "none" and target.decode_width == 0


def test_the_verdict_is_kept_on_disk_and_reused(path, monkeypatch, tmp_path):
    """The measured verdict is stored (keyed by software, device, architecture, precision and
    settings) and reused at the next load without measuring; refresh, another setting, and a
    corrupt file measure again."""
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path))
    monkeypatch.setenv("MLX_DSPARK_INVARIANT_CACHE", "auto")
    calls = []
    real = invariance.rows_match
    monkeypatch.setattr(invariance, "rows_match", lambda t: calls.append(1) or real(t))
    first, _ = md.load_target(path, dtype="float32")
    measured = len(calls)
    assert measured >= 1 and first.invariance in invariance.VERDICTS
    files = list((tmp_path / "invariance").glob("*.json"))
    assert len(files) == 1
    again, _ = md.load_target(path, dtype="float32")
    assert again.invariance == first.invariance and len(calls) == measured  # from disk
    monkeypatch.setenv("MLX_DSPARK_INVARIANT_CACHE", "refresh")
    md.load_target(path, dtype="float32")
    assert len(calls) > measured
    monkeypatch.setenv("MLX_DSPARK_INVARIANT_CACHE", "auto")
    n = len(calls)
    monkeypatch.setenv("MLX_DSPARK_INVARIANT", "kernels")  # another setting: another key
    other, _ = md.load_target(path, dtype="float32")
    assert other.invariance == "kernels" and len(calls) > n and len(list((tmp_path / "invariance").glob("*.json"))) == 2
    monkeypatch.delenv("MLX_DSPARK_INVARIANT")
    files[0].write_text("{not json")
    n = len(calls)
    md.load_target(path, dtype="float32")
    assert len(calls) > n  # a corrupt entry is measured again, never trusted


@pytest.mark.parametrize(
    "kernels_s,prefill,want", [(0.5, False, "kernels"), (0.5, True, "kernels+prefill"), (0.9, True, "native")]
)
def test_on_the_cpu_the_faster_exact_path_is_taken(path, monkeypatch, kernels_s, prefill, want):
    """Where the native forward is invariant (CPU float32), the kernels are timed against it and
    taken only where they pass the check too and are clearly faster; where they are, prompts also
    prefill through them if that was timed faster too (MLX's reference BLAS). Either way every mode
    stays identical to baseline, ids and text."""
    monkeypatch.setattr(invariance, "KERNELS_MIN_PARAMS", 0)
    timed = []
    monkeypatch.setattr(
        invariance,
        "_forward_cost",
        lambda t: timed.append(t.invariant_kernels) or (kernels_s if t.invariant_kernels else 1.0),
    )
    monkeypatch.setattr(invariance, "_kernels_prefill_faster", lambda t: prefill)
    target, tok = md.load_target(path, dtype="float32")
    assert timed == [False, True]
    assert target.invariance == want and target.invariant_kernels == (want != "native")
    assert target.kernel_prefill == (want == "kernels+prefill")
    prompt = "one two three one two three one two"
    base = md.generate(target, tok, prompt, mode="baseline", max_new_tokens=32)
    look = md.generate(target, tok, prompt, mode="lookup", max_new_tokens=32)
    assert look.tokens == base.tokens and look.text == base.text


def test_a_kernel_prefill_writes_the_kv_that_plain_steps_write(path, monkeypatch):
    """Through the invariant kernels a prompt's prefill is width-invariant too: its KV and last
    logits equal, bit for bit, feeding the prompt one token at a time; MLX's native prefill is not
    (a different reduction order). The load times it on this machine and keeps the answer."""
    monkeypatch.setattr(invariance, "KERNELS_MIN_PARAMS", 0)
    monkeypatch.setattr(invariance, "_forward_cost", lambda t: 0.5 if t.invariant_kernels else 1.0)
    target, _ = md.load_target(path, dtype="float32")
    assert target.invariance in ("kernels", "kernels+prefill")
    ids = mx.array([[(7 * i + 3) % 500 for i in range(40)]], dtype=mx.int32)

    def prefilled(kernel_prefill: bool):
        target.kernel_prefill = kernel_prefill
        cache = target.make_cache()
        logits = target.forward(ids, cache, last_only=True).logits
        mx.eval(logits)
        return [logits[:, -1]] + [c.state[0][..., : c.offset, :] for c in cache]

    cache = target.make_cache()
    for j in range(ids.shape[1]):
        logits = target.forward(ids[:, j : j + 1], cache).logits
    stepped = [logits[:, -1]] + [c.state[0][..., : c.offset, :] for c in cache]
    assert all(mx.array_equal(a, b).item() for a, b in zip(prefilled(True), stepped))
    assert not all(mx.array_equal(a, b).item() for a, b in zip(prefilled(False), stepped))
    assert invariance._kernels_prefill_faster(target) in (True, False) and target.kernel_prefill is False


def test_a_small_model_or_a_failed_kernel_check_keeps_the_native_forward(path, monkeypatch):
    timed = []
    real_cost = invariance._forward_cost
    monkeypatch.setattr(invariance, "_forward_cost", lambda t: timed.append(1) or real_cost(t))
    target, _ = md.load_target(path, dtype="float32")  # ~0.3M parameters: below the threshold
    assert target.invariance == "native" and timed == []
    monkeypatch.setattr(invariance, "KERNELS_MIN_PARAMS", 0)
    real_match = invariance.rows_match
    monkeypatch.setattr(invariance, "rows_match", lambda t: not t.invariant_kernels and real_match(t))
    target, _ = md.load_target(path, dtype="float32")
    assert target.invariance == "native" and not target.invariant_kernels and timed == [1]
    assert real_cost(target) > 0
