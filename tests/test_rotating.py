"""Sliding-window targets (mlx-lm RotatingKVCache): exact rollback and exact verify rows after
the window has wrapped; speculation keeps running past the window, token- and text-identical.

Fixture: a tiny random gemma3_text model (tests/family_fixtures.py) whose sliding window (8)
is much shorter than the conversations, loaded from disk as a user's folder is, CPU float32.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from drafter_fixtures import write_deepspec, write_zlab
from family_fixtures import text_view, write_family
from fixtures import scratch_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_loop import _ScriptedProposer, independent_greedy

import mlx_dspark as md
from mlx_dspark.decode import loop
from mlx_dspark.models import hybrid, sliding
from mlx_dspark.models.drafters import load_drafter

WINDOW = 8
_ROOT = scratch_dir("mlx-dspark-rotating-")
_LOADED: dict = {}


def gemma(seed: int = 3):
    if seed not in _LOADED:
        path = write_family(_ROOT / f"gemma3-{seed}", "gemma3_text", window=WINDOW, seed=seed)
        tgt, tok = md.load_target(str(path), dtype="float32")
        view = text_view(path, _ROOT / f"gemma3-{seed}-view")
        drafters = {
            "dspark": load_drafter(str(write_deepspec(_ROOT / f"g{seed}-dspark", view)), tgt, bits=16),
            "dflash": load_drafter(str(write_zlab(_ROOT / f"g{seed}-dflash", view)), tgt, bits=16),
        }
        _LOADED[seed] = (tgt, tok, drafters)
    return _LOADED[seed]


def assert_same_states(a, b):
    sa, sb = hybrid._states(a), hybrid._states(b)
    assert len(sa) == len(sb)
    for x, y in zip(sa, sb):
        assert x.shape == y.shape and np.array_equal(np.array(x), np.array(y))  # layout and contents


def test_gemma3_loads_with_rewindable_caches():
    tgt, _, _ = gemma()
    assert tgt.rollback_kind == "rewind" and tgt.rollback_refusal is None
    cache = tgt.make_cache()
    assert {type(c).__name__ for c in cache} == {"RewindableRotatingKVCache", "KVCache"}
    assert tgt.can_trim(cache, 7)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_verify_rows_and_rewind_match_plain_steps_past_the_window(data):
    """After any prefix (before, at and long after the wrap) a verify of S tokens gives each row
    bitwise the logits of a plain step, and rewinding to any accept point leaves the ring (slots,
    contents, offset, index) bitwise as plain decoding leaves it."""
    tgt, _, _ = gemma()
    V = tgt.vocab_size
    prompt = data.draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=30))
    steps = data.draw(st.lists(st.integers(0, V - 1), max_size=12))  # plain steps before the round
    block = data.draw(st.lists(st.integers(0, V - 1), min_size=2, max_size=9))
    n = data.draw(st.integers(0, len(block)))
    wide, plain = tgt.make_cache(), tgt.make_cache()
    for c in (wide, plain):
        tgt.forward(mx.array([prompt]), c, last_only=True)
        for t in steps:
            tgt.forward(mx.array([[t]]), c)
    rows = tgt.forward(mx.array([block]), wide).logits[0]
    tgt.trim(wide, n)
    ref = [tgt.forward(mx.array([[t]]), plain).logits[0, 0] for t in block[: len(block) - n]]
    for i, r in enumerate(ref):
        assert np.array_equal(np.array(rows[i]), np.array(r)), f"verify row {i} differs from the plain step"
    assert_same_states(wide, plain)


def test_rewinding_a_one_token_step_after_the_wrap_then_continuing_is_exact():
    """The loop's last step is dropped with rewind(1): the slot keeps the dropped token's key
    where the ring held an expired one. Feeding on (one token, or a verify block) is exact."""
    tgt, _, _ = gemma()
    seq = list(range(3, 40))
    for cont in ([50], [50, 51, 52]):
        a, b = tgt.make_cache(), tgt.make_cache()
        for c in (a, b):
            tgt.forward(mx.array([seq[:20]]), c, last_only=True)
            for t in seq[20:]:
                tgt.forward(mx.array([[t]]), c)
        tgt.forward(mx.array([[99]]), a)
        tgt.trim(a, 1)
        la = tgt.forward(mx.array([cont]), a).logits
        lb = mx.concatenate([tgt.forward(mx.array([[t]]), b).logits for t in cont], axis=1)
        assert np.array_equal(np.array(la), np.array(lb))
        tgt.trim(a, 0)
        assert_same_states(a, b)


def test_a_ring_rewind_that_forgets_the_overwritten_entries_is_refused(monkeypatch):
    """The load-time proof can fail: mlx-lm's own trim arithmetic after the wrap (what the
    rotating cache does without the round's record) is caught, and drafting is not allowed."""
    path = write_family(_ROOT / "broken", "gemma3_text", window=WINDOW, seed=9)

    def forgetful(self, n):
        self._round = None
        if n > 0:
            self.offset -= n
            self._idx -= n

    monkeypatch.setattr(sliding.RewindableRotatingKVCache, "rewind", forgetful)
    tgt, _ = md.load_target(str(path), dtype="float32")
    assert tgt.rollback_kind.startswith("none (")
    cache = tgt.make_cache()  # mlx-lm's own caches: trimmable only until the window fills
    assert not any(isinstance(c, sliding.RewindableRotatingKVCache) for c in cache)
    tgt.forward(mx.array([list(range(3, 3 + 2 * WINDOW))]), cache, last_only=True)
    assert not tgt.can_trim(cache, 3)


