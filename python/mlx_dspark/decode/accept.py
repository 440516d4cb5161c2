"""Acceptance: turning target logits and a draft into committed tokens.

An Acceptor answers three questions for the loop:
  sample(logits_row, history)         the next token after a plain step, as a lazy mx scalar
  verify(logits, draft, history)      (n_accepted, next_token) for a width-(k+1) verify
  token_logprobs(rows, tokens, ...)   logprobs of committed tokens, when asked for

Greedy acceptance is exact prefix matching against the target's argmax (first index on ties),
done by the fused kernel (kernels.greedy_accept). Sampled acceptance (T > 0) is the exact
speculative-sampling rule; it lives in `decode/sampled.py`.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from .. import kernels
from .proposers import Draft
from .sampling import SamplingParams, raw_logprobs


class GreedyAcceptor:
    # Plain steps may be issued before the pending token is known (pipelined decode).
    lazy_ok = True

    def __init__(self, params: SamplingParams | None = None):
        self.params = params or SamplingParams()

    def sample(self, logits_row: mx.array, history: Sequence[int]) -> mx.array:
        return mx.argmax(logits_row, axis=-1).astype(mx.int32)

    def enqueue(self, logits: mx.array, draft: Draft) -> tuple[mx.array, mx.array]:
        """verify()'s accept point, lazy: (accepted, bonus), int32 [1] each, their evaluation (and
        the draft's, where it is still on the device) enqueued. A proposer may draft its next
        block from them before they are read back (decode/drafting.py's before_accept)."""
        k = draft.size
        if draft.device is not None:  # read back with the accept point: one sync for the round
            d = draft.device.reshape(1, k)
        else:
            d = mx.array([draft.tokens], dtype=mx.int32) if k else mx.zeros((1, 0), dtype=mx.int32)
        _, accepted, bonus = kernels.greedy_accept(logits[None, : k + 1], d)
        mx.async_eval(accepted, bonus, d)
        return accepted, bonus

    def verify(self, logits: mx.array, draft: Draft, history: Sequence[int], lazy=None) -> tuple[int, int]:
        """(accepted, next token) read back; `lazy`: enqueue()'s result for this round, if taken."""
        accepted, bonus = lazy if lazy is not None else self.enqueue(logits, draft)
        mx.eval(accepted, bonus)
        draft.read()
        return int(accepted.item()), int(bonus.item())

    def token_logprobs(self, rows: mx.array, tokens: Sequence[int], history: Sequence[int]) -> list[dict]:
        return raw_logprobs(rows, tokens, self.params.top_logprobs)


def make_acceptor(params: SamplingParams | None):
    """Greedy for T = 0 (exactly the greedy path); the lossless sampler otherwise."""
    params = params or SamplingParams()
    if params.greedy and not (params.presence_penalty or params.frequency_penalty):
        return GreedyAcceptor(params)
    from .sampled import SampledAcceptor  # provided with lossless sampling

    return SampledAcceptor(params)
