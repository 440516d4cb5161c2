"""Exactness in distribution: speculative sampling reproduces plain sampling from the target.

The target has a 16-token vocabulary (tests/sampling_fixtures.py), so the joint distribution of
the first three sampled tokens is known exactly: the product of its processed next-token
distributions, computed by full forwards and an independent numpy statement of plain sampling
(`np_process`). Speculative runs are compared with it by a chi-square goodness-of-fit test
(cells with expected count < 5 pooled; an outcome of probability 0 fails outright).

Two harnesses:
  * batched: thousands of runs at once through the real `process_logits` / `sample_from` and
    the real accept rule (`sampled.sampling_accept`: the native kernel when present, else the
    reference), with the target's rows taken from the exact table and drafts from proposers
    deliberately unlike the target: another model's processed distribution ("model-q", what
    DSpark/DFlash report), a spiky random q ("random-q"), and deterministic proposals with q
    one-hot ("one-hot", what lookup reports).
  * end to end: seeded runs of `decode.loop.run` with the real target, the real
    LookupProposer on a prompt full of repeats, and a test proposer that drafts from a known q.

Both must fail with a deliberately broken acceptance rule (the mutants below).
"""

from __future__ import annotations

import zlib

import mlx.core as mx
import numpy as np
import pytest
from sampling_fixtures import (
    VOCAB,
    chi2_sf,
    ctx_offsets,
    exact_logits,
    float_cdf_accept,
    float_cdf_residual,
    gof_pvalue,
    processed_table,
    write_model16,
)

from mlx_dspark.decode import loop, sampled
from mlx_dspark.decode.costs import Costs
from mlx_dspark.decode.drafting import DrafterProposer
from mlx_dspark.decode.lookup import LookupProposer
from mlx_dspark.decode.modes import drafter_proposer
from mlx_dspark.decode.policy import CostPolicy
from mlx_dspark.decode.proposers import Draft, Proposer
from mlx_dspark.decode.sampling import SamplingParams
from mlx_dspark.models.loading import load_target

V = VOCAB
DEPTH = 3  # joint of the first three tokens
ALPHA = 0.01
OFF = ctx_offsets(DEPTH)
PROMPT = [3, 5, 1, 3, 7, 2, 3, 9, 4, 3]

CONFIGS = {  # id -> SamplingParams kwargs: each T with top-p and with top-k
    "T0.7-top_p": dict(temperature=0.7, top_p=0.8),
    "T0.7-top_k": dict(temperature=0.7, top_k=4),
    "T1.0-top_p": dict(temperature=1.0, top_p=0.8),
    "T1.0-top_k": dict(temperature=1.0, top_k=4),
}
PENALTY_CONFIGS = {
    "T0.7-top_p-pen": dict(temperature=0.7, top_p=0.9, presence_penalty=0.8, frequency_penalty=0.6),
    "T1.0-top_k-pen": dict(temperature=1.0, top_k=5, presence_penalty=-0.7, frequency_penalty=1.1),
    "T1.0-min_p-pen": dict(temperature=1.0, min_p=0.05, presence_penalty=1.5),
}


# ------------------------------------------------------------------------------ mutants
def mutant_accept_p_ge_q(p, q, draft, u, u_bonus):
    """BROKEN on purpose: accepts whenever p(d) >= q(d) (no coin flip); residual as usual."""
    k = p.shape[1] - 1
    pd = mx.take_along_axis(p[:, :k], draft[..., None], axis=-1)[..., 0]
    qd = mx.ones_like(pd) if q is None else mx.take_along_axis(q, draft[..., None], axis=-1)[..., 0]
    acc = mx.sum(mx.cumprod((pd >= qd).astype(mx.int32), axis=1), axis=1).astype(mx.int32)
    return acc, float_cdf_residual(p, q, draft, acc, u_bonus)


