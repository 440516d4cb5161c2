"""Sampling: processing order, the accept rule, T = 0 with penalties, seeds, logprobs, options.

The statistical exactness tests are in test_sampling_exact.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from sampling_fixtures import VOCAB, float_cdf_accept, np_process, write_model16

import mlx_dspark as md
from mlx_dspark import kernels
from mlx_dspark.decode import loop, sampled
from mlx_dspark.decode.accept import GreedyAcceptor, make_acceptor
from mlx_dspark.decode.lookup import LookupProposer
from mlx_dspark.decode.proposers import Draft, Proposer
from mlx_dspark.decode.sampled import (
    DraftSampler,
    SampledAcceptor,
    process_logits,
    sample_from,
)
from mlx_dspark.decode.sampling import SamplingParams
from mlx_dspark.errors import UserError

SP = SamplingParams


@pytest.fixture(scope="module")
def t16(tmp_path_factory):
    return md.load_target(str(write_model16(tmp_path_factory.mktemp("v16"), "qwen3", seed=3)))[0]


@pytest.fixture(scope="module")
def big(model_dir):
    """A fixture with a real BPE vocabulary (~400 tokens) and its tokenizer."""
    return md.load_target(str(model_dir("qwen3", scale=2.0, seed=21)))


class RandomQProposer(Proposer):
    """Drafts k tokens from a seeded random q (not the target's) and reports q."""

    name = "random-q"

    def __init__(self, vocab: int, seed: int = 0, k: int = 3):
        self.vocab, self.k = vocab, k
        self.rng = np.random.default_rng(seed)
        self.last_q = None

    def wants_round(self, history):
        return True

    def propose(self, history, max_draft, sampling):
        k = min(self.k, max_draft)
        q = self.rng.dirichlet(np.full(self.vocab, 0.2), size=k).astype(np.float32)
        toks = [int(self.rng.choice(self.vocab, p=row / row.sum())) for row in q]
        self.last_q = q
        return Draft(tokens=toks, q=mx.array(q))


# ------------------------------------------------------------------------------ processing
CASES = [
    SP(temperature=1.0),
    SP(temperature=0.7, top_k=5),
    SP(temperature=1.3, top_p=0.6),
    SP(temperature=0.5, min_p=0.2),
    SP(temperature=0.9, top_k=12, top_p=0.8, min_p=0.05),
    SP(temperature=1.0, top_p=0.9, presence_penalty=1.2, frequency_penalty=-0.5),
    SP(temperature=0.8, top_k=3, frequency_penalty=2.0),
    SP(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5),
    SP(temperature=0.0),
]


@pytest.mark.parametrize("host", [False, True], ids=["mlx", "host"])
@pytest.mark.parametrize("sp", CASES, ids=[str(i) for i in range(len(CASES))])
def test_process_logits_matches_the_independent_numpy_statement(sp, host):
    rng = np.random.default_rng(0)
    V, n = 40, 6
    for trial in range(20):
        logits = rng.normal(size=(n, V)).astype(np.float32) * rng.uniform(0.5, 4)
        prompt = list(rng.integers(0, V, size=5))
        generated = list(rng.integers(0, V, size=int(rng.integers(0, 8))))
        drafts = list(rng.integers(0, V, size=n - 1))
        got = np.array(
            process_logits(mx.array(logits), sp, prompt + generated, n_prompt=len(prompt), drafts=drafts, host=host)
        )
        for i in range(n):
            want = np_process(logits[i], sp, generated + drafts[:i])
            np.testing.assert_allclose(got[i], want, atol=2e-6, err_msg=f"trial {trial} row {i}")
            assert ((got[i] > 0) == (want > 0)).all()


def test_truncation_order_is_penalties_temperature_topk_topp_minp():
    # Temperature before top-p: at T = 2 the nucleus of the same logits is wider.
    logits = mx.array([[4.0, 3.0, 2.0, 1.0, 0.0]])
    cold = process_logits(logits, SP(temperature=0.5, top_p=0.9))
    hot = process_logits(logits, SP(temperature=2.0, top_p=0.9))
    assert int((cold > 0).sum()) < int((hot > 0).sum())
    # Penalties before everything: a penalized favourite can drop out of the top-k.
    pen = process_logits(
        logits, SP(temperature=1.0, top_k=2, presence_penalty=2.0, frequency_penalty=0.5), [9, 0], n_prompt=1
    )
    assert np.array(pen)[0].nonzero()[0].tolist() == [1, 2]
    # The prompt is not penalized.
    same = process_logits(logits, SP(temperature=1.0, presence_penalty=2.0), [0, 0, 0], n_prompt=3)
    np.testing.assert_allclose(np.array(same), np.array(process_logits(logits, SP(temperature=1.0))), atol=1e-7)
    # Ties at the top-k boundary are all kept.
    tie = process_logits(mx.array([[1.0, 2.0, 2.0, 0.0]]), SP(temperature=1.0, top_k=2))
    assert np.array(tie)[0].nonzero()[0].tolist() == [1, 2]
    tie = process_logits(mx.array([[3.0, 1.0, 2.0, 2.0, 0.0]]), SP(temperature=1.0, top_k=2))
    assert np.array(tie)[0].nonzero()[0].tolist() == [0, 2, 3]


def test_host_draw_equals_sample_from():
    rng = np.random.default_rng(7)
    P = rng.dirichlet(np.full(50, 0.3), size=200).astype(np.float32)
    P[rng.random(P.shape) < 0.4] = 0
    P[:, 3] += 1e-3
    u = rng.random(200, dtype=np.float32)
    u[:3] = [0.0, np.float32(1) - np.float32(2**-24), 0.5]
    assert sampled.draw_np(P, u).tolist() == sample_from(mx.array(P), mx.array(u)).tolist()


def test_sample_from_inverse_cdf_edges():
    p = mx.array([0.0, 0.25, 0.0, 0.75, 0.0])
    assert int(sample_from(p, 0.0)) == 1
    assert int(sample_from(p, 0.2499)) == 1
    assert int(sample_from(p, 0.2501)) == 3
    assert int(sample_from(p, np.float32(1) - np.float32(2**-24))) == 3  # never a trailing zero
    assert int(sample_from(p * 7.0, 0.5)) == 3  # unnormalized is fine
    rows = sample_from(mx.stack([p, mx.array([1.0, 0, 0, 0, 0])]), mx.array([0.9, 0.9]))
    assert rows.tolist() == [3, 0]
    # Frequencies match on a random distribution.
    rng = np.random.default_rng(1)
    q = rng.dirichlet(np.ones(12)).astype(np.float32)
    draws = np.array(sample_from(mx.broadcast_to(mx.array(q), (200000, 12)), rng.random(200000, dtype=np.float32)))
    np.testing.assert_allclose(np.bincount(draws, minlength=12) / 200000, q, atol=4e-3)


# ------------------------------------------------------------------------------ accept rule
def np_accept(p, q, d, u, ub):
    """One row of the rule in plain numpy: the specification the kernels are checked against."""
    k = len(d)
    a = 0
    while a < k:
        qd = 1.0 if q is None else q[a][d[a]]
        if u[a] * qd < p[a][d[a]]:
            a += 1
        else:
            break
    if a < k:
        qa = np.eye(p.shape[-1])[d[a]] if q is None else q[a]
        r = np.maximum(p[a] - qa, 0)
        dist = r if r.sum() > 1e-8 else p[a]
    else:
        dist = p[k]
    cdf = np.cumsum(dist, dtype=np.float32)
    return a, int(min(np.sum(cdf <= np.float32(ub) * cdf[-1]), np.nonzero(dist > 0)[0].max()))


def random_accept_inputs(rng, B, w, V, with_q):
    def dist(shape):
        x = rng.dirichlet(np.full(V, 0.4), size=shape).astype(np.float32)
        x[rng.random(x.shape) < 0.3] = 0  # truncated supports
        x[..., 0] += 1e-3
        return x / x.sum(-1, keepdims=True)

    p = dist((B, w))
    q = dist((B, w - 1)) if with_q else None
    src = q if with_q else p[:, : w - 1]
    d = np.array(
        [
            [
                rng.choice(V, p=src[b, j] / src[b, j].sum()) if rng.random() < 0.8 else rng.integers(V)
                for j in range(w - 1)
            ]
            for b in range(B)
        ],
        dtype=np.int32,
    )
    return p, q, d, rng.random((B, w - 1), dtype=np.float32), rng.random(B, dtype=np.float32)


@pytest.mark.parametrize("with_q", [True, False])
def test_accept_reference_matches_the_numpy_rule_and_the_kernel(with_q):
    rng = np.random.default_rng(2)
    impls = [float_cdf_accept]
    for mod in (kernels, getattr(kernels, "reference", None)):
        fn = getattr(mod, "sampling_accept", None) or getattr(mod, "sampling_accept_reference", None)
        if fn is not None and fn not in impls:
            impls.append(fn)
    for w in (1, 2, 5):
        p, q, d, u, ub = random_accept_inputs(rng, 64, w, 24, with_q)
        want = [np_accept(p[b], None if q is None else q[b], d[b], u[b], ub[b]) for b in range(64)]
        for fn in impls:
            acc, bonus = fn(mx.array(p), None if q is None else mx.array(q), mx.array(d), mx.array(u), mx.array(ub))
            assert list(zip(acc.tolist(), bonus.tolist())) == want, (fn, w)


def test_accept_rule_edge_cases():
    p = mx.array([[[0.0, 1.0, 0.0], [0.5, 0.5, 0.0]]])
    # q puts all its mass on the draft, p agrees: always accepted; bonus from p_1.
    acc, bonus = float_cdf_accept(
        p, mx.array([[[0.0, 1.0, 0.0]]]), mx.array([[1]]), mx.array([[0.999]]), mx.array([0.9])
    )
    assert (int(acc[0]), int(bonus[0])) == (1, 1)
    # Draft outside p's support: rejected whatever u; residual = p_0.
    acc, bonus = float_cdf_accept(p, None, mx.array([[2]]), mx.array([[0.0]]), mx.array([0.3]))
    assert (int(acc[0]), int(bonus[0])) == (0, 1)
    # Residual mass 0 (q >= p everywhere, as an unnormalized or rounded q can be): falls back to p_a.
    p2 = mx.array([[[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]])
    acc, bonus = float_cdf_accept(
        p2, mx.array([[[1.0, 1.0, 0.0]]]), mx.array([[0]]), mx.array([[0.999]]), mx.array([0.7])
    )
    assert int(acc[0]) == 0 and int(bonus[0]) == 1


@pytest.mark.parametrize("host", [False, True], ids=["mlx", "host"])
def test_verify_rows_use_history_plus_earlier_drafts(monkeypatch, host):
    sp = SP(temperature=0.9, top_p=0.95, presence_penalty=0.9, frequency_penalty=0.7)
    acc = SampledAcceptor(sp)
    acc.host = host
    acc.begin([1, 2, 3])
    seen = {}

    def spy(p, q, d, u, ub):
        seen["p"] = np.array(p[0])
        return float_cdf_accept(p, q, d, u, ub)

    monkeypatch.setattr(sampled, "sampling_accept", spy)
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(4, VOCAB)).astype(np.float32) * 2
    history = [1, 2, 3, 5, 5, 9]
    drafts = [9, 5, 7]
    acc.verify(mx.array(logits), Draft(tokens=drafts), history)
    for i in range(4):
        np.testing.assert_allclose(seen["p"][i], np_process(logits[i], sp, [5, 5, 9] + drafts[:i]), atol=2e-6)


@pytest.mark.parametrize("host", [False, True], ids=["mlx", "host"])
def test_draft_sampler_q_rows_are_the_verify_processing(host):
    sp = SP(temperature=0.8, top_k=6, frequency_penalty=1.0, seed=4)
    rng = np.random.default_rng(4)
    logits = mx.array(rng.normal(size=(5, 30)).astype(np.float32) * 3)
    hist = [1, 2, 3, 7]
    a = DraftSampler(sp, n_prompt=2, host=host)
    toks, q = a.sample_block(logits, hist)
    for j in range(5):
        np.testing.assert_allclose(np.array(q[j]), np_process(np.array(logits[j]), sp, [3, 7] + toks[:j]), atol=2e-6)
        assert np.array(q[j])[toks[j]] > 0
    b = DraftSampler(sp, n_prompt=2, host=host)  # same seed, same draws; step() agrees with sample_block
    again = []
    for j in range(5):
        t, _ = b.step(logits[j], hist, again)
        again.append(int(t))
    assert again == toks
    nopen = DraftSampler(SP(temperature=0.8, top_k=6, seed=4), n_prompt=2, host=host)
    t2, q2 = nopen.sample_block(logits, hist)  # the batched path
    assert np.allclose(np.array(q2).sum(-1), 1) and all(np.array(q2)[j][t] > 0 for j, t in enumerate(t2))
    again = DraftSampler(SP(temperature=0.8, top_k=6, seed=4), n_prompt=2, host=host)
    assert [int(again.step(logits[j], hist)[0]) for j in range(5)] == t2


# ------------------------------------------------------------------------------ T = 0
def greedy_penalized_reference(target, prompt, n, sp):
    """Plain decoding written from scratch: full forward, argmax of the penalized logits."""
    ids = list(prompt)
    for _ in range(n):
        logits = np.array(target.model(mx.array([ids]))[0, -1].astype(mx.float32))
        ids.append(int(np.argmax(np_process(logits, sp, ids[len(prompt) :]))))
    return ids[len(prompt) :]


@pytest.mark.parametrize("which", ["t16", "big"])
def test_temperature_zero_with_penalties_is_greedy_of_penalized_logits(which, t16, big):
    target = t16 if which == "t16" else big[0]
    V = target.vocab_size
    prompt = [int(x) for x in np.random.default_rng(5).integers(0, min(V, 200), size=12)]
    prompt = prompt + prompt[:8]  # repeats, so lookup drafts
    sp = SP(temperature=0.0, presence_penalty=0.7, frequency_penalty=0.4)
    want = greedy_penalized_reference(target, prompt, 24, sp)
    plain = loop.run(target, prompt, Proposer(), max_new_tokens=24, sampling=sp).tokens
    assert plain == want
    unpen = loop.run(target, prompt, Proposer(), max_new_tokens=24, sampling=SP()).tokens
    assert unpen != want  # the penalties matter here, so the test can tell
    for prop in (LookupProposer(), RandomQProposer(V, seed=1)):
        res = loop.run(target, prompt, prop, max_new_tokens=24, sampling=sp)
        assert res.tokens == want, prop.name
        assert any(d for d in res.drafted)


def test_temperature_zero_is_the_greedy_path():
    assert isinstance(make_acceptor(SP()), GreedyAcceptor)
    assert isinstance(make_acceptor(SP(temperature=0.0, top_p=0.5, top_k=3, seed=1)), GreedyAcceptor)
    assert isinstance(make_acceptor(SP(temperature=0.0, presence_penalty=0.1)), SampledAcceptor)
    assert isinstance(make_acceptor(SP(temperature=1e-6)), SampledAcceptor)
    assert make_acceptor(SP(temperature=0.7)).lazy_ok
    assert not make_acceptor(SP(temperature=0.7, frequency_penalty=0.1)).lazy_ok


# ------------------------------------------------------------------------------ seeds
@pytest.mark.parametrize("mode", ["baseline", "lookup"])
@pytest.mark.parametrize("pen", [0.0, 0.8])
def test_same_seed_same_output(big, mode, pen):
    target, tok = big
    prompt = "def add(a, b):\n    return a + b\ndef add(a, b):\n"

    def gen(seed):
        sp = SP(temperature=1.0, top_p=0.95, seed=seed, frequency_penalty=pen)
        return md.generate(target, tok, prompt, mode=mode, max_new_tokens=24, sampling=sp).tokens

    a, b = gen(11), gen(11)
    assert a == b and len(a) > 0
    others = [gen(s) for s in (12, 13, 14)]
    assert any(o != a for o in others)


def test_same_seed_same_output_with_a_drafter_q(t16):
    def gen(seed):
        sp = SP(temperature=0.8, top_k=8, seed=seed)
        return loop.run(t16, [1, 2, 3, 4], RandomQProposer(VOCAB, seed=seed), max_new_tokens=30, sampling=sp).tokens

    assert gen(3) == gen(3)
    assert gen(3) != gen(4)


def test_cli_sampling_flags_and_seed_reproduce_the_api(big):
    target, tok = big
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_dspark",
            "generate",
            "--model",
            target.source,
            "--prompt",
            "the fox",
            "--max-new-tokens",
            "10",
            "--json",
            "--mode",
            "lookup",
            "--temperature",
            "0.9",
            "--top-k",
            "20",
            "--top-p",
            "0.95",
            "--min-p",
            "0.01",
            "--presence-penalty",
            "0.5",
            "--frequency-penalty",
            "0.25",
            "--seed",
            "7",
            "--logprobs",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    sp = SP(
        temperature=0.9,
        top_k=20,
        top_p=0.95,
        min_p=0.01,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        seed=7,
        logprobs=True,
        top_logprobs=2,
    )
    api = md.generate(target, tok, "the fox", mode="lookup", max_new_tokens=10, sampling=sp)
    assert out["tokens"] == api.tokens  # same seed, same output, across processes
    assert [e["token"] for e in out["logprobs"]] == out["tokens"]
    assert all(len(e["top"]) == 2 and e["logprob"] <= 0 for e in out["logprobs"])


# ------------------------------------------------------------------------------ logprobs
def target_logprobs(target, prompt, tokens):
    """Raw log-softmax of the target at each committed position, by one full forward."""
    logits = target.model(mx.array([list(prompt) + list(tokens)]))[0].astype(mx.float32)
    lp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    return lp[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


def check_logprobs(res, lp, top):
    assert len(res.logprobs) == len(res.tokens)
    for i, (e, t) in enumerate(zip(res.logprobs, res.tokens)):
        assert e["token"] == t
        assert abs(e["logprob"] - lp[i, t]) < 1e-4, (i, e["logprob"], lp[i, t])
        want = np.argsort(-lp[i], kind="stable")[:top]
        assert [j for j, _ in e["top"]] == want.tolist() or np.allclose(
            sorted(x for _, x in e["top"]), sorted(lp[i, want]), atol=1e-4
        )
        assert all(abs(x - lp[i, j]) < 1e-4 for j, x in e["top"])


def test_logprobs_at_temperature_zero_equal_plain_decoding(big):
    target, tok = big
    prompt = md.encode_prompt(tok, "def add(a, b):\n    return a + b\ndef add(a, b):\n")
    sp = SP(logprobs=True, top_logprobs=3)
    base = md.generate(target, tok, None, prompt_ids=prompt, mode="baseline", max_new_tokens=30, sampling=sp)
    look = md.generate(target, tok, None, prompt_ids=prompt, mode="lookup", max_new_tokens=30, sampling=sp)
    assert look.tokens == base.tokens and look.rounds < base.rounds
    for a, b in zip(base.logprobs, look.logprobs):
        assert a["token"] == b["token"] and abs(a["logprob"] - b["logprob"]) < 1e-4
        assert [j for j, _ in a["top"]] == [j for j, _ in b["top"]]
    check_logprobs(base, target_logprobs(target, prompt, base.tokens), 3)


@pytest.mark.parametrize("which", ["lookup", "random-q"])
def test_logprobs_at_temperature_above_zero_are_the_targets_raw_ones(t16, which):
    g = loop.run(t16, [1, 2, 3], Proposer(), max_new_tokens=16).tokens
    prompt = [1, 2, 3] + g + [1, 2, 3] + g[:3]  # the target's own text, repeated: lookup drafts get accepted
    sp = SP(temperature=0.6, top_p=0.9, presence_penalty=0.2, seed=9, logprobs=True, top_logprobs=4)
    prop = LookupProposer() if which == "lookup" else RandomQProposer(VOCAB, seed=2)
    res = loop.run(t16, prompt, prop, max_new_tokens=40, sampling=sp)
    assert any(a > 1 for a in res.accept_lengths)  # some tokens came from accepted drafts
    lp = target_logprobs(t16, prompt, res.tokens)
    check_logprobs(res, lp, 4)
    if which == "random-q":  # the drafter's q says something else entirely
        q_lp = np.log(np.maximum(prop.last_q, 1e-30))
        assert not np.allclose(q_lp[0], lp[-1], atol=0.1)


# ------------------------------------------------------------------------------ options
@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=1.0), "min_p"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(seed=-1), "seed"),
        (dict(top_logprobs=21), "top_logprobs"),
    ],
)
def test_bad_sampling_options_are_user_errors(kw, needle):
    with pytest.raises(UserError, match=needle):
        SP(**kw).validate()
    SP(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=-2, frequency_penalty=2, seed=0).validate()