@settings(max_examples=60, deadline=None)
@given(
    buffer=st.integers(0, 14),
    offset=st.integers(0, 40),
    idx=st.integers(0, 14),
    keep=st.sampled_from([0, 0, 2]),
    width=st.integers(2, 9),
)
def test_verify_layout_shows_each_query_its_plain_ring(buffer, offset, idx, keep, width):
    """For ring states mlx-lm can be in (before full, just after a wide prefill, full), each
    query of the merged layout sees exactly the entries its plain step attends over, in the same
    order, and the rings it leaves are plain decoding's. The full-ring closed form and the
    simulation agree."""
    M = 8
    if buffer == 0:
        offset = idx = 0
    elif buffer < M:  # still growing: written up to offset
        offset = idx = min(offset, buffer)
    elif buffer == M:  # full ring: any index, offset past the start
        offset, idx = max(offset, M), max(idx, keep)
        idx = min(idx, M)
    else:  # after a wide forward: temporal, index at the end
        offset = max(offset, buffer)
        idx = buffer
    seqs, rings = sliding.plain_steps(buffer, offset, idx, keep, M, width)
    layouts = [sliding._simulated_layout(buffer, offset, idx, keep, M, width)]
    if buffer == M and width <= M - keep:
        layouts.append(sliding._full_ring_layout(idx, keep, M, width))
    for lay in layouts:
        if lay is None:  # a state no single order covers: the verify falls back to mlx-lm's path
            assert not (buffer == M and width <= M - keep)
            continue
        order = np.array(lay.index).tolist()
        mask = np.array(lay.mask)
        for j in range(width):
            assert [o for o, v in zip(order, mask[j]) if v] == seqs[j]
            assert np.array(lay.rings[j][0]).tolist() == rings[j][0] and lay.rings[j][1] == rings[j][1]


WORDS = ["the", "fox", "def", "add", "(a, b)", "return", "hello", "world", "1 2 3", "café", "\n", "repeat"]
prompts = st.lists(st.sampled_from(WORDS), min_size=1, max_size=14).map(" ".join)


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(prompt=prompts, n=st.integers(1, 60), max_draft=st.sampled_from([1, 3, 7, 16]), seed=st.sampled_from([3, 4]))
def test_every_mode_is_lossless_past_the_window(prompt, n, max_draft, seed):
    tgt, tok, drafters = gemma(seed)
    ids = md.encode_prompt(tok, prompt)
    base = md.generate(tgt, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=n)
    assert base.tokens == independent_greedy(tgt, ids, n, set(md.api.stop_token_ids(tgt, tok)))
    runs = [md.generate(tgt, tok, None, prompt_ids=ids, mode="lookup", max_new_tokens=n, max_draft=max_draft)]
    for kind, d in drafters.items():
        runs.append(
            md.generate(tgt, tok, None, prompt_ids=ids, mode=kind, drafter=d, max_new_tokens=n, max_draft=max_draft)
        )
    runs.append(
        md.generate(
            tgt,
            tok,
            None,
            prompt_ids=ids,
            proposer=_ScriptedProposer(base.tokens + [0] * 80),
            max_new_tokens=n,
            max_draft=max_draft,
        )
    )
    for r in runs:
        assert r.tokens == base.tokens
        assert r.text == base.text
        assert "speculation_off" not in r.stats


