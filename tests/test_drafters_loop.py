"""DSpark / DFlash through the one verify loop: losslessness, acceptance, commits and crops."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from drafter_fixtures import perm_chain, target, workspace
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_dspark.api import generate
from mlx_dspark.decode.modes import drafter_proposer
from mlx_dspark.models.checkpoints import DrafterSpec
from mlx_dspark.models.drafters import load_drafter
from mlx_dspark.pairs import dflash_generate

_DRAFTERS: dict = {}
_BASELINE: dict = {}

# fixture -> (its target, drafter bits)
PAIRS = {
    "dspark_qwen3": ("target_qwen3", 4),
    "dspark_gemma4": ("target_gemma4", 16),
    "dflash_deepspec": ("target_qwen3", 8),
    "dflash_zlab": ("target_qwen3", 4),
    "dflash_zlab_gemma4": ("target_gemma4", 16),
    "perm_dspark_noisy": ("target_perm", 16),
    "perm_dflash_zlab": ("target_perm", 16),
}


def drafter(key, bits=None):
    ws = workspace()
    tkey, default_bits = PAIRS.get(key, ("target_perm", 16))
    b = default_bits if bits is None else bits
    if (key, b) not in _DRAFTERS:
        _DRAFTERS[(key, b)] = load_drafter(str(ws[key]), target(ws[tkey])[0], bits=b)
    return _DRAFTERS[(key, b)]


def baseline(tkey, prompt, n):
    k = (tkey, tuple(prompt), n)
    if k not in _BASELINE:
        tgt, tok = target(workspace()[tkey])
        _BASELINE[k] = generate(tgt, tok, None, prompt_ids=list(prompt), mode="baseline", max_new_tokens=n).tokens
    return _BASELINE[k]


def _perm_prompt(n=6, seed=0):
    f = workspace()["perm"]
    normal = np.flatnonzero(f >= 0)
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.choice(normal, size=n, replace=False)]


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    key=st.sampled_from(list(PAIRS)),
    data=st.data(),
    n=st.integers(1, 40),
    max_draft=st.sampled_from([None, 0, 1, 2, 3, 7, 20]),
    lookup=st.booleans(),
    threshold=st.sampled_from([0.0, 0.0, 0.55]),
)
def test_lossless_every_drafter(key, data, n, max_draft, lookup, threshold):
    tkey = PAIRS[key][0]
    tgt, tok = target(workspace()[tkey])
    d = drafter(key)
    if key.startswith("perm"):
        prompt = _perm_prompt(data.draw(st.integers(1, 8)), seed=data.draw(st.integers(0, 99)))
    else:  # a random token prompt, with a repeat in it now and then (lookup drafts)
        body = data.draw(st.lists(st.integers(0, tgt.vocab_size - 10), min_size=1, max_size=24))
        prompt = body + body[: data.draw(st.integers(0, len(body)))]
    if d.conf_head is None:
        threshold = 0.0
    res = generate(
        tgt,
        tok,
        None,
        prompt_ids=prompt,
        mode=d.kind,
        drafter=d,
        max_new_tokens=n,
        max_draft=max_draft,
        lookup_drafts=lookup,
        confidence_threshold=threshold,
    )
    assert res.tokens == baseline(tkey, prompt, n)


@pytest.mark.parametrize("lookup", [False, True])
def test_agreeing_dspark_accepts_whole_blocks(lookup):
    """The crafted pair: the target's next token is f(token) and the drafter's Markov head
    encodes f, so every round accepts all 7 drafts + the bonus, for hundreds of tokens."""
    ws = workspace()
    tgt, tok = target(ws["target_perm"])
    d = drafter("perm_dspark")
    prompt = _perm_prompt()
    n = 300
    res = generate(tgt, tok, None, prompt_ids=prompt, mode="dspark", drafter=d, max_new_tokens=n, lookup_drafts=lookup)
    assert res.tokens == perm_chain(prompt[-1], n) == baseline("target_perm", prompt, n)
    assert res.accept_lengths[:-1] == [8] * (len(res.accept_lengths) - 1)
    assert len(res.accept_lengths) == -(-(n - 1) // 8)  # the first token comes from prefill
    s = res.stats
    assert s["drafter_accepted"] + s["lookup_accepted"] == n - 1 - len(res.accept_lengths)
    # shorter caps: whole (capped) blocks still
    res = generate(
        tgt, tok, None, prompt_ids=prompt, mode="dspark", drafter=d, max_new_tokens=60, max_draft=3, lookup_drafts=False
    )
    assert res.tokens == perm_chain(prompt[-1], 60) and set(res.accept_lengths[:-1]) == {4}


def test_agreeing_dspark_4bit():
    ws = workspace()
    tgt, tok = target(ws["target_perm"])
    prompt = _perm_prompt(seed=3)
    res = generate(
        tgt,
        tok,
        None,
        prompt_ids=prompt,
        mode="dspark",
        drafter=drafter("perm_dspark", 4),
        max_new_tokens=80,
        lookup_drafts=False,
    )
    assert res.tokens == perm_chain(prompt[-1], 80) and set(res.accept_lengths[:-1]) == {8}


@pytest.mark.parametrize("key", ["perm_dflash_zlab", "perm_dflash_deepspec"])
def test_agreeing_dflash_first_draft_every_round(key, monkeypatch):
    """Crafted DFlash drafters whose first draft is always right (and the rest wrong): each
    round commits exactly 2 tokens. Under the other packaging's slot convention the first
    draft is wrong and nothing is accepted; the output stays exact either way."""
    ws = workspace()
    tgt, tok = target(ws["target_perm"])
    d = drafter(key)
    assert d.block_drafts == (15 if key.endswith("zlab") else 7)
    prompt = _perm_prompt(seed=5)
    res = generate(tgt, tok, None, prompt_ids=prompt, mode="dflash", drafter=d, max_new_tokens=61, lookup_drafts=False)
    assert res.tokens == perm_chain(prompt[-1], 61)
    assert res.accept_lengths == [2] * 30
    wrong = 0 if key.endswith("zlab") else 1
    monkeypatch.setattr(DrafterSpec, "logits_start", property(lambda self: wrong))
    res = generate(
        tgt, tok, None, prompt_ids=prompt, mode="dflash", drafter=d, max_new_tokens=30, max_draft=6, lookup_drafts=False
    )
    assert res.tokens == perm_chain(prompt[-1], 30)
    assert set(res.accept_lengths) == {1}


def _context_matches_fresh(p, tgt, sequence):
    """The proposer's drafter context equals the context built from scratch from one target
    forward over the committed sequence (every position before the last anchor)."""
    if p.pending:
        p._ingest_pending(keep=0)
    n = p.state[0].offset
    assert n == len(sequence) - 1
    cache = tgt.make_cache()
    rows = tgt.forward(mx.array([sequence[:-1]]), cache, taps=p.taps).hidden[0]
    fresh = p.drafter.new_state()
    p.drafter.ingest(rows, fresh)
    for mine, ref in zip(p.state, fresh):
        for a, b in ((mine.keys, ref.keys), (mine.values, ref.values)):
            a, b = np.array(a[..., :n, :].astype(mx.float32)), np.array(b[..., :n, :].astype(mx.float32))
            assert np.abs(a - b).max() < 1e-3 * (1 + np.abs(b).max())


@pytest.mark.parametrize(
    "key,lookup",
    [("perm_dspark_noisy", False), ("perm_dspark_noisy", True), ("dspark_qwen3", True), ("dflash_zlab", False)],
)
def test_context_cache_after_many_rounds(key, lookup):
    ws = workspace()
    tkey = PAIRS[key][0]
    tgt, tok = target(ws[tkey])
    d = drafter(key, 16)
    prompt = _perm_prompt(seed=9) if key.startswith("perm") else [5, 9, 13, 5, 9, 13, 21, 40, 5, 9]
    p = drafter_proposer(d, lookup_drafts=lookup)
    n = 120
    res = generate(tgt, tok, None, prompt_ids=prompt, proposer=p, max_new_tokens=n)
    assert res.tokens == baseline(tkey, prompt, n)
    if key == "perm_dspark_noisy":
        assert len(set(res.accept_lengths)) >= 3  # varied partial accepts: crops at many points
    if res.finish_reason == "length":
        _context_matches_fresh(p, tgt, prompt + res.tokens)


def test_confidence_threshold_truncates_to_plain_steps():
    ws = workspace()
    tgt, tok = target(ws["target_perm"])
    d = drafter("perm_dspark")  # confidence logit 6 everywhere: sigmoid = 0.9975
    prompt = _perm_prompt(seed=11)
    res = generate(
        tgt,
        tok,
        None,
        prompt_ids=prompt,
        mode="dspark",
        drafter=d,
        max_new_tokens=20,
        confidence_threshold=0.999,
        lookup_drafts=False,
    )
    assert res.tokens == perm_chain(prompt[-1], 20)
    assert set(res.accept_lengths) == {1} and res.stats["truncated_rounds"] == len(res.accept_lengths) - 1
    res = generate(
        tgt,
        tok,
        None,
        prompt_ids=prompt,
        mode="dspark",
        drafter=d,
        max_new_tokens=20,
        confidence_threshold=0.99,
        lookup_drafts=False,
    )
    assert res.stats["truncated_rounds"] == 0 and set(res.accept_lengths[:-1]) == {8}


def test_dflash_generate_full_block_by_default(monkeypatch):
    from mlx_dspark.decode.drafting import DrafterProposer

    calls = []
    orig = DrafterProposer.propose

    def spy(self, history, max_draft, sampling):
        draft = orig(self, history, max_draft, sampling)
        calls.append((max_draft, len(draft.tokens)))
        return draft

    monkeypatch.setattr(DrafterProposer, "propose", spy)
    ws = workspace()
    tgt, tok = target(ws["target_qwen3"])
    d = drafter("dflash_zlab")
    res = dflash_generate(tgt, tok, d, prompt_ids=[3, 4, 5, 6, 7], max_new_tokens=40)
    assert res.tokens == baseline("target_qwen3", [3, 4, 5, 6, 7], 40)
    assert res.stats["lookup_rounds"] == 0 and calls
    assert calls[0] == (15, 15)  # max_draft_tokens=None: the full block of B-1 = 15 drafts
    assert all(n == min(m, 15) for m, n in calls)


@pytest.mark.parametrize("key", ["perm_dspark_noisy", "dflash_zlab"])
def test_sampled_generation_is_reproducible(key):
    """T > 0 and penalties run through the DraftSampler; a seed makes the run reproducible.
    (Distribution-level exactness is the sampling tests' job; this checks the wiring.)"""
    from mlx_dspark.decode.sampling import SamplingParams

    tkey = PAIRS[key][0]
    tgt, tok = target(workspace()[tkey])
    d = drafter(key)
    prompt = _perm_prompt(seed=2) if key.startswith("perm") else [3, 4, 5, 6]
    runs = []
    for params in (
        SamplingParams(temperature=0.7, seed=5),
        SamplingParams(temperature=0.7, seed=5),
        SamplingParams(temperature=0.9, top_k=20, presence_penalty=0.5, seed=6),
    ):
        res = generate(
            tgt,
            tok,
            None,
            prompt_ids=prompt,
            mode=d.kind,
            drafter=d,
            max_new_tokens=30,
            sampling=params,
            lookup_drafts=False,
        )
        assert len(res.tokens) == 30 or res.finish_reason == "stop"
        runs.append(res.tokens)
    assert runs[0] == runs[1]
    # greedy with penalties: the verify is exact prefix matching on penalized argmax
    p = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    res = generate(tgt, tok, None, prompt_ids=prompt, mode=d.kind, drafter=d, max_new_tokens=30, sampling=p)
    base = generate(
        tgt,
        tok,
        None,
        prompt_ids=prompt,
        mode="baseline",
        max_new_tokens=30,
        sampling=SamplingParams(temperature=0.0, frequency_penalty=1.0),
    )
    assert res.tokens == base.tokens


def test_hybrid_lookup_rounds_keep_the_context_in_step():
    """A repeating suffix earns a free n-gram draft (an overlapping copy continues a periodic
    suffix); the drafter does not run, its context rows wait, and the next drafter pass takes
    them all. Two fruitless lookup rounds in a row park lookup drafts."""
    ws = workspace()
    tgt, _ = target(ws["target_qwen3"])
    d = drafter("dspark_qwen3", 16)
    C = d.spec.backbone.context_dim
    p = drafter_proposer(d, lookup_drafts=True)
    history = [11, 12, 13, 11, 12, 13, 11, 12, 13, 11]
    p.begin(tgt, history[:-1], mx.zeros((len(history) - 1, C)))
    draft = p.propose(history, 7, None)
    assert draft.tokens == [12, 13, 11, 12, 13, 11, 12] and p.counters["drafter_rounds"] == 0
    assert p.state[0].offset == 0 and p.n_pending == 9
    for miss in range(2):  # rejected at the first token twice: the target said 40, then 41
        p.observe(7, 0, mx.zeros((1, C)))
        history = history + [40 + miss]
        if miss == 0:  # 11 40 does not repeat: the drafter runs, taking all 10 pending rows
            assert len(p.propose(history, 7, None).tokens) == 7 and p.counters["drafter_rounds"] == 1
            assert p.state[0].offset == 10 and p.n_pending == 0
            p.last_lookup = True  # count this round as a lookup miss too, for the parking check
    assert not p.policy.ready("lookup", len(history))  # parked (decode/policy.py's fixed rules)
    history = history + [12, 13, 11]  # repeats again, but lookup is parked
    p.observe(0, 0, mx.zeros((3, C)))
    assert len(p.propose(history, 7, None).tokens) == 7 and p.counters["drafter_rounds"] == 2
