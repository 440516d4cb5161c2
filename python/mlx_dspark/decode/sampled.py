"""Lossless speculative sampling: the target's own distribution at T > 0, whatever the drafter.

Processing (one definition, used for the target's p AND the drafter's q)
-----------------------------------------------------------------------
`process_logits(logits, params, history, n_prompt=, drafts=)` turns raw logits [n, V] into the
distribution that is sampled, in this order:

  1. penalties    logit[t] -= presence_penalty * (c_t > 0) + frequency_penalty * c_t, where c_t
                  counts t in the *generated* tokens (history[n_prompt:]) plus, for row i of a
                  block, the block's earlier tokens drafts[:i]. The prompt is not counted
                  (OpenAI semantics). Penalties edit logits, so they come first.
  2. temperature  T = 0: the result is the one-hot of argmax (first index on ties) of the
                  penalized logits, and nothing below applies (top-k/top-p/min-p never remove
                  the argmax). T > 0: logits / T.
  3. top-k        keep tokens whose tempered logit >= the k-th largest (ties at the k-th value
                  are all kept, so the set never depends on sort order).
  4. top-p        on softmax of what is left: keep the smallest most-likely set whose mass
                  >= top_p, i.e. every token with probability >= that of the last token needed
                  (ties kept).
  5. min-p        keep tokens with probability >= min_p * max probability.
  6. softmax      of the kept logits, float32.

Why this order: top-p and min-p thresholds then refer to the distribution actually sampled
from (after temperature), as in OpenAI, Hugging Face and vLLM; mlx-lm applies top-p before
temperature, which makes "top_p=0.9" mean a different set at every T. Top-k is monotone, so its
place relative to temperature does not matter; before top-p it matches HF/vLLM (nucleus over
the top-k renormalized). Min-p is a ratio to the max, which renormalization does not change,
so it goes last.

Acceptance (T > 0)
------------------
With p_i = process_logits(verify row i) (row i predicts the token after position i; rows use
the penalty context history + drafts[:i]) and q_j the drafter's distribution for draft d_j
(processed the same way; None = a deterministic proposal, q one-hot):
accept d_j iff u_j * q_j(d_j) < p_j(d_j); stop at the first rejection a; the next token is drawn
from normalize(max(p_a - q_a, 0)) (p_a when that mass <= 1e-8), or from p_k when all k were
accepted. Draws are inverse-CDF with float32 uniforms. The verify uses `kernels.sampling_accept`
(native or its pure-MLX reference; its bonus draw uses an integer CDF, exact to 2^-40 per
probability); the tests state the same rule again with a float CDF and in numpy, and check
every path against both.
This is exact for ANY q, provided each d_j was really drawn from the q_j reported (conditioned
on the history and d_1..d_{j-1}) and from randomness independent of the acceptor's. A proposer
may cut its draft short on anything known before d_j is drawn (DSpark's confidence of slot j
depends on d_{j-1}: fine), never on the value of d_j itself.

T = 0 is the greedy path: with no penalties the loop uses GreedyAcceptor; with penalties this
module accepts by exact prefix match against argmax of the penalized logits.

Randomness and seeds
--------------------
No global RNG is touched. Each consumer owns a numpy Generator from
`make_rng(params, stream)`: SeedSequence([seed, stream]) when a seed is given (reproducible:
same seed, same output, in the same mode), fresh OS entropy otherwise. The acceptor uses
stream "accept" and draws exactly k + 1 uniforms per verify (1 per plain step) whatever the
outcome, so the stream never depends on timing. Drafters use stream "draft".

Logprobs
--------
Logprobs of committed tokens (and the top alternatives) are the target's RAW distribution:
log-softmax of the target's logits at that position, before penalties, temperature and
truncation (vLLM's default, and what greedy decoding reports). They are therefore the same at
every temperature and in every mode, and never the drafter's.

For drafters (DSpark, DFlash, ...) at T > 0
-------------------------------------------
Create one `DraftSampler(params, n_prompt)` per generation (in `begin`, with
n_prompt = len(prompt_ids)); never re-create it between rounds (its stream must continue).
  * slot by slot (Markov heads): `tok, q_row = ds.step(logits_row, history, drafts_so_far)`
  * a block of independent rows (DFlash): `tokens, q = ds.sample_block(logits [k, V], history)`
Return Draft(tokens=[...], q=q [k, V]). At T = 0 the same calls give argmax tokens (with
penalties applied) and one-hot q, which the greedy acceptor ignores.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from .. import kernels
from .proposers import Draft
from .sampling import SamplingParams, raw_logprobs

_STREAMS = {"accept": 0, "draft": 1}


# ---------------------------------------------------------------------------- processing
def penalty_context(history: Sequence[int], n_prompt: int) -> Sequence[int]:
    """The tokens penalties count: the generated part of `history`."""
    return history[n_prompt:]


def _penalties(n: int, V: int, generated: Sequence[int], drafts: Sequence[int], params: SamplingParams) -> mx.array:
    """[n, V] amounts to subtract: row i counts `generated` + drafts[:i]."""
    gen = np.asarray([t for t in generated if 0 <= t < V], dtype=np.int64)
    counts = mx.array(np.bincount(gen, minlength=V)[:V].astype(np.float32))[None]  # [1, V]
    d = [int(t) for t in drafts[: max(n - 1, 0)]]
    if d:
        inc = (mx.array(d, dtype=mx.int32)[:, None] == mx.arange(V)[None]).astype(mx.float32)
        inc = mx.concatenate([mx.zeros((1, V), mx.float32), mx.cumsum(inc, axis=0)], axis=0)
        if inc.shape[0] < n:
            inc = mx.concatenate([inc, mx.broadcast_to(inc[-1:], (n - inc.shape[0], V))], axis=0)
        counts = counts + inc
    return params.frequency_penalty * counts + params.presence_penalty * (counts > 0).astype(mx.float32)


def penalized_logits(
    logits: mx.array,
    params: SamplingParams,
    history: Sequence[int] = (),
    *,
    n_prompt: int = 0,
    drafts: Sequence[int] = (),
) -> mx.array:
    """Step 1 only: float32 logits [n, V] with presence/frequency penalties applied."""
    x = logits.astype(mx.float32)
    if x.ndim == 1:
        x = x[None]
    if params.has_penalties:
        x = x - _penalties(x.shape[0], x.shape[-1], penalty_context(history, n_prompt), drafts, params)
    return x


def truncate(x: mx.array, params: SamplingParams) -> mx.array:
    """Steps 3-5 on tempered logits [n, V]: removed tokens become -inf."""
    V = x.shape[-1]
    neg = mx.array(-np.inf, dtype=mx.float32)
    if 0 < params.top_k < V:
        kth = mx.min(mx.topk(x, params.top_k, axis=-1), axis=-1, keepdims=True)
        x = mx.where(x >= kth, x, neg)
    if params.top_p < 1.0:
        probs = mx.softmax(x, axis=-1)
        s = -mx.sort(-probs, axis=-1)  # descending
        before = mx.cumsum(s, axis=-1, inclusive=False)  # mass of the more likely tokens
        count = mx.sum(before < params.top_p, axis=-1, keepdims=True)  # >= 1
        thr = mx.take_along_axis(s, count - 1, axis=-1)
        x = mx.where(probs >= thr, x, neg)
    if params.min_p > 0.0:
        probs = mx.softmax(x, axis=-1)
        x = mx.where(probs >= params.min_p * mx.max(probs, axis=-1, keepdims=True), x, neg)
    return x


def process_logits(
    logits: mx.array,
    params: SamplingParams,
    history: Sequence[int] = (),
    *,
    n_prompt: int = 0,
    drafts: Sequence[int] = (),
    host: bool | None = None,
) -> mx.array:
    """Raw logits [n, V] (or [V]) -> the float32 distribution [n, V] that is sampled.

    Row i's penalty context is history[n_prompt:] + drafts[:i] (see the module docstring for
    the order of operations). At T = 0 rows are one-hot at the penalized argmax.
    host: compute in numpy (evaluates `logits` now) instead of lazily in MLX; default: on the
    CPU device (see `use_host`)."""
    if host is None:
        host = use_host()
    if host:
        x = np.array(logits.astype(mx.float32)).reshape(-1, logits.shape[-1])
        return mx.array(probs_np(x, params, penalty_context(history, n_prompt), drafts))
    x = penalized_logits(logits, params, history, n_prompt=n_prompt, drafts=drafts)
    if params.greedy:
        return (mx.arange(x.shape[-1])[None] == mx.argmax(x, axis=-1)[:, None]).astype(mx.float32)
    x = truncate(x / params.temperature, params)
    return mx.softmax(x, axis=-1)


# ------------------------------------------------------------------ the host (numpy) path
def use_host() -> bool:
    """Sample on the host when MLX runs on the CPU. There MLX's exp and sort are 10-20x slower
    than numpy's (8 rows of a 49k vocabulary: softmax 12 ms vs 1.1 ms, sort 75 ms vs 6.5 ms),
    and a lazy graph overlaps nothing anyway (same cores). On a GPU everything stays lazy."""
    return mx.default_device() == mx.cpu


def probs_np(
    x: np.ndarray, params: SamplingParams, generated: Sequence[int] = (), drafts: Sequence[int] = ()
) -> np.ndarray:
    """process_logits in numpy: raw logits [n, V] -> float32 distribution [n, V]; row i's
    penalties count `generated` + drafts[:i]. Same steps, same order (probabilities of the kept
    tokens renormalized, which equals the softmax of the kept logits)."""
    x = np.array(x, dtype=np.float32)  # a copy
    n, V = x.shape
    if params.has_penalties:
        gen = np.asarray([t for t in generated if 0 <= t < V], dtype=np.int64)
        counts = np.tile(np.bincount(gen, minlength=V)[:V].astype(np.float32), (n, 1))
        for j, t in enumerate(drafts[: max(n - 1, 0)]):
            if 0 <= int(t) < V:
                counts[j + 1 :, int(t)] += 1
        x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    rows = np.arange(n)
    if params.greedy:
        out = np.zeros((n, V), np.float32)
        out[rows, np.argmax(x, axis=-1)] = 1.0
        return out
    x /= np.float32(params.temperature)
    if 0 < params.top_k < V:
        kth = np.partition(x, V - params.top_k, axis=-1)[:, V - params.top_k : V - params.top_k + 1]
        x[x < kth] = -np.inf
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        s = -np.sort(-p, axis=-1)
        before = np.zeros_like(s)
        np.cumsum(s[:, :-1], axis=-1, out=before[:, 1:])
        count = (before < np.float32(params.top_p)).sum(axis=-1)
        p[p < s[rows, count - 1][:, None]] = 0.0
        p /= p.sum(axis=-1, keepdims=True)
    if params.min_p > 0.0:
        p[p < np.float32(params.min_p) * p.max(axis=-1, keepdims=True)] = 0.0
        p /= p.sum(axis=-1, keepdims=True)
    return p


def draw_np(P: np.ndarray, u: np.ndarray) -> np.ndarray:
    """sample_from in numpy: rows of P [n, V] (need not be normalized), uniforms u [n]."""
    cdf = np.cumsum(P, axis=-1, dtype=np.float32)
    idx = np.array([np.searchsorted(c, np.float32(ui) * c[-1], side="right") for c, ui in zip(cdf, u)])
    last = P.shape[-1] - 1 - np.argmax(P[:, ::-1] > 0, axis=-1)  # float rounding guard
    return np.minimum(idx, last).astype(np.int32)


def sample_from(probs: mx.array, u) -> mx.array:
    """Inverse-CDF draw. probs [V] with a float u -> int32 scalar; probs [n, V] with u [n] -> [n].

    `probs` need not be normalized. A zero-probability token is never returned."""
    single = probs.ndim == 1
    P = probs[None] if single else probs
    V = P.shape[-1]
    u = mx.array(u, dtype=mx.float32).reshape(-1, 1)
    cdf = mx.cumsum(P.astype(mx.float32), axis=-1)
    idx = mx.sum(cdf <= u * cdf[:, -1:], axis=-1)  # first index whose cdf exceeds u * total
    last = mx.max(mx.where(P > 0, mx.arange(V)[None], 0), axis=-1)  # float rounding guard
    tok = mx.minimum(idx, last).astype(mx.int32)
    return tok[0] if single else tok


def make_rng(params: SamplingParams, stream: str = "accept") -> np.random.Generator:
    """The Generator of one consumer; reproducible when params.seed is set."""
    if params.seed is None:
        return np.random.default_rng()
    return np.random.default_rng(np.random.SeedSequence([int(params.seed), _STREAMS[stream]]))


def uniforms(rng: np.random.Generator, n: int) -> np.ndarray:
    """n float32 uniforms in [0, 1) (never 1.0)."""
    return rng.random(n, dtype=np.float32)


class DraftSampler:
    """What a drafter needs to propose at T > 0 with the verify's exact processing."""

    def __init__(self, params: SamplingParams, n_prompt: int, host: bool | None = None):
        self.params = params
        self.n_prompt = n_prompt
        self.host = use_host() if host is None else host
        self.rng = make_rng(params, "draft")

    def probs(self, logits: mx.array, history: Sequence[int], drafts: Sequence[int] = ()) -> mx.array:
        return process_logits(logits, self.params, history, n_prompt=self.n_prompt, drafts=drafts, host=self.host)

    def step(self, logits_row: mx.array, history: Sequence[int], drafts: Sequence[int] = ()):
        """(token (int32 scalar; lazy on a GPU), q_row [V]) for the slot after history + drafts."""
        ctx = list(history) + [int(t) for t in drafts]
        u = uniforms(self.rng, 1)
        if self.host:
            x = np.array(logits_row.astype(mx.float32)).reshape(1, -1)
            q = probs_np(x, self.params, penalty_context(ctx, self.n_prompt))
            return mx.array(int(draw_np(q, u)[0]), dtype=mx.int32), mx.array(q[0])
        q = self.probs(logits_row.reshape(1, -1), ctx)[0]
        return sample_from(q, float(u[0])), q

    def sample_block(self, logits: mx.array, history: Sequence[int]) -> tuple[list[int], mx.array]:
        """Tokens and q [k, V] for k rows whose logits do not depend on the drawn tokens."""
        k = logits.shape[0]
        u = uniforms(self.rng, k)
        if not self.params.has_penalties:  # rows are independent: one batched draw
            if self.host:
                q = probs_np(np.array(logits.astype(mx.float32)), self.params)
                return draw_np(q, u).tolist(), mx.array(q)
            q = self.probs(logits, history)
            toks = sample_from(q, u)
            mx.eval(toks, q)
            return [int(t) for t in toks.tolist()], q
        toks: list[int] = []
        rows = []
        for j in range(k):  # row j's penalties count the tokens drawn before it
            q = self.probs(logits[j : j + 1], list(history) + toks)
            toks.append(int(sample_from(q[0], float(u[j])).item()))
            rows.append(q[0])
        return toks, mx.stack(rows)


