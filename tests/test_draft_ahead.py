"""Draft ahead (decode/drafting.py's before_accept): after a greedy drafter round whose draft
stayed on the device, the next block is drafted from the round's accept point before that point
is read back. Output is plain decoding's in ids and text; the blocks drafted ahead are the blocks
the round after would have drafted (the same tokens a round, ahead on or off); a block the next
round does not use is dropped and counted; a batch never drafts ahead; a pass that cannot run
falls back with the context in step. Compiled drafter passes on the CPU (MLX_DSPARK_COMPILE=on),
float32, fixture checkpoints written to disk and loaded as a user loads them."""

from __future__ import annotations

import mlx.core as mx
import pytest
from drafter_fixtures import workspace

import mlx_dspark as md
from mlx_dspark.api import start
from mlx_dspark.decode import batch
from mlx_dspark.decode.accept import GreedyAcceptor
from mlx_dspark.decode.drafting import DrafterProposer
from mlx_dspark.models import compiled_draft
from mlx_dspark.models.drafters import load_drafter

PROMPT = [5, 9, 23, 41, 7, 12]


def pair(tkey, dkey, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_INVARIANT", "kernels")
    monkeypatch.setenv("MLX_DSPARK_COMPILE", "on")
    monkeypatch.setattr(compiled_draft, "EAGER_PASSES", 0)
    ws = workspace()
    target, tok = md.load_target(str(ws[tkey]), dtype="float32")
    return target, tok, load_drafter(str(ws[dkey]), target, bits=16)


def dspark(target, tok, d, monkeypatch, ahead: bool, n=60, prompt=PROMPT, lookup=False):
    monkeypatch.setattr(DrafterProposer, "draft_ahead", ahead)
    return md.generate(
        target, tok, None, prompt_ids=prompt, mode="dspark", drafter=d, max_new_tokens=n, lookup_drafts=lookup
    )


@pytest.mark.parametrize(
    "tkey,dkey", [("target_perm", "perm_dspark"), ("target_perm", "perm_dspark_noisy"), ("target_qwen3", "dflash_zlab")]
)
def test_drafting_ahead_equals_plain_decoding_and_drafts_the_same_blocks(tkey, dkey, monkeypatch):
    target, tok, d = pair(tkey, dkey, monkeypatch)
    base = md.generate(target, tok, None, prompt_ids=PROMPT, mode="baseline", max_new_tokens=60)
    off = dspark(target, tok, d, monkeypatch, ahead=False)
    on = dspark(target, tok, d, monkeypatch, ahead=True)
    assert on.tokens == off.tokens == base.tokens and on.text == off.text == base.text
    # the noisy drafter accepts 2..8 a round: the same counts a round say the blocks were the same
    assert on.accept_lengths == off.accept_lengths and len(on.accept_lengths) > 3
    assert off.stats["ahead_rounds"] == 0
    # every drafter round after the first comes from the block drafted ahead
    assert on.stats["ahead_rounds"] == on.stats["drafter_rounds"] - 1 and on.stats["ahead_unused"] == 0


def test_the_next_block_is_enqueued_before_the_accept_point_is_read(monkeypatch):
    """At each read-back of a round's accept point after the first round, the next block is
    already enqueued; the draft a round verifies is that block, unread (one sync a round)."""
    target, tok, d = pair("target_perm", "perm_dspark_noisy", monkeypatch)
    tg = start(target, tok, None, prompt_ids=PROMPT, mode="dspark", drafter=d, max_new_tokens=60, lookup_drafts=False)
    p = tg.generation.proposer
    seen = []
    real = GreedyAcceptor.verify

    def verify(self, logits, draft, history, lazy=None):
        seen.append((lazy is not None, p._ahead is not None and p._ahead[0] is not None, draft.device is not None))
        return real(self, logits, draft, history, lazy)

    monkeypatch.setattr(GreedyAcceptor, "verify", verify)
    tg.generation.step()  # the prefill (begin() sets the proposer's policy up)
    told = []
    p.policy.drafted_ahead = lambda: told.append(1)  # the policy hears of each block drafted ahead
    res = tg.run()
    assert len(seen) == len(res.accept_lengths) > 3
    assert len(told) == sum(1 for s in seen if s[1]) == res.stats["ahead_rounds"] + res.stats["ahead_unused"]
    # all but the rounds too close to the end (no round after them) draft ahead
    assert all(s == (True, True, True) for s in seen[:-2])


def test_a_block_the_next_round_does_not_use_is_dropped(monkeypatch):
    """With lookup drafts on, a repetitive prompt sends some rounds to lookup: the block drafted
    ahead of such a round is dropped (counted) and the drafter's context stays in step."""
    target, tok, d = pair("target_perm", "perm_dspark_noisy", monkeypatch)
    prompt = PROMPT * 6
    base = md.generate(target, tok, None, prompt_ids=prompt, mode="baseline", max_new_tokens=80)
    on = dspark(target, tok, d, monkeypatch, ahead=True, n=80, prompt=prompt, lookup=True)
    off = dspark(target, tok, d, monkeypatch, ahead=False, n=80, prompt=prompt, lookup=True)
    assert on.tokens == base.tokens and on.text == base.text
    assert on.accept_lengths == off.accept_lengths
    if on.stats["lookup_rounds"] and on.stats["drafter_rounds"] > 1:
        assert on.stats["ahead_rounds"] + on.stats["ahead_unused"] >= 1
    assert on.stats["ahead_rounds"] <= on.stats["drafter_rounds"] - 1


def test_a_dropped_block_after_a_plain_step(monkeypatch):
    """A block drafted ahead, then a round the policy declines (a synchronous plain step): the
    block is dropped (counted), the plain step's row goes into the context after the round's
    accepted rows, and the output is plain decoding's."""
    target, tok, d = pair("target_perm", "perm_dspark_noisy", monkeypatch)
    base = md.generate(target, tok, None, prompt_ids=PROMPT, mode="baseline", max_new_tokens=60)
    tg = start(target, tok, None, prompt_ids=PROMPT, mode="dspark", drafter=d, max_new_tokens=60, lookup_drafts=False)
    tg.generation.step()  # the prefill (begin() sets the proposer's policy up)
    policy = tg.generation.proposer.policy
    real_length = policy.length
    calls = {"n": 0}

    def length(source, offered, n, *a):  # every third drafter round: declined
        calls["n"] += 1
        return 0 if calls["n"] % 3 == 0 else real_length(source, offered, n, *a)

    monkeypatch.setattr(policy, "length", length)
    res = tg.run()
    assert res.tokens == base.tokens and res.text == base.text
    assert res.stats["ahead_rounds"] > 0 and res.stats["ahead_unused"] > 0


def test_no_block_is_drafted_ahead_where_the_policy_expects_no_round(monkeypatch):
    """A round during which the policy says the next step will not be a round of the drafter
    (`continues`) drafts nothing ahead: no block would be left to hold the device in front of the
    plain step. The rounds it does expect still draft ahead, and the output is plain decoding's."""
    target, tok, d = pair("target_perm", "perm_dspark_noisy", monkeypatch)
    base = md.generate(target, tok, None, prompt_ids=PROMPT, mode="baseline", max_new_tokens=60)
    tg = start(target, tok, None, prompt_ids=PROMPT, mode="dspark", drafter=d, max_new_tokens=60, lookup_drafts=False)
    tg.generation.step()  # the prefill (begin() sets the proposer's policy up)
    policy = tg.generation.proposer.policy
    asked = []

    def continues(source, offered):  # every other round: "no round after this one"
        asked.append(source)
        return len(asked) % 2 == 0

    monkeypatch.setattr(policy, "continues", continues, raising=False)
    res = tg.run()
    assert res.tokens == base.tokens and res.text == base.text
    assert len(asked) >= 4 and set(asked) == {"drafter"}
    drafted = res.stats["ahead_rounds"] + res.stats["ahead_unused"]
    assert 0 < drafted <= (len(asked) + 1) // 2


def test_a_batch_does_not_draft_ahead(monkeypatch):
    """Rows stepped together (decode/batch.py) draft their next blocks together, after the accept
    points: none drafts ahead while another row shares its step; a row left alone steps as a
    solo generation does (and may). Each row equals its solo run."""
    target, tok, d = pair("target_perm", "perm_dspark_noisy", monkeypatch)
    prompts = [PROMPT, PROMPT[::-1] + [3]]
    solo = [dspark(target, tok, d, monkeypatch, ahead=True, prompt=pr, n=40) for pr in prompts]
    runs = [
        start(target, tok, None, prompt_ids=pr, mode="dspark", drafter=d, max_new_tokens=40, lookup_drafts=False)
        for pr in prompts
    ]
    for r in runs:
        r.generation.step()  # prefill
    live, seen = [0], []
    real = DrafterProposer.before_accept
    monkeypatch.setattr(DrafterProposer, "before_accept", lambda self, *a: (seen.append(live[0]), real(self, *a))[1])
    while any(not r.generation.done for r in runs):
        gens = [r.generation for r in runs if not r.generation.done]
        live[0] = len(gens)
        batch.step_rows(gens)
    for r, s in zip(runs, solo):
        assert r.generation.res.tokens == s.tokens
    assert set(seen) <= {1}


def test_a_pass_that_cannot_run_ahead_falls_back(monkeypatch):
    """The compiled pass fails when drafting ahead: a warning, the context goes back to the
    round's start, and the generation equals plain decoding, drafting op by op from then on."""
    target, tok, d = pair("target_perm", "perm_dspark_noisy", monkeypatch)
    base = md.generate(target, tok, None, prompt_ids=PROMPT, mode="baseline", max_new_tokens=60)
    real_run = compiled_draft.CompiledDraft._run

    def run(self, anchors, offsets, states, with_conf):
        if not isinstance(anchors, mx.array) or getattr(self, "_in_rows", False):
            return real_run(self, anchors, offsets, states, with_conf)
        raise RuntimeError("no such kernel here")

    real_rows = compiled_draft.CompiledDraft.rows

    def rows(self, *a):
        self._in_rows = True
        try:
            return real_rows(self, *a)
        finally:
            self._in_rows = False

    monkeypatch.setattr(compiled_draft.CompiledDraft, "_run", run)
    monkeypatch.setattr(compiled_draft.CompiledDraft, "rows", rows)
    with pytest.warns(UserWarning, match="compiled drafter pass failed here"):
        res = dspark(target, tok, d, monkeypatch, ahead=True)
    assert res.tokens == base.tokens and res.text == base.text
    assert res.stats["ahead_rounds"] == 0 and compiled_draft.for_drafter(d) is None
