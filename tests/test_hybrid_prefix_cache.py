"""Checkpoint-mode prefix cache (serve/prefix_cache.py) on targets whose caches cannot be
trimmed back: hybrid GDN (qwen3_5, qwen3_next) and sliding-window (gemma3_text) fixtures.
A warm run (the checkpoint of an earlier prompt restored, the rest prefilled) equals the cold
run token for token and in text; a miss says why, also in the server's `x_mlx_dspark`."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_hybrid import family
from test_rotating import gemma

import mlx_dspark as md
from mlx_dspark.serve.prefix_cache import PrefixCache

NAMES = ["qwen3_5", "qwen3_next", "gemma3_text"]


def load(name):
    if name == "gemma3_text":
        tgt, tok, drafters = gemma()
    else:
        tgt, tok, drafters = family(name)
    return tgt, tok, drafters["dspark"]


def run(tgt, tok, d, ids, mode, n, pc=None):
    return md.generate(
        tgt,
        tok,
        None,
        prompt_ids=ids,
        mode=mode,
        drafter=d if mode == "dspark" else None,
        max_new_tokens=n,
        prefix_cache=pc,
    )


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    name=st.sampled_from(NAMES),
    first=st.lists(st.integers(3, 300), min_size=2, max_size=20),
    turns=st.lists(
        st.tuples(
            st.lists(st.integers(3, 300), min_size=1, max_size=12), st.sampled_from(["baseline", "lookup", "dspark"])
        ),
        min_size=1,
        max_size=3,
    ),
    n=st.integers(1, 10),
)
def test_warm_equals_cold_along_a_conversation(name, first, turns, n):
    tgt, tok, d = load(name)
    pc = PrefixCache(tgt, slots=8)
    assert pc.mode == "checkpoint" and pc.enabled
    ids = list(first)
    res = run(tgt, tok, d, ids, "baseline", n, pc)
    assert res.prefix_cache["hit"] is False and "no checkpoint yet" in res.prefix_cache["miss"]
    stored = [(len(ids), "baseline")]  # the checkpoints so far: prompt length, the mode that made it
    for user, mode in turns:
        ids = ids + res.tokens + user  # the next turn extends the last prompt exactly
        warm = run(tgt, tok, d, ids, mode, n, pc)
        cold = run(tgt, tok, d, ids, mode, n)
        assert warm.tokens == cold.tokens and warm.text == cold.text
        # a drafter needs the tapped rows of the prefix: only a checkpoint a drafter run made has them
        fits = [L for L, m in stored if mode != "dspark" or m == "dspark"]
        if fits:
            assert warm.prefix_cache["hit"] and warm.cached_tokens == warm.prefix_cache["reused_tokens"] == max(fits)
        else:
            assert not warm.prefix_cache["hit"] and "drafter taps" in warm.prefix_cache["miss"]
        stored.append((len(ids), mode))
        res = warm


def test_misses_say_why():
    tgt, tok, d = load("qwen3_5")
    pc = PrefixCache(tgt)
    ids = md.encode_prompt(tok, "hello world the fox def add")
    run(tgt, tok, d, ids, "baseline", 4, pc)
    same = run(tgt, tok, d, ids, "baseline", 4, pc)
    assert not same.prefix_cache["hit"] and "cached prompt itself" in same.prefix_cache["miss"]
    other = ids[:3] + tok.encode("café café 1 2 3", add_special_tokens=False)
    r = run(tgt, tok, d, other, "baseline", 4, pc)
    assert not r.prefix_cache["hit"]
    assert "diverges from the closest checkpoint at token 3" in r.prefix_cache["miss"]
    assert "café" in r.prefix_cache["miss"]  # the text where it diverged, decoded
    assert r.tokens == run(tgt, tok, d, other, "baseline", 4).tokens
    assert pc.describe()["mode"] == "checkpoint" and pc.describe()["misses"] >= 3


def test_the_miss_reaches_x_mlx_dspark():
    from mlx_dspark.serve.engine import x_block

    tgt, tok, d = load("gemma3_text")
    pc = PrefixCache(tgt)
    res = run(tgt, tok, d, [5, 6, 7, 8], "lookup", 3, pc)
    job = SimpleNamespace(
        outcome=SimpleNamespace(result=res), queue_s=0.0, ttft_s=None, batched=False, batch_reason=None
    )
    blk = x_block(SimpleNamespace(resolved_mode="lookup", mode="lookup"), job)
    assert blk["prefix_cache"]["mode"] == "checkpoint" and blk["prefix_cache"]["hit"] is False
    assert "no checkpoint yet" in blk["prefix_cache"]["miss"]
    hit = run(tgt, tok, d, [5, 6, 7, 8] + res.tokens + [9], "lookup", 3, pc)
    job.outcome = SimpleNamespace(result=hit)
    blk = x_block(SimpleNamespace(resolved_mode="lookup", mode="lookup"), job)
    assert blk["prefix_cache"]["hit"] is True and blk["prefix_cache"]["reused_tokens"] == 4


def test_the_checkpoint_is_not_written_through():
    """Restoring an entry twice and decoding on it leaves the entry as it was."""
    tgt, tok, d = load("qwen3_next")
    pc = PrefixCache(tgt)
    ids = [5, 9, 13, 17, 21]
    a = run(tgt, tok, d, ids, "baseline", 6, pc)
    nxt = ids + a.tokens + [3]
    first = run(tgt, tok, d, nxt, "lookup", 8, pc)
    pc.ram = [e for e in pc.ram if len(e.tokens) == len(ids)]  # keep only the first checkpoint
    again = run(tgt, tok, d, nxt, "baseline", 8, pc)
    assert again.prefix_cache["hit"] and again.tokens == first.tokens and again.text == first.text