# ---------------------------------------------------------------------------- acceptance
def sampling_accept(p, q, draft, u, u_bonus):
    """The accept kernel (kernels.sampling_accept: native where built, else its pure-MLX
    reference, kernels/reference.py, which defines the semantics)."""
    return kernels.sampling_accept(p, q, draft, u, u_bonus)


class SampledAcceptor:
    """T > 0 (and T = 0 with penalties): the exact speculative-sampling rule.

    Penalties need the prompt length: `begin(prompt)` sets it; without that call it is taken
    from the first call, which in decode/loop.py is sample() right after prefill (history ==
    the prompt)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        # With penalties the next token's distribution depends on the pending token, which a
        # pipelined plain step does not know yet.
        self.lazy_ok = not params.has_penalties
        self.rng = make_rng(params, "accept")
        self.n_prompt: int | None = None
        self.host = use_host()

    def begin(self, prompt: Sequence[int]) -> None:
        self.n_prompt = len(prompt)

    def _n_prompt(self, history: Sequence[int]) -> int:
        # The loop's first call is sample() right after prefill, with history == prompt.
        if self.n_prompt is None:
            self.n_prompt = len(history)
        return self.n_prompt

    def sample(self, logits_row: mx.array, history: Sequence[int]) -> mx.array:
        n_prompt = self._n_prompt(history)
        if self.params.greedy:
            x = penalized_logits(logits_row, self.params, history, n_prompt=n_prompt)
            return mx.argmax(x[0], axis=-1).astype(mx.int32)
        u = uniforms(self.rng, 1)
        if self.host and (self.params.top_p < 1.0 or not self.lazy_ok):
            # Host draw, which evaluates the row now: when the step is not pipelined anyway
            # (penalties), or for top-p (MLX's CPU sort costs ~10x numpy's). Otherwise the lazy
            # draw keeps plain steps pipelined.
            x = np.array(logits_row.astype(mx.float32)).reshape(1, -1)
            P = probs_np(x, self.params, penalty_context(history, n_prompt))
            return mx.array(int(draw_np(P, u)[0]), dtype=mx.int32)
        probs = process_logits(logits_row, self.params, history, n_prompt=n_prompt, host=False)
        return sample_from(probs[0], float(u[0]))

    def verify(self, logits: mx.array, draft: Draft, history: Sequence[int]) -> tuple[int, int]:
        n_prompt = self._n_prompt(history)
        k = len(draft.read())
        d = mx.array([draft.tokens], dtype=mx.int32).reshape(1, k)
        if self.params.greedy:
            x = penalized_logits(logits[: k + 1], self.params, history, n_prompt=n_prompt, drafts=draft.tokens)
            _, acc, bonus = kernels.greedy_accept(x[None], d)
        else:
            p = process_logits(
                logits[: k + 1], self.params, history, n_prompt=n_prompt, drafts=draft.tokens, host=self.host
            )
            q = None
            if draft.q is not None and k:
                q = draft.q[:k].astype(mx.float32)
                if q.shape != (k, p.shape[-1]):
                    raise ValueError(f"draft q has shape {tuple(q.shape)}, expected {(k, p.shape[-1])}")
                q = q[None]
            u = uniforms(self.rng, k + 1)
            acc, bonus = sampling_accept(p[None], q, d, mx.array(u[:k])[None], mx.array(u[k:]))
        mx.eval(acc, bonus)
        return int(acc.item()), int(bonus.item())

    def token_logprobs(self, rows: mx.array, tokens: Sequence[int], history: Sequence[int]) -> list[dict]:
        return raw_logprobs(rows, tokens, self.params.top_logprobs)
