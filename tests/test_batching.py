"""Continuous batching: every request batched with others gives exactly the token ids and the text
it gives alone (greedy, CPU float32, real tiny checkpoints loaded as a user loads them), in every
mode, with rows joining and leaving mid-flight; the self-check can fail. The server side is in
test_batching_serve.py."""

from __future__ import annotations

import mlx.core as mx
import pytest
from drafter_fixtures import target, workspace

from mlx_dspark.api import generate, start
from mlx_dspark.decode import batch
from mlx_dspark.models.drafters import load_drafter

_D: dict = {}


def _pair(kind: str = "target_qwen3", drafter: str = "dspark_qwen3"):
    ws = workspace()
    t, tok = target(ws[kind])
    key = (kind, drafter)
    if key not in _D:
        _D[key] = load_drafter(str(ws[drafter]), t, bits=16)
    return t, tok, _D[key]


def _prompts(tok, n: int) -> list[list[int]]:
    texts = [
        "def add(a, b):\n    return a + b\n\ndef fibonacci(n):",
        "The quick brown fox",
        "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):",
        "Once upon a time, in a land far away, there lived",
        "import os\nimport sys\n\nfor name in os.listdir('.'):\n    print(name)\n",
        "hello",
        "x = [i * i for i in range(10)]\nprint(x)\n# the squares are",
    ]
    return [list(tok.encode(texts[i % len(texts)]))[: 12 + 9 * i] for i in range(n)]


def _batched(t, tok, d, mode, prompts, budgets, join_at, **kw):
    """Run the requests as rows of one batch: request i joins at step join_at[i]. Returns the
    results, in order, and the largest number of rows that shared a step."""
    runs, results, active, widest, step = {}, {}, [], 0, 0
    while len(results) < len(prompts):
        for i, at in enumerate(join_at):
            if at == step and i not in runs:
                runs[i] = start(
                    t, tok, None, prompt_ids=prompts[i], mode=mode, drafter=d, max_new_tokens=budgets[i], **kw
                )
                runs[i].generation.step()  # the prefill, alone
                active.append(i)
        live = [i for i in active if not runs[i].generation.done]
        if live:
            widest = max(widest, len(live))
            batch.step_rows([runs[i].generation for i in live])
        for i in list(active):
            if runs[i].generation.done:
                results[i] = runs[i].result()
                active.remove(i)
        step += 1
        assert step < 10_000
    return [results[i] for i in range(len(prompts))], widest


@pytest.mark.parametrize("mode", ["baseline", "lookup", "dspark"])
def test_batched_rows_equal_solo_runs(mode):
    t, tok, d = _pair()
    assert batch.check(t, 4, 17) is None, "the fixture target must batch on CPU float32"
    prompts = _prompts(tok, 6)
    budgets = [40, 7, 33, 21, 1, 28]
    join_at = [0, 0, 3, 5, 6, 11]  # rows join mid-flight, into slots that others left
    kw = dict(drafter=d) if mode == "dspark" else {}
    solo = [generate(t, tok, None, prompt_ids=p, mode=mode, max_new_tokens=n, **kw) for p, n in zip(prompts, budgets)]
    shared = []
    if mode == "dspark":  # count the drafter passes that several rows shared
        real = d.block_hidden_rows
        d.block_hidden_rows = lambda anchors, *a: shared.append(len(anchors)) or real(anchors, *a)
    try:
        got, widest = _batched(t, tok, d if mode == "dspark" else None, mode, prompts, budgets, join_at)
    finally:
        d.__dict__.pop("block_hidden_rows", None)
    if mode == "dspark":
        assert shared and max(shared) >= 2
    assert widest >= 3
    for s, g in zip(solo, got):
        assert g.tokens == s.tokens
        assert g.text == s.text
        assert g.finish_reason == s.finish_reason
    assert sum(len(s.tokens) for s in solo) > 60  # the runs were long enough to mean something
    if mode == "dspark":
        assert any(a > 1 for g in got for a in g.accept_lengths)  # verify rounds were batched
        # The batched drafter pass drafts what each row drafts alone here (CPU float32 computes a
        # matmul row alike at any row count), so every round accepts alike.
        assert [g.accept_lengths for g in got] == [s.accept_lengths for s in solo]


@pytest.mark.parametrize("mode", ["baseline", "lookup", "dspark"])
def test_batched_rows_of_a_target_that_reads_its_context_equal_solo_runs(mode):
    """As above, on a target whose output depends on its whole context (the shared fixture target
    mostly repeats its last token, so a row that attended to another row's keys could go unseen)."""
    from prefix_fixtures import context_pair

    t, tok, d = context_pair()
    assert batch.check(t, 4, 17) is None
    prompts = _prompts(tok, 5)
    budgets = [30, 9, 24, 17, 26]
    kw = dict(drafter=d) if mode == "dspark" else {}
    solo = [generate(t, tok, None, prompt_ids=p, mode=mode, max_new_tokens=n, **kw) for p, n in zip(prompts, budgets)]
    got, widest = _batched(t, tok, d if mode == "dspark" else None, mode, prompts, budgets, [0, 0, 2, 4, 9])
    assert widest >= 3
    for s, g in zip(solo, got):
        assert (g.tokens, g.text, g.finish_reason) == (s.tokens, s.text, s.finish_reason)
    assert len({tuple(s.tokens) for s in solo}) == len(solo)  # distinct answers: each row read its own context