def mutant_accept_resample_p(p, q, draft, u, u_bonus):
    """BROKEN on purpose: on rejection draws the next token from p instead of the residual."""
    acc, _ = float_cdf_accept(p, q, draft, u, u_bonus)
    pa = mx.take_along_axis(p, acc[:, None, None], axis=1)[:, 0]
    return acc, sampled.sample_from(pa, u_bonus)


# ------------------------------------------------------------------------------ statistics
def index(ctx: np.ndarray) -> np.ndarray:
    """Row of contexts [M, L] in the exact tables."""
    M, L = ctx.shape
    return OFF[L] + (np.ravel_multi_index(ctx.T, (V,) * L) if L else np.zeros(M, dtype=np.int64))


def expected_joint(P: np.ndarray) -> np.ndarray:
    """[V**3] exact probabilities of (t1, t2, t3) from the processed table P (contexts of
    length 0..2 are enough; longer ones may follow)."""
    t1 = P[0]
    t2 = P[OFF[1] : OFF[2]]  # [V, V]
    t3 = P[OFF[2] : OFF[3]].reshape(V, V, V)
    return (t1[:, None, None] * t2[:, :, None] * t3).reshape(-1)


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def target16_dir(tmp_path_factory):
    return write_model16(tmp_path_factory.mktemp("v16-target"), "llama", seed=1, layers=2)


@pytest.fixture(scope="module")
def target16(target16_dir):
    return load_target(str(target16_dir))[0]


@pytest.fixture(scope="module")
def drafters16(target16_dir, target16, tmp_path_factory):
    """Real DSpark (Markov + confidence heads) and DFlash (DeepSpec packaging) checkpoints with
    random weights for the vocab-16 target: drafters unlike it, loaded by the real loader."""
    from drafter_fixtures import write_deepspec

    from mlx_dspark.models.drafters import load_drafter

    root = tmp_path_factory.mktemp("v16-drafters")
    dspark = write_deepspec(root / "dspark", target16_dir, taps=[0], markov_rank=8, seed=3)
    dflash = write_deepspec(root / "dflash", target16_dir, taps=[0], markov_rank=0, confidence=False, seed=4)
    out = {
        "dspark": load_drafter(str(dspark), target16, bits=16),
        "dflash": load_drafter(str(dflash), target16, bits=16),
    }
    assert out["dspark"].kind == "dspark" and out["dflash"].kind == "dflash"
    # The same DSpark drafter restricted to 9 of the 16 tokens (models/draft_vocab.py): q is 0
    # on the other 7, which the target still samples (through the residual).
    from mlx_dspark.models.draft_vocab import write_ranking

    small = write_deepspec(root / "dspark-vocab", target16_dir, taps=[0], markov_rank=8, seed=3)
    write_ranking(small, [[1, 3, 4, 6, 7, 9, 11, 12, 14]])
    out["dspark-vocab"] = load_drafter(str(small), target16, bits=16, draft_vocab=9)
    assert out["dspark-vocab"].describe()["draft_vocab"] == 9
    return out


@pytest.fixture(scope="module")
def drafter16(tmp_path_factory):
    """Another random model: its distributions are the 'model-q' drafter, unlike the target's."""
    path = write_model16(tmp_path_factory.mktemp("v16-drafter"), "qwen3", seed=7, layers=1, logit_std=2.5)
    return load_target(str(path))[0]


@pytest.fixture(scope="module")
def raw_tables(target16, drafter16):
    return exact_logits(target16, PROMPT, DEPTH), exact_logits(drafter16, PROMPT, DEPTH)


