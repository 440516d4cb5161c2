"""Warm equals cold, bitwise, on both prefill paths of the CPU in float32:

  split   (the default here) kernels/split_prefill.py: a chunk's rows do not depend on the split,
          so an entry keeps every prefilled position and a hit reuses all the shared tokens but
          the last; checked for random split points and through the real PrefixCache;
  grid    (MLX_DSPARK_SPLIT_PREFILL=off, the fallback of GPUs and other dtypes) a prefill resumed
          from a hit computes every position in the same chunk, over the same keys, as a cold
          prefill (decode/loop.py's fixed chunk grid, serve/prefix_cache.py's aligned reuse).

The thresholds are lowered so that a 400-token prompt crosses the CPU attention routing
(kernels/cpu_attention.py) in some chunks and not in others, as a 2k-token prompt does at the
defaults. The tiny model is written to disk and loaded as a user would, in float32."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mlx_dspark as md
from mlx_dspark.decode import loop
from mlx_dspark.decode.sampling import SamplingParams
from mlx_dspark.kernels import cpu_attention, split_prefill
from mlx_dspark.serve.prefix_cache import PrefixCache

CHUNK = 64


@pytest.fixture(scope="module")
def target(model_dir):
    return md.load_target(str(model_dir("llama", scale=3.0, seed=2)), dtype="float32")


@pytest.fixture(autouse=True)
def small_grid(monkeypatch):
    monkeypatch.setattr(loop, "PREFILL_CHUNK", CHUNK)
    # A full chunk over >= 128 keys goes through the numpy op, a short tail through MLX's.
    monkeypatch.setattr(cpu_attention, "MIN_SCORES", CHUNK * 128)


@pytest.fixture(params=["split", "grid"])
def path(request, monkeypatch, target):
    if request.param == "grid":
        monkeypatch.setenv("MLX_DSPARK_SPLIT_PREFILL", "off")
    t = target[0]
    assert (split_prefill.supported(t, t.make_cache()) is None) == (request.param == "split")
    assert split_prefill.verified(t) == (request.param == "split")
    return request.param


def _reused(path, first_len):
    """What a hit after a first prompt of first_len tokens reuses: every prefilled position (all
    but its last token) on the split-invariant path, its whole chunks of the grid on the other."""
    return first_len - 1 if path == "split" else (first_len - 1) // CHUNK * CHUNK


def _prompt(n, seed=5):
    return [int(x) for x in np.random.default_rng(seed).integers(10, 300, size=n)]


def _generate(t, tok, ids, pc=None, n=10):
    return md.generate(
        t,
        tok,
        None,
        prompt_ids=ids,
        mode="baseline",
        max_new_tokens=n,
        prefix_cache=pc,
        sampling=SamplingParams(logprobs=True, top_logprobs=5),
    )


def test_a_warm_turn_gives_the_cold_tokens_text_and_logprobs(target, path):
    t, tok = target
    calls = []
    real = cpu_attention.attention
    pc = PrefixCache(t)
    first = _generate(t, tok, _prompt(233), pc)
    ids = _prompt(233) + first.tokens + _prompt(160, seed=6)
    try:
        cpu_attention.attention = lambda *a: calls.append(a[0].shape[2]) or real(*a)
        warm = _generate(t, tok, ids, pc)
    finally:
        cpu_attention.attention = real
    assert calls, "the warm turn should cross the routing threshold for this test to mean anything"
    cold = _generate(t, tok, ids)
    assert cold.cached_tokens == 0
    assert warm.tokens == cold.tokens and warm.text == cold.text
    assert warm.logprobs == cold.logprobs  # float for float: the logits the tokens came from
    assert warm.cached_tokens == _reused(path, 233)


@pytest.mark.parametrize("first_len", [150, 233, 256, 257])
def test_the_prefill_after_a_hit_gives_the_cold_logits_and_kv_bitwise(target, path, first_len):
    t, _ = target
    ids = _prompt(400)
    pc = PrefixCache(t)
    _generate(t, target[1], ids[:first_len], pc, n=3)  # generate() stores the finished generation's cache
    hit = pc.lookup(ids)
    assert hit is not None
    warm, _ = loop._prefill(t, hit.cache, ids[hit.reused :], ())
    cache = t.make_cache()
    cold, _ = loop._prefill(t, cache, ids, ())
    assert np.array_equal(np.array(warm), np.array(cold))
    for a, b in zip(cache, hit.cache):
        assert a.offset == b.offset == len(ids)
        assert np.array_equal(np.array(a.keys[..., : len(ids), :]), np.array(b.keys[..., : len(ids), :]))
        assert np.array_equal(np.array(a.values[..., : len(ids), :]), np.array(b.values[..., : len(ids), :]))
    assert hit.reused == _reused(path, first_len)


def test_prefill_chunks_end_on_the_grid_from_the_cache_start(target, monkeypatch):
    t, _ = target
    widths = []
    real = t.forward

    def forward(x, cache, **kw):
        widths.append((cache[0].offset, x.shape[1]))
        return real(x, cache, **kw)

    monkeypatch.setattr(t, "forward", forward)
    cache = t.make_cache()
    ids = _prompt(300)
    loop._prefill(t, cache, ids[:100], ())
    assert widths == [(0, 64), (64, 35), (99, 1)]
    mx.eval([c.state for c in cache])
    for c in cache:
        c.trim(c.offset - 70)  # a cache resumed off the grid still meets it at the next multiple
    widths.clear()
    loop._prefill(t, cache, ids[70:300], ())
    assert widths == [(70, 58), (128, 64), (192, 64), (256, 43), (299, 1)]


def _kv(cache, n):
    return [(np.array(c.keys[..., :n, :]), np.array(c.values[..., :n, :])) for c in cache]


@pytest.fixture(scope="module")
def qtarget(model_dir):
    """The same family quantized (nn.QuantizedLinear layers: dequantized per call on this path)."""
    return md.load_target(str(model_dir("llama", scale=3.0, seed=2)), dtype="float32", quantize=4)


@pytest.mark.parametrize("seed,quantized", [(0, False), (1, False), (2, False), (3, True), (4, True)])
def test_split_invariant_prefill_any_split_gives_the_cold_kv_and_logits(target, qtarget, seed, quantized):
    """Chunks ending anywhere (lone rows too, the grid's boundary crossed or not) give bitwise the
    KV and last logits of one cold prefill: the split-invariant path, not the grid, makes it so."""
    t, _ = qtarget if quantized else target
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in t.model.named_modules()) == quantized
    assert split_prefill.supported(t, t.make_cache()) is None
    rng = np.random.default_rng(seed)
    n = int(rng.integers(150, 330))
    ids = _prompt(n, seed=seed + 10)
    cold_cache = t.make_cache()
    cold, _ = loop._prefill(t, cold_cache, ids, ())
    cuts = sorted({int(x) for x in rng.integers(1, n - 1, size=int(rng.integers(1, 5)))} | {int(rng.integers(1, 5))})
    cache = t.make_cache()
    start = 0
    for end in cuts:  # what a chain of warm turns leaves: prefill chunks only, no lone last token
        loop.prefill_chunk(t, cache, mx.array(ids[start:end], dtype=mx.int32)[None], ())
        start = end
    warm, _ = loop._prefill(t, cache, ids[start:], ())
    assert np.array_equal(np.array(warm), np.array(cold)), cuts
    for (ka, va), (kb, vb) in zip(_kv(cold_cache, n), _kv(cache, n)):
        assert np.array_equal(ka, kb) and np.array_equal(va, vb), cuts


def test_the_grid_alone_is_not_split_invariant(target, monkeypatch):
    """The premise: off the split-invariant path the same splits do change bits somewhere (else
    the test above would pass without it). The native forward, MLX's attention below MIN_SCORES,
    and the BLAS product: a split at an odd point moves some row's arithmetic."""
    monkeypatch.setenv("MLX_DSPARK_SPLIT_PREFILL", "off")
    t, _ = target
    ids = _prompt(300, seed=3)
    cold_cache = t.make_cache()
    loop._prefill(t, cold_cache, ids, ())
    differs = 0
    for cut in (1, 37, 101, 190):
        cache = t.make_cache()
        loop.prefill_chunk(t, cache, mx.array(ids[:cut], dtype=mx.int32)[None], ())
        loop._prefill(t, cache, ids[cut:], ())
        differs += any(
            not (np.array_equal(ka, kb) and np.array_equal(va, vb))
            for (ka, va), (kb, vb) in zip(_kv(cold_cache, 299), _kv(cache, 299))
        )
    assert differs


def test_multi_turn_conversation_reuses_every_prefilled_token(target):
    """Three turns of one conversation through one PrefixCache: each turn reuses all of the last
    prompt but its last token, and its tokens, text and logprobs equal a cold run's."""
    t, tok = target
    pc = PrefixCache(t)
    assert pc.grid == 1
    ids = _prompt(41, seed=7)
    prev = 1
    for turn in range(3):
        warm = _generate(t, tok, ids, pc, n=6)
        cold = _generate(t, tok, ids, n=6)
        assert (warm.tokens, warm.text, warm.logprobs) == (cold.tokens, cold.text, cold.logprobs), turn
        assert warm.cached_tokens == prev - 1
        prev = len(ids)
        ids = ids + warm.tokens + _prompt(23 + 9 * turn, seed=20 + turn)


def test_what_the_split_path_does_not_serve_says_why(model_dir, monkeypatch):
    t16, _ = md.load_target(str(model_dir("llama", scale=3.0, seed=2)), dtype="bfloat16")
    assert "bfloat16" in split_prefill.supported(t16, t16.make_cache())
    assert not split_prefill.verified(t16) and PrefixCache(t16).grid == CHUNK


def test_the_split_path_computes_what_the_other_path_does_to_rounding(target, monkeypatch):
    """Other bits, same numbers: the split-invariant prefill's last logits match the BLAS path's
    to float32 rounding, and greedy decoding from both gives the same tokens."""
    t, tok = target
    ids = _prompt(300, seed=9)
    split, _ = loop._prefill(t, t.make_cache(), ids, ())
    split_res = _generate(t, tok, ids, n=8)
    monkeypatch.setenv("MLX_DSPARK_SPLIT_PREFILL", "off")
    other, _ = loop._prefill(t, t.make_cache(), ids, ())
    np.testing.assert_allclose(np.array(split), np.array(other), atol=1e-4, rtol=1e-4)
    assert _generate(t, tok, ids, n=8).tokens == split_res.tokens


def test_the_self_check_catches_an_op_that_depends_on_the_split(target, monkeypatch):
    """verified() trusts a measurement: with the blocked attention (rows follow their chunk) in
    place of attention_split, the same self-check fails and the cache would keep the grid."""
    t, _ = target
    assert split_prefill._self_check(t)
    monkeypatch.setattr(cpu_attention, "attention_split", cpu_attention.attention_blocks)
    assert not split_prefill._self_check(t)
