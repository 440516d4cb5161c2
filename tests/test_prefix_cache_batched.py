"""Warm equals cold on the batching server: several conversations run as the rows of one batch
(serve --max-batch), sharing one prefix cache with one RAM slot (or a tiny RAM budget) and a
spill directory, with restarts (a new engine and a new cache over the same directory) in between.
Every turn's token ids and text equal a cold run of the same prompt alone; entries written by
rows come back from RAM and from disk. The prefill's chunk grid is lowered to GRID so that these
short prompts have whole chunks to reuse (an entry keeps only a prompt's whole chunks of the grid)."""

from __future__ import annotations

import time

import pytest
from fixtures import scratch_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prefix_fixtures import context_pair

from mlx_dspark.api import encode_prompt, generate
from mlx_dspark.decode import loop
from mlx_dspark.serve.engine import Engine, GenRequest
from mlx_dspark.serve.prefix_cache import PrefixCache

GRID = 4


@pytest.fixture(autouse=True)
def small_grid(monkeypatch):
    monkeypatch.setattr(loop, "PREFILL_CHUNK", GRID)


def _whole_chunks(prompt, grid: int) -> int:
    """The positions of a prompt an entry keeps, the last token excluded: all of them where the
    prefill is split-invariant (PrefixCache.grid 1: this CPU in float32), else its whole chunks of
    the grid."""
    return (len(prompt) - 1) // grid * grid


def _pair():
    return context_pair()


def test_the_target_reads_its_context():
    """The premise of the tests below: changing an early prompt token changes the output."""
    t, tok, _ = _pair()
    a = encode_prompt(tok, "the fox and the weather")
    b = a[:3] + [200, 201, 202] + a[6:]
    assert _cold(t, tok, None, a + [50, 60], "baseline", 12) != _cold(t, tok, None, b + [50, 60], "baseline", 12)


def _cold(t, tok, d, ids, mode, n):
    res = generate(t, tok, None, prompt_ids=ids, mode=mode, drafter=d if mode == "dspark" else None, max_new_tokens=n)
    # What the server sends for it: a cut multi-byte character at max_tokens is no text.
    text = res.text.rstrip("\ufffd") if res.finish_reason == "length" else res.text
    return res.tokens, text


def _engine(t, tok, d, mode, pc):
    return Engine(t, tok, mode=mode, drafter=d if mode == "dspark" else None, max_batch=3, prefix_cache=pc).start()


def _finish(job, timeout=120.0):
    """(result, streamed text) of a Job that must end well."""
    deadline, text = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        ev = job.next_event(0.5)
        if ev is None:
            continue
        if ev[0] == "text":
            text += ev[1]
            continue
        assert ev[0] == "done", ev
        return ev[1].result, text
    raise AssertionError("the job did not finish")


def _round(eng, prompts):
    """Submit every (ids, n) at once (rows of one batch); their (result, streamed text)."""
    jobs = [eng.submit(GenRequest(prompt_ids=ids, max_tokens=n)) for ids, n in prompts]
    return [_finish(j) for j in jobs]


round_ = st.tuples(
    st.lists(
        st.tuples(st.integers(0, 2), st.lists(st.integers(3, 300), min_size=1, max_size=16), st.integers(1, 10)),
        min_size=1,
        max_size=3,
        unique_by=lambda x: x[0],  # a conversation takes one turn per round
    ),
    st.booleans(),  # restart first: a new process (RAM gone, disk kept)
)


def _on_disk(pc, prompt) -> bool:
    """Whether `pc` has an entry on disk for the conversation's newest turn (asked `prompt`)."""
    return any(len(tk) >= _whole_chunks(prompt, pc.grid) and list(tk) == prompt[: len(tk)] for tk in pc.disk.values())


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(
    rounds=st.lists(round_, min_size=2, max_size=4),
    mode=st.sampled_from(["baseline", "lookup", "dspark"]),
    slots=st.integers(1, 2),
    tiny_ram=st.booleans(),
)
def test_batched_warm_turns_equal_cold_runs(rounds, mode, slots, tiny_ram):
    t, tok, d = _pair()
    spill = str(scratch_dir("prefix-batched-"))

    def fresh():
        return PrefixCache(t, slots=slots, max_ram_mb=0.01 if tiny_ram else None, spill_dir=spill)

    pc = fresh()
    eng = _engine(t, tok, d, mode, pc)
    start = encode_prompt(tok, "the fox and the weather")
    convs = [list(start) for _ in range(3)]
    asked = [list(start) for _ in range(3)]  # each conversation's last prompt
    alive: set[int] = set()  # conversations whose newest turn the cache holds (RAM or disk)
    try:
        for turns, restart in rounds:
            if restart:
                eng.stop()
                alive = {w for w in alive if _on_disk(pc, asked[w])}  # RAM is gone, disk is kept
                pc = fresh()
                eng = _engine(t, tok, d, mode, pc)
            prompts = [(convs[which] + user, n) for which, user, n in turns]
            got = _round(eng, prompts)
            for (which, _, n), (ids, _), (res, streamed) in zip(turns, prompts, got):
                tokens, text = _cold(t, tok, d, ids, mode, n)
                assert res.tokens == tokens, (mode, which, len(ids), res.cached_tokens)
                assert res.text == text == streamed, (mode, which, res.text, text, streamed)
                assert res.cached_tokens < len(ids)
                if which in alive:  # evicted entries went to disk and come back from there
                    assert res.cached_tokens >= _whole_chunks(asked[which], pc.grid), (
                        res.cached_tokens,
                        len(asked[which]),
                    )
                assert res.cached_tokens % pc.grid == 0
                convs[which] = ids + res.tokens
                asked[which] = ids
            alive |= {which for which, _, _ in turns}
    finally:
        eng.stop()


def test_rows_reuse_spilled_entries_after_a_restart():
    """Three conversations as the rows of one batch, one RAM slot: two entries spill to disk. After
    a restart (the RAM entry is gone) their follow-ups, again as rows, read both back from disk and
    equal cold runs; the third reuses only what it shares with them (the chat template's opening)
    and equals a cold run too."""
    t, tok, d = _pair()
    spill = str(scratch_dir("prefix-batched-"))
    convs = [encode_prompt(tok, p) for p in ("the fox and the weather", "print x = x + 1", "hello world repeat")]
    pc = PrefixCache(t, slots=1, spill_dir=spill)
    eng = _engine(t, tok, d, "dspark", pc)
    try:
        first = _round(eng, [(c, 8) for c in convs])
    finally:
        eng.stop()
    assert pc.stats["spilled"] == 2 and len(pc.disk) == 2
    done = [c + r.tokens for c, (r, _) in zip(convs, first)]
    on_disk = [_on_disk(pc, c) for c in convs]
    assert sum(on_disk) == 2
    follow = [c + [40 + i, 41] for i, c in enumerate(done)]
    pc2 = PrefixCache(t, slots=1, spill_dir=spill)
    assert len(pc2.disk) == 2
    eng = _engine(t, tok, d, "dspark", pc2)
    try:
        second = _round(eng, [(f, 8) for f in follow])
    finally:
        eng.stop()
    assert pc2.stats["loaded"] == 2
    for c, disk, ids, (res, streamed) in zip(convs, on_disk, follow, second):
        if disk:
            assert res.cached_tokens >= _whole_chunks(c, pc2.grid) > 0
        else:
            assert res.cached_tokens < min(len(x) for x in convs)
        tokens, text = _cold(t, tok, d, ids, "dspark", 8)
        assert res.tokens == tokens and res.text == text == streamed