# ------------------------------------------------------------------------------ batched harness
class SimProposer:
    """Drafts for many runs at once: (tokens [M, k], q [M, k, V] or None) for contexts [M, g]."""

    def __init__(self, kind: str, q_table: np.ndarray, seed: int):
        self.kind = kind
        self.q_table = q_table  # processed drafter distributions per context ("model-q")
        self.rng = np.random.default_rng([seed, 1])
        table_rng = np.random.default_rng(12345)
        self.spiky = table_rng.dirichlet(np.full(V, 0.3), size=V)  # "random-q": q depends on the last token
        self.fixed = table_rng.integers(0, V, size=OFF[-1] + V**DEPTH)  # "one-hot": d = f(context)

    def _q(self, ctx: np.ndarray) -> np.ndarray:
        if self.kind == "model-q":
            return self.q_table[index(ctx)]
        return self.spiky[ctx[:, -1]]

    def propose(self, ctx: np.ndarray, k: int):
        toks, qs = [], []
        for _ in range(k):
            if self.kind == "one-hot":
                toks.append(self.fixed[index(ctx)])
            else:
                q = self._q(ctx)
                cdf = np.cumsum(q, axis=1)
                u = self.rng.random(len(ctx))[:, None] * cdf[:, -1:]
                toks.append(np.minimum((cdf <= u).sum(axis=1), V - 1))
                qs.append(q)
            ctx = np.concatenate([ctx, toks[-1][:, None]], axis=1)
        q = None if self.kind == "one-hot" else np.stack(qs, axis=1).astype(np.float32)
        return np.stack(toks, axis=1), q


def simulate(P: np.ndarray, proposer: SimProposer, n: int, accept, seed: int) -> np.ndarray:
    """Counts [V**3] of the first three tokens over n speculative runs, batched."""
    rng = np.random.default_rng([seed, 2])
    p0 = mx.broadcast_to(mx.array(P[0].astype(np.float32)), (n, V))
    t1 = np.array(sampled.sample_from(p0, rng.random(n, dtype=np.float32)))  # the prefill sample
    toks = np.full((n, DEPTH), -1)
    toks[:, 0] = t1
    have = np.ones(n, dtype=int)
    while (have < DEPTH).any():
        for g in range(1, DEPTH):
            runs = np.nonzero(have == g)[0]
            if not len(runs):
                continue
            k = DEPTH - g  # drafts beyond the third token would not matter
            ctx = toks[runs, :g]
            d, q = proposer.propose(ctx, k)
            full = np.concatenate([ctx, d], axis=1)
            p = np.stack([P[index(full[:, : g + i])] for i in range(k + 1)], axis=1).astype(np.float32)
            acc, bonus = accept(
                mx.array(p),
                None if q is None else mx.array(q),
                mx.array(d.astype(np.int32)),
                mx.array(rng.random((len(runs), k), dtype=np.float32)),
                mx.array(rng.random(len(runs), dtype=np.float32)),
            )
            acc, bonus = np.array(acc), np.array(bonus)
            for r, a, b, dr in zip(runs, acc, bonus, d):
                new = list(dr[:a]) + [b]
                m = min(len(new), DEPTH - have[r])
                toks[r, have[r] : have[r] + m] = new[:m]
                have[r] += m
    return np.bincount(np.ravel_multi_index(toks.T, (V,) * DEPTH), minlength=V**DEPTH)


_TABLES: dict = {}


def tables(raw_tables, cfg: dict):
    """(P, Q): the target's and the drafter's processed tables under `cfg` (the same processing)."""
    key = tuple(sorted(cfg.items()))
    if key not in _TABLES:
        sp = SamplingParams(**cfg)
        _TABLES[key] = tuple(processed_table(raw, sp, DEPTH) for raw in raw_tables)
    return _TABLES[key]


def batched_pvalue(raw_tables, kind: str, cfg: dict, accept=None, n: int = 10000, seed: int = 0) -> float:
    P, Q = tables(raw_tables, cfg)
    # Resolved at call time, so a monkeypatched rule is what runs.
    counts = simulate(P, SimProposer(kind, Q, seed), n, accept or sampled.sampling_accept, seed)
    return gof_pvalue(counts, expected_joint(P))