def test_batched_dflash_and_stop_strings_equal_solo():
    t, tok, d = _pair(drafter="dflash_zlab")
    prompts = _prompts(tok, 4)
    budgets = [30, 25, 12, 30]
    solo = [
        generate(t, tok, None, prompt_ids=p, mode="dflash", drafter=d, max_new_tokens=n, stop=["e"])
        for p, n in zip(prompts, budgets)
    ]
    got, _ = _batched(t, tok, d, "dflash", prompts, budgets, [0, 0, 1, 2], stop=["e"])
    for s, g in zip(solo, got):
        assert (g.tokens, g.text, g.stop_string) == (s.tokens, s.text, s.stop_string)
        assert g.accept_lengths == s.accept_lengths


def test_perm_target_batched_verify_rounds_accept_whole_blocks():
    """A drafter that always agrees: batched rows accept whole blocks at different points."""
    t, tok, d = _pair("target_perm", "perm_dspark")
    prompts = [[5 + i, 40 + 3 * i, 90 + i] for i in range(4)]
    budgets = [50, 17, 36, 9]
    solo = [
        generate(t, tok, None, prompt_ids=p, mode="dspark", drafter=d, max_new_tokens=n)
        for p, n in zip(prompts, budgets)
    ]
    shared = []
    real = d.block_hidden_rows
    d.block_hidden_rows = lambda anchors, *a: shared.append(len(anchors)) or real(anchors, *a)
    try:
        got, widest = _batched(t, tok, d, "dspark", prompts, budgets, [0, 1, 1, 2])
    finally:
        d.__dict__.pop("block_hidden_rows", None)
    assert widest == 4 and max(shared) == 4  # one drafter pass for the four rows
    for s, g in zip(solo, got):
        assert (g.tokens, g.text) == (s.tokens, s.text)
        assert len(g.tokens) == len(s.tokens)
    assert max(a for g in got for a in g.accept_lengths) == d.block_drafts + 1


def test_self_check_fails_when_rows_are_not_computed_alike(monkeypatch):
    """The check compares bitwise: a batched forward that perturbs one row is caught."""
    t, _, _ = _pair()
    real = batch.forward_rows

    def perturbed(target, rows):
        outs = real(target, rows)
        if len(outs) > 1:
            outs[1].logits = outs[1].logits * (1 + 2**-20)
        return outs

    monkeypatch.setattr(batch, "forward_rows", perturbed)
    t2 = type("T", (), {})()  # a fresh check cache: copy the target's attributes
    t2.__dict__.update(t.__dict__)
    t2.__class__ = type(t)
    t2._batch_checked = {}
    assert batch.check(t2, 2, 4) is not None


def test_a_batched_forward_that_cannot_run_here_is_a_refusal_not_a_crash(monkeypatch):
    """A backend where the batched forward raises (a trace it cannot carry, a kernel it lacks):
    the load's check refuses batching with the reason; requests take the serial path."""
    t, _, _ = _pair()

    def broken(target, rows):
        raise RuntimeError("no such kernel here")

    monkeypatch.setattr(batch, "forward_rows", broken)
    t2 = type("T", (), {})()
    t2.__dict__.update(t.__dict__)
    t2.__class__ = type(t)
    t2._batch_checked = {}
    why = batch.check(t2, 2, 4)
    assert why is not None and "no such kernel here" in why and "failed" in why


def test_a_single_row_runs_the_serial_forward():
    t, _, _ = _pair()
    calls = []
    real = t.forward

    class Spy:
        def __getattr__(self, name):
            return getattr(t, name)

        def forward(self, tokens, cache, taps=(), last_only=False):
            calls.append(type(cache[0]).__name__)
            return real(tokens, cache, taps=taps, last_only=last_only)

    cache = t.make_cache()
    f = batch.Feed(mx.array([3, 4], dtype=mx.int32), 2, (), None)
    batch.forward_rows(Spy(), [(cache, f)])
    assert calls == ["KVCache"]


@pytest.mark.parametrize("mode", ["baseline", "dspark"])
def test_batched_seeded_sampling_equals_solo_runs(mode):
    """Each row keeps its own random streams: a seeded sampled request gives the same tokens and
    text batched as alone (temperature, top-p and a penalty)."""
    from mlx_dspark.decode.sampling import SamplingParams

    t, tok, d = _pair()
    prompts = _prompts(tok, 4)
    budgets = [30, 12, 25, 18]
    params = [
        dict(temperature=0.8, seed=11),
        dict(temperature=1.0, top_p=0.9, seed=12),
        dict(temperature=0.7, presence_penalty=0.5, seed=13),
        dict(temperature=0.9, seed=14),
    ]
    kw = dict(drafter=d) if mode == "dspark" else {}
    solo = [
        generate(t, tok, None, prompt_ids=p, mode=mode, max_new_tokens=n, sampling=SamplingParams(**sp), **kw)
        for p, n, sp in zip(prompts, budgets, params)
    ]
    runs, got = [], []
    for p, n, sp in zip(prompts, budgets, params):
        r = start(t, tok, None, prompt_ids=p, mode=mode, max_new_tokens=n, sampling=SamplingParams(**sp), **kw)
        r.generation.step()
        runs.append(r)
    while any(not r.generation.done for r in runs):
        batch.step_rows([r.generation for r in runs if not r.generation.done])
    got = [r.result() for r in runs]
    for s, g in zip(solo, got):
        assert (g.tokens, g.text) == (s.tokens, s.text)
