"""Warm equals cold, bitwise: a prefill resumed from a prefix-cache hit computes every position in
the same chunk, over the same keys, as a cold prefill of the whole prompt (decode/loop.py's fixed
chunk grid, serve/prefix_cache.py's grid-aligned reuse). The thresholds are lowered so that a
400-token prompt crosses the CPU attention routing (kernels/cpu_attention.py) in some chunks and
not in others, as a 2k-token prompt does at the defaults."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlx_dspark as md
from mlx_dspark.decode import loop
from mlx_dspark.decode.sampling import SamplingParams
from mlx_dspark.kernels import cpu_attention
from mlx_dspark.serve.prefix_cache import PrefixCache

CHUNK = 64


@pytest.fixture(scope="module")
def target(model_dir):
    return md.load_target(str(model_dir("llama", scale=3.0, seed=2)))


@pytest.fixture(autouse=True)
def small_grid(monkeypatch):
    monkeypatch.setattr(loop, "PREFILL_CHUNK", CHUNK)
    # A full chunk over >= 128 keys goes through the numpy op, a short tail through MLX's.
    monkeypatch.setattr(cpu_attention, "MIN_SCORES", CHUNK * 128)


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


def test_a_warm_turn_gives_the_cold_tokens_text_and_logprobs(target):
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
    assert warm.cached_tokens == 192  # the first prompt's whole chunks: (233 - 1) // 64 * 64


@pytest.mark.parametrize("first_len", [150, 233, 256, 257])
def test_the_prefill_after_a_hit_gives_the_cold_logits_and_kv_bitwise(target, first_len):
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
    assert hit.reused == (first_len - 1) // CHUNK * CHUNK  # the first prompt's whole chunks


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