def assert_fits(pvalue_of_seed, seed: int, label: str) -> None:
    """p > ALPHA. Under exactness p is uniform, so a fixed seed fails 1 time in 100 by chance;
    then one fresh, independent repetition decides (a real bias fails both: the mutants below
    score p < 1e-10)."""
    pv = pvalue_of_seed(seed)
    print(f"{label}: p = {pv:.3g}")
    if pv <= ALPHA:
        pv2 = pvalue_of_seed(seed + 10_000)
        assert pv2 > ALPHA, f"{label}: p = {pv:.3g}, then p = {pv2:.3g} on a fresh seed"


KINDS = ["model-q", "random-q", "one-hot"]


@pytest.mark.parametrize("cfg", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("kind", KINDS)
def test_batched_speculative_sampling_is_exact(raw_tables, kind, cfg):
    assert_fits(
        lambda s: batched_pvalue(raw_tables, kind, CONFIGS[cfg], seed=s),
        zlib.crc32(f"{kind}/{cfg}".encode()) % 1000,
        f"{kind} {cfg}",
    )


@pytest.mark.parametrize("cfg", list(PENALTY_CONFIGS), ids=list(PENALTY_CONFIGS))
@pytest.mark.parametrize("kind", KINDS)
def test_batched_speculative_sampling_is_exact_with_penalties(raw_tables, kind, cfg):
    assert_fits(
        lambda s: batched_pvalue(raw_tables, kind, PENALTY_CONFIGS[cfg], seed=s),
        zlib.crc32(f"{kind}/{cfg}".encode()) % 1000,
        f"{kind} {cfg}",
    )


@pytest.mark.parametrize("mutant", [mutant_accept_p_ge_q, mutant_accept_resample_p])
@pytest.mark.parametrize("kind", KINDS)
def test_mutant_acceptance_rules_fail_the_batched_test(raw_tables, kind, mutant):
    for cfg in ("T1.0-top_k", "T0.7-top_p"):
        pv = batched_pvalue(raw_tables, kind, CONFIGS[cfg], accept=mutant)
        assert pv <= ALPHA, f"mutant {mutant.__name__} passed {kind} {cfg}: p = {pv:.3g}"


def test_plain_sampling_harness_matches_the_exact_distribution(raw_tables):
    """The harness itself: sampling token by token with sample_from (no drafts) fits."""
    P, _ = tables(raw_tables, CONFIGS["T1.0-top_p"])

    def pvalue(seed, n=10000):
        rng = np.random.default_rng(seed)
        toks = np.zeros((n, 0), dtype=int)
        for _ in range(DEPTH):
            p = mx.array(P[index(toks)].astype(np.float32))
            t = np.array(sampled.sample_from(p, rng.random(n, dtype=np.float32)))
            toks = np.concatenate([toks, t[:, None]], axis=1)
        counts = np.bincount(np.ravel_multi_index(toks.T, (V,) * DEPTH), minlength=V**DEPTH)
        return gof_pvalue(counts, expected_joint(P))

    assert_fits(pvalue, 5, "plain sample_from")


# ------------------------------------------------------------------------------ end to end
def lookup_prompt(target, rounds: int = 3) -> list[int]:
    """Blocks [6, a, g1(a), g2(a)] for every token a, block 0 again, and a final 6. The suffix
    (g2(0), 6) occurred before, so the real LookupProposer drafts right after the first sampled
    token t1, copying g1(t1) g2(t1). g1 g2 are refitted a few times to the target's greedy
    continuation after the whole prompt + a, so copied drafts are often right, sometimes not."""
    cont = {a: [0, 0] for a in range(V)}

    def build():
        body = [t for a in range(V) for t in [6, a] + cont[a]]
        return body + body[:4] + [6]

    for _ in range(rounds):
        ids = build()
        seqs = mx.array([ids + [a] for a in range(V)])
        g1 = mx.argmax(target.model(seqs)[:, -1], axis=-1)
        g2 = mx.argmax(target.model(mx.concatenate([seqs, g1[:, None]], axis=1))[:, -1], axis=-1)
        cont = {a: [int(g1[a]), int(g2[a])] for a in range(V)}
    return build()


class KnownQProposer(Proposer):
    """Test-only drafter: proposes k tokens drawn from a fixed spiky q that depends on the
    previous token (unlike the target), and reports that q."""

    name = "known-q"

    def __init__(self, seed: int):
        self.rng = np.random.default_rng([seed, 99])
        self.q = np.random.default_rng(4321).dirichlet(np.full(V, 0.3), size=V).astype(np.float32)
        self.proposed = self.accepted = 0

    def wants_round(self, history):
        return True

    def propose(self, history, max_draft, sampling):
        prev, toks, rows = history[-1], [], []
        for _ in range(max_draft):
            q = self.q[prev]
            t = int(np.searchsorted(np.cumsum(q), self.rng.random() * q.sum(), side="right"))
            toks.append(min(t, V - 1))
            rows.append(q)
            prev = toks[-1]
        return Draft(tokens=toks, q=mx.array(np.stack(rows)))

    def observe(self, n_proposed, n_accepted, hidden):
        self.proposed += n_proposed
        self.accepted += n_accepted


def e2e_counts(target, prompt, make_proposer, cfg: dict, n: int, seed0: int = 0, max_new: int = DEPTH + 1):
    counts = np.zeros(V**DEPTH, dtype=np.int64)
    drafted = accepted_drafts = 0
    for s in range(seed0, seed0 + n):
        res = loop.run(
            target,
            prompt,
            make_proposer(s),
            max_new_tokens=max_new,
            max_draft=8,
            sampling=SamplingParams(seed=s, **cfg),
        )
        t = res.tokens[:DEPTH]
        counts[np.ravel_multi_index(t, (V,) * DEPTH)] += 1
        drafted += sum(res.drafted)
        accepted_drafts += sum(a - 1 for a, d in zip(res.accept_lengths, res.drafted) if d)
    return counts, drafted, accepted_drafts


def e2e_pvalue(target, prompt, make_proposer, cfg, n, seed0=0, max_new=DEPTH + 1):
    # Contexts up to length DEPTH - 1 determine the first DEPTH tokens.
    P = processed_table(exact_logits(target, prompt, DEPTH - 1), SamplingParams(**cfg), DEPTH - 1)
    counts, drafted, acc = e2e_counts(target, prompt, make_proposer, cfg, n, seed0, max_new)
    return gof_pvalue(counts, expected_joint(P)), drafted, acc


# name -> (proposer, prompt, sampling): every real mode, each T, top-p and top-k, penalties.
E2E = {
    "baseline": ("baseline", PROMPT, dict(temperature=0.7, top_k=5, presence_penalty=0.8, frequency_penalty=0.5)),
    "lookup-pen": ("lookup", "lookup", dict(temperature=1.0, top_k=4, frequency_penalty=1.0)),
    "known-q": ("known-q", PROMPT, dict(temperature=0.7, top_p=0.85, presence_penalty=0.6, frequency_penalty=0.4)),
    "dspark": ("dspark", PROMPT, dict(temperature=1.0, top_p=0.8)),
    "dspark-conf-pen": ("dspark-conf", PROMPT, dict(temperature=0.7, top_k=5, presence_penalty=0.7)),
    "dspark-cut": ("dspark-cut", PROMPT, dict(temperature=1.0, top_k=6)),
    "dflash-pen": ("dflash", PROMPT, dict(temperature=1.0, top_k=4, frequency_penalty=0.8)),
    "dspark-draft-vocab": ("dspark-vocab", PROMPT, dict(temperature=1.0, top_p=0.9)),
}
E2E_RUNS = 600
CUT_COSTS = Costs([1, 2, 4, 8], [0.010, 0.011, 0.013, 0.020], t_draft=0.001, origin="given")
# Generations longer than the DEPTH tokens counted, where a round's block must not be capped by
# the tokens left (the cut then lands at 1 to 4 of the 7 slots).
E2E_MAX_NEW = {"dspark-cut": 12}
# Which sampling path each runs: numpy on the host (the CPU default) or lazy MLX (the GPU default).
E2E_HOST = {
    "baseline": True,
    "lookup-pen": False,
    "known-q": True,
    "dspark": False,
    "dspark-conf-pen": True,
    "dspark-cut": False,
    "dflash-pen": False,
    "dspark-draft-vocab": True,
}


def e2e_setup(name, target16, drafters=None):
    kind, prompt, cfg = E2E[name]
    prompt = lookup_prompt(target16) if prompt == "lookup" else prompt
    make = {
        "baseline": lambda s: Proposer(),
        "lookup": lambda s: LookupProposer(),
        "known-q": KnownQProposer,
        # Drafter-only proposals (no free lookup drafts), so every draft carries the drafter's q.
        "dspark": lambda s: drafter_proposer(drafters["dspark"], lookup_drafts=False),
        "dspark-conf": lambda s: drafter_proposer(drafters["dspark"], confidence_threshold=0.3, lookup_drafts=False),
        # The cost model cuts each block by its confidences (CostPolicy.cut) on a curve that
        # makes the cut land anywhere in the block.
        "dspark-cut": lambda s: DrafterProposer(
            drafters["dspark"], lookup_drafts=False, policy=CostPolicy(CUT_COSTS, cap=16)
        ),
        "dflash": lambda s: drafter_proposer(drafters["dflash"], lookup_drafts=False),
        "dspark-vocab": lambda s: drafter_proposer(drafters["dspark-vocab"], lookup_drafts=False),
    }[kind]
    return make, prompt, cfg


@pytest.mark.parametrize("name", list(E2E))
def test_end_to_end_loop_sampling_is_exact(target16, drafters16, name, monkeypatch):
    monkeypatch.setattr(sampled, "use_host", lambda: E2E_HOST[name])
    make, prompt, cfg = e2e_setup(name, target16, drafters16)
    n = E2E_RUNS

    def pvalue(seed0):
        pv, drafted, acc = e2e_pvalue(target16, prompt, make, cfg, n, seed0, E2E_MAX_NEW.get(name, DEPTH + 1))
        if name != "baseline":
            print(f"{name}: {drafted} drafted, {acc} accepted")
            assert drafted > n // 4 and 0 < acc < drafted, (drafted, acc)  # drafts happen, some fail
        return pv

    assert_fits(pvalue, 0, name)


def test_end_to_end_mutant_fails(target16, drafters16, monkeypatch):
    """The same end-to-end test with the broken rule plugged into the acceptor must fail."""
    monkeypatch.setattr(sampled, "sampling_accept", mutant_accept_p_ge_q)
    for name in ("lookup-pen", "dflash-pen"):
        make, prompt, cfg = e2e_setup(name, target16, drafters16)
        pv, _, _ = e2e_pvalue(target16, prompt, make, cfg, E2E_RUNS)
        assert pv <= ALPHA, f"mutant passed end to end ({name}): p = {pv:.3g}"


def test_chi2_survival_function():
    """The p-value routine itself, against scipy when it is installed, else known quantiles."""
    try:
        from scipy.stats import chi2
    except ImportError:
        chi2 = None
    for df in (1, 2, 5, 30, 200, 1000):
        for x in (0.01, 0.5, df * 0.7, df, df * 1.3 + 3, df * 2 + 20):
            want = float(chi2.sf(x, df)) if chi2 is not None else None
            got = chi2_sf(x, df)
            if want is not None:
                assert abs(got - want) <= 1e-9 + 1e-7 * want, (df, x, got, want)
    assert abs(chi2_sf(3.841458820694124, 1) - 0.05) < 1e-9
    assert abs(chi2_sf(23.209251158954356, 10) - 0.01) < 1e-9
