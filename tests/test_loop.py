"""The one verify loop: baseline and lookup are lossless, lookup earns its keep."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlx_dspark as md
from mlx_dspark.decode import loop
from mlx_dspark.decode.lookup import LookupProposer
from mlx_dspark.decode.proposers import Draft, Proposer

WORDS = [
    "the",
    "fox",
    "def",
    "add",
    "(a, b)",
    "return",
    "print",
    "Paris",
    "weather",
    "1 2 3",
    "{",
    "}",
    "café",
    "日本語",
    "repeat",
    "hello",
    "world",
    "\n",
    "    ",
    "x = x + 1",
]


@pytest.fixture(scope="module")
def targets(model_dir):
    out = {}
    # Scales chosen so greedy output is varied (2.0, 4.0) as well as repetitive (1.0).
    for family, scale, seed in [("qwen3", 4.0, 1), ("llama", 3.0, 2), ("qwen3", 1.0, 3)]:
        t, tok = md.load_target(str(model_dir(family, scale=scale, seed=seed)))
        out[(family, scale)] = (t, tok)
    return out


def independent_greedy(target, prompt_ids, n, stops):
    """Plain mlx-lm greedy decoding, written without any of our loop code."""
    from mlx_lm.generate import generate_step

    out = []
    for tok, _ in generate_step(
        mx.array(prompt_ids), target.model, max_tokens=n, sampler=lambda lp: mx.argmax(lp, axis=-1)
    ):
        tok = int(tok)
        if tok in stops:
            break
        out.append(tok)
    return out


prompts = st.lists(st.sampled_from(WORDS), min_size=1, max_size=12).map(" ".join)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=prompts, n=st.integers(1, 48), which=st.integers(0, 2), long_draft=st.sampled_from([8, 32]))
def test_lookup_equals_baseline_equals_mlx_lm(targets, prompt, n, which, long_draft):
    target, tok = list(targets.values())[which]
    ids = md.encode_prompt(tok, prompt)
    base = md.generate(target, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=n)
    look = md.generate(target, tok, None, prompt_ids=ids, mode="lookup", max_new_tokens=n, lookup_long_draft=long_draft)
    assert look.tokens == base.tokens
    assert len(base.tokens) <= n
    ref = independent_greedy(target, ids, n, set(md.api.stop_token_ids(target, tok)))
    assert base.tokens == ref
    assert sum(look.accept_lengths) in (len(look.tokens) - 1, len(look.tokens))


def test_lookup_commits_several_tokens_per_round_on_repeats(targets):
    target, tok = targets[("qwen3", 1.0)]
    passage = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    prompt = f"Please repeat the following passage exactly.\n{passage}"
    base = md.generate(target, tok, prompt, mode="baseline", max_new_tokens=120)
    look = md.generate(target, tok, prompt, mode="lookup", max_new_tokens=120)
    assert look.tokens == base.tokens
    assert look.mean_accept_len > 1.5, look.accept_lengths
    assert base.mean_accept_len == 1.0
    assert look.rounds < base.rounds


class _ScriptedProposer(Proposer):
    """Proposes a fixed mix of right and wrong tokens, to exercise partial accepts and rollback."""

    name = "scripted"

    def __init__(self, truth):
        self.truth = truth
        self.n_prompt = 0
        self.calls = 0

    def begin(self, target, prompt_ids, prompt_hidden):
        self.n_prompt = len(prompt_ids)

    def wants_round(self, history):
        return True

    def propose(self, history, max_draft, sampling):
        self.calls += 1
        pos = len(history) - self.n_prompt
        right = self.truth[pos : pos + max_draft]
        cut = self.calls % (len(right) + 1) if right else 0
        wrong = [(t + 1) % 300 for t in right[cut:]]
        return Draft(tokens=right[:cut] + wrong)


def test_partial_accepts_and_rollback_stay_exact(targets):
    target, tok = targets[("qwen3", 4.0)]
    ids = md.encode_prompt(tok, "hello world the fox")
    base = md.generate(target, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=60)
    prop = _ScriptedProposer(base.tokens + [0] * 64)
    res = md.generate(target, tok, None, prompt_ids=ids, proposer=prop, max_new_tokens=60, max_draft=5)
    assert res.tokens == base.tokens
    assert max(res.accept_lengths) > 1 and min(res.accept_lengths) == 1


def test_cache_is_trimmed_to_the_committed_length(targets):
    target, tok = targets[("llama", 3.0)]
    ids = md.encode_prompt(tok, "the fox def add")
    cache = target.make_cache()
    res = loop.run(target, ids, LookupProposer(), max_new_tokens=40, max_draft=8, cache=cache)
    # The last committed token is never in the cache.
    assert target.cache_len(cache) == len(ids) + len(res.tokens) - 1


def test_kv_bits_and_quantized_target_stay_lossless(model_dir):
    path = str(model_dir("llama", scale=1.0, seed=5, hidden=128))
    for kw in ({"kv_bits": 8}, {"quantize": 8}):
        target, tok = md.load_target(path, **kw)
        prompt = "repeat: the fox the fox the fox"
        base = md.generate(target, tok, prompt, mode="baseline", max_new_tokens=40)
        look = md.generate(target, tok, prompt, mode="lookup", max_new_tokens=40)
        assert look.tokens == base.tokens, kw


def test_stop_strings_and_callbacks(targets):
    target, tok = targets[("qwen3", 4.0)]
    full = md.generate(target, tok, "hello world", mode="baseline", max_new_tokens=30)
    stop = full.text[10:14]
    assert stop
    chunks = []
    res = md.generate(target, tok, "hello world", mode="lookup", max_new_tokens=30, stop=[stop], on_text=chunks.append)
    assert res.text == full.text[: full.text.find(stop)]
    assert "".join(chunks) == res.text
    assert res.finish_reason == "stop"
    # Cancellation stops within one round.
    seen = []
    res = md.generate(
        target,
        tok,
        "hello world",
        mode="baseline",
        max_new_tokens=30,
        on_text=seen.append,
        cancel=lambda: len(seen) >= 1,
    )
    assert res.finish_reason == "cancelled" and len(res.tokens) <= 3


def test_stream_generate_yields_text_then_result(targets):
    target, tok = targets[("qwen3", 4.0)]
    items = list(md.stream_generate(target, tok, "hello world", mode="lookup", max_new_tokens=20))
    assert isinstance(items[-1], md.GenerationResult)
    assert "".join(items[:-1]) == items[-1].text


def test_text_stream_is_safe_for_split_multibyte_characters(targets):
    _, tok = targets[("qwen3", 4.0)]
    text = "日本語 🙂 café naïve"
    ids = tok.encode(text, add_special_tokens=False)
    chunks = []
    stream = md.api.TextStream(tok, on_text=chunks.append, keep_leading_space=True)
    for t in ids:
        stream.add([t])
    assert stream.finish() == text
    assert "".join(chunks) == text
    assert not any("\ufffd" in c for c in chunks)
    assert len(ids) > len(text.split())  # characters really were split across tokens


def test_stop_string_cuts_tokens_at_the_completing_token(targets):
    target, tok = targets[("qwen3", 1.0)]
    prompt = "repeat: the fox the fox the fox"
    full = md.generate(target, tok, prompt, mode="baseline", max_new_tokens=60)
    stop = full.text[20:23]
    assert stop and stop in full.text
    for mode in ("baseline", "lookup"):
        res = md.generate(target, tok, prompt, mode=mode, max_new_tokens=60, stop=[stop])
        need = next(i for i in range(1, len(full.tokens) + 1) if stop in tok.decode(full.tokens[:i]))
        assert res.stop_string == stop and res.finish_reason == "stop"
        assert res.tokens == full.tokens[:need], mode


def test_prefill_reports_progress_and_a_prefix_hit_starts_past_it(targets, monkeypatch):
    from mlx_dspark.serve.prefix_cache import PrefixCache

    target, tok = targets[("qwen3", 4.0)]
    monkeypatch.setattr(loop, "PREFILL_CHUNK", 8)
    ids = md.encode_prompt(tok, " ".join(WORDS))
    seen = []
    pc = PrefixCache(target)
    res = md.generate(
        target,
        tok,
        None,
        prompt_ids=ids,
        mode="baseline",
        max_new_tokens=4,
        prefix_cache=pc,
        on_prefill=lambda done, total: seen.append((done, total)),
    )
    n = len(ids)
    assert seen == [(min(8 * (i + 1), n - 1), n) for i in range((n - 2) // 8 + 1)]
    seen.clear()
    again = md.generate(
        target,
        tok,
        None,
        prompt_ids=ids + res.tokens + [5] * 9,
        mode="baseline",
        max_new_tokens=4,
        prefix_cache=pc,
        on_prefill=lambda done, total: seen.append((done, total)),
    )
    # the cache keeps the first prompt's prefilled positions: all of them where the prefill is
    # split-invariant (pc.grid 1), else its whole chunks of the fixed grid (warm equals cold bitwise)
    assert again.cached_tokens == (n - 1) // pc.grid * pc.grid and seen[0] == (
        again.cached_tokens,
        n + len(res.tokens) + 9,
    )
    assert seen[-1][0] == n + len(res.tokens) + 8


def test_a_second_target_over_the_same_model_records_its_taps(targets):
    """Decoder layers tapped once keep their recorder, which a second Target over the same model
    shares (it used to get a recorder of its own that the layers never filled)."""
    from mlx_dspark.models.target import Target

    first, _ = targets[("llama", 3.0)]
    second = Target(first.model, first.tokenizer, first.config, name="again")
    ids = mx.array([[5, 6, 7]], dtype=mx.int32)
    out = second.forward(ids, second.make_cache(), taps=(0, 1))
    ref = first.forward(ids, first.make_cache(), taps=(0, 1))
    assert out.hidden is not None and bool(mx.array_equal(out.hidden, ref.hidden).item())