@pytest.mark.parametrize("seed", [3, 4])
def test_speculation_keeps_running_past_the_window(seed):
    """Lookup on a repetitive continuation drafts and accepts long after the ring has wrapped,
    and so does a drafter; the output is the baseline's, ids and text, and plain mlx-lm's."""
    tgt, tok, drafters = gemma(seed)
    ids = md.encode_prompt(tok, "the fox def add the fox def add")
    assert len(ids) > WINDOW
    n = 80
    base = md.generate(tgt, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=n)
    assert base.tokens == independent_greedy(tgt, ids, n, set(md.api.stop_token_ids(tgt, tok)))
    stops = md.api.stop_token_ids(tgt, tok)
    scripted = loop.run(
        tgt, ids, _ScriptedProposer(base.tokens + [0] * 96), max_new_tokens=n, max_draft=6, stop_token_ids=stops
    )
    assert scripted.tokens == base.tokens
    # rounds that accepted several tokens, all past the window
    assert sum(1 for a in scripted.accept_lengths if a > 1) >= 5
    assert scripted.speculation_off is None
    assert len(set(scripted.accept_lengths)) >= 4  # partial accepts at many points
    look = md.generate(tgt, tok, None, prompt_ids=ids, mode="lookup", max_new_tokens=n)
    assert look.tokens == base.tokens and look.text == base.text
    d = md.generate(tgt, tok, None, prompt_ids=ids, mode="dspark", drafter=drafters["dspark"], max_new_tokens=n)
    assert d.tokens == base.tokens and d.text == base.text
    assert d.stats["drafter_proposed"] > 0 and "speculation_off" not in d.stats


def test_lookup_commits_blocks_past_the_window():
    tgt, tok, _ = gemma(3)
    ids = md.encode_prompt(tok, "the fox def add the fox def add the fox")
    base = md.generate(tgt, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=60)
    look = md.generate(tgt, tok, None, prompt_ids=ids, mode="lookup", max_new_tokens=60)
    assert look.tokens == base.tokens and look.text == base.text
    assert look.stats["lookup_accepted"] > 2 * WINDOW  # many tokens drafted and kept past the window
    assert look.rounds < base.rounds


def test_gemma4_past_the_window():
    """gemma4_text (its sliding layers share the mask; a DSpark gemma4-variant drafter) with the
    window cut to 8: every mode token- and text-identical to baseline and to mlx-lm."""
    import json

    from drafter_fixtures import write_gemma4_target

    path = write_gemma4_target(_ROOT / "gemma4-w8", seed=4)
    cfg = json.loads((path / "config.json").read_text())
    cfg["sliding_window"] = WINDOW
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    tgt, tok = md.load_target(str(path), dtype="float32")
    assert tgt.rollback_kind == "rewind"
    d = load_drafter(str(write_deepspec(_ROOT / "gemma4-w8-dspark", path, style="gemma4", softcap=1.0)), tgt, bits=16)
    ids = md.encode_prompt(tok, "the fox def add hello world the fox")
    n = 60
    base = md.generate(tgt, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=n)
    assert base.tokens == independent_greedy(tgt, ids, n, set(md.api.stop_token_ids(tgt, tok)))
    runs = [
        md.generate(tgt, tok, None, prompt_ids=ids, mode="lookup", max_new_tokens=n),
        md.generate(tgt, tok, None, prompt_ids=ids, mode="dspark", drafter=d, max_new_tokens=n),
        md.generate(
            tgt,
            tok,
            None,
            prompt_ids=ids,
            proposer=_ScriptedProposer(base.tokens + [0] * 80),
            max_new_tokens=n,
            max_draft=6,
        ),
    ]
    for r in runs:
        assert r.tokens == base.tokens and r.text == base.text
        assert "speculation_off" not in r.stats
    assert max(runs[2].accept_lengths) > 1 and len(ids) + n > 2 * WINDOW
