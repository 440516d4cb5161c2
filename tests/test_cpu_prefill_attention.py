"""The CPU prefill attention (kernels/cpu_attention.py): both ops (the blocked one and the
split-invariant one) match MLX's attention on fresh random inputs, are routed only inside a
prefill chunk, and a long prefill through the blocked op (the split-invariant prefill off) gives
the same last-row logits and the same greedy text as MLX's own kernel."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlx_dspark as md
from mlx_dspark.decode import loop
from mlx_dspark.kernels import cpu_attention


def _reference(q, k, v, scale):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")


@pytest.mark.parametrize(
    "B,H,Hkv,Lq,Lk,D,block",
    [
        (1, 9, 3, 300, 1000, 64, 1 << 14),  # grouped heads, a cache before the chunk, many blocks
        (2, 4, 4, 257, 257, 32, 1 << 12),  # no cache, odd rows, two batch rows
        (1, 8, 2, 33, 5000, 16, 1 << 23),  # one block, long cache
        (1, 2, 1, 64, 64, 128, 1 << 10),  # the 16-row floor on the block
    ],
)
def test_matches_mlx_attention_on_random_inputs(monkeypatch, B, H, Hkv, Lq, Lk, D, block):
    monkeypatch.setattr(cpu_attention, "BLOCK_FLOATS", block)
    rng = np.random.default_rng(Lq * 7 + Lk)
    q, k, v = (
        mx.array(rng.standard_normal(s).astype(np.float32) * 2)
        for s in ((B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, D))
    )
    scale = D**-0.5
    ref = _reference(q, k, v, scale)
    for got in (cpu_attention.attention(q, k, v, scale), cpu_attention.attention_split(q, k, v, scale)):
        assert got.shape == ref.shape and got.dtype == mx.float32
        np.testing.assert_allclose(np.array(got), np.array(ref), atol=2e-5, rtol=1e-4)


def test_sliced_cache_views_are_read_as_mlx_lays_them_out():
    """mlx-lm hands attention a slice of its preallocated cache (keys[..., :offset, :])."""
    rng = np.random.default_rng(3)
    big_k = mx.array(rng.standard_normal((1, 2, 700, 16)).astype(np.float32))
    big_v = mx.array(rng.standard_normal((1, 2, 700, 16)).astype(np.float32))
    q = mx.array(rng.standard_normal((1, 4, 100, 16)).astype(np.float32))
    k, v = big_k[..., :513, :], big_v[..., :513, :]
    np.testing.assert_allclose(
        np.array(cpu_attention.attention(q, k, v, 0.25)), np.array(_reference(q, k, v, 0.25)), atol=2e-5, rtol=1e-4
    )


def test_routed_only_inside_a_prefill_block_and_only_for_long_float32_causal_calls(monkeypatch):
    calls = []
    real = cpu_attention.attention
    monkeypatch.setattr(cpu_attention, "attention", lambda *a: calls.append(a[0].shape) or real(*a))
    monkeypatch.setattr(cpu_attention, "MIN_SCORES", 64 * 64)
    rng = np.random.default_rng(0)
    q = mx.array(rng.standard_normal((1, 2, 64, 16)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 2, 64, 16)).astype(np.float32))
    sdpa = lambda q, k, mask="causal": mx.fast.scaled_dot_product_attention(q, k, k, scale=0.25, mask=mask)  # noqa: E731
    with cpu_attention.active():
        routed = sdpa(q, k)
        assert len(calls) == 1
        sdpa(q.astype(mx.float16), k.astype(mx.float16))  # not float32
        sdpa(q[:, :, :1], k)  # one query (a decode step)
        sdpa(q[:, :, :32], k)  # below MIN_SCORES
        sdpa(q, k, mask=mx.ones((64, 64), dtype=mx.bool_))  # an array mask
        assert len(calls) == 1
    sdpa(q, k)  # outside the block
    assert len(calls) == 1
    np.testing.assert_allclose(np.array(routed), np.array(sdpa(q, k)), atol=2e-5, rtol=1e-4)


def test_inside_split_invariant_every_causal_float32_call_goes_to_the_split_op(monkeypatch):
    calls = []
    real = cpu_attention.attention_split
    monkeypatch.setattr(cpu_attention, "attention_split", lambda *a: calls.append(a[0].shape[2]) or real(*a))
    rng = np.random.default_rng(1)
    q = mx.array(rng.standard_normal((1, 2, 64, 16)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 2, 64, 16)).astype(np.float32))
    sdpa = lambda q, k, mask="causal": mx.fast.scaled_dot_product_attention(q, k, k, scale=0.25, mask=mask)  # noqa: E731
    with cpu_attention.active(), cpu_attention.split_invariant():
        sdpa(q[:, :, :3], k)  # far below MIN_SCORES
        lone = sdpa(q[:, :, :1], k, mask=None)  # a lone row (mlx-lm passes no mask for one query)
        sdpa(q.astype(mx.float16), k.astype(mx.float16))  # not float32
        sdpa(q, k, mask=mx.ones((64, 64), dtype=mx.bool_))  # an array mask
    assert calls == [3, 1]
    np.testing.assert_allclose(np.array(lone), np.array(sdpa(q[:, :, :1], k, mask=None)), atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def target(model_dir):
    t, tok = md.load_target(str(model_dir("llama", scale=3.0, seed=2)))
    return t, tok


def test_long_prefill_through_it_gives_mlx_logits_and_text(target, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_SPLIT_PREFILL", "off")  # the blocked op and its MIN_SCORES routing
    t, tok = target
    monkeypatch.setattr(loop, "PREFILL_CHUNK", 96)
    prompt = [int(x) for x in np.random.default_rng(5).integers(10, 300, size=400)]
    calls = []
    real = cpu_attention.attention
    monkeypatch.setattr(cpu_attention, "attention", lambda *a: calls.append(a[0].shape[2]) or real(*a))

    def last_logits(min_scores):
        monkeypatch.setattr(cpu_attention, "MIN_SCORES", min_scores)
        logits, _ = loop._prefill(t, t.make_cache(), prompt, ())
        return np.array(logits)

    ours = last_logits(1)
    assert calls and set(calls) == {96, 399 - 4 * 96}  # every chunk of every layer went through it
    n = len(calls)
    theirs = last_logits(1 << 60)
    assert len(calls) == n
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    assert int(np.argmax(ours)) == int(np.argmax(theirs))

    def greedy(min_scores):
        monkeypatch.setattr(cpu_attention, "MIN_SCORES", min_scores)
        res = md.generate(t, tok, None, prompt_ids=prompt, mode="baseline", max_new_tokens=12)
        return res.tokens, res.text

    assert greedy(1) == greedy(1 << 60)
