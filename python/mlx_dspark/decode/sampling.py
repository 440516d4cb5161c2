"""Sampling parameters. Temperature 0 is exactly the greedy path, not a near-zero temperature.

What each option means, and the order they are applied in, is defined once in
`decode/sampled.py` (module docstring): penalties -> temperature -> top-k -> top-p -> min-p.

  temperature        0 = greedy (argmax, first index on ties); > 0 = sample softmax(logits / T)
  top_p              nucleus: keep the smallest set of most likely tokens whose mass >= top_p
                     (1.0 = off); computed on the tempered, top-k-truncated distribution
  top_k              keep the k most likely tokens (0 = off)
  min_p              keep tokens with probability >= min_p * max probability (0 = off)
  presence_penalty   OpenAI semantics: subtracted once from the logit of every token that
  frequency_penalty  appears in the generated text so far (presence), and once per occurrence
                     (frequency). The prompt is not counted. Range [-2, 2] as in OpenAI's API.
  seed               makes a run reproducible: same seed, same output, in the same mode
                     (None = fresh entropy)
  logprobs           report the logprob of every committed token, and `top_logprobs` (0..20)
                     alternatives, of the target's raw distribution (log-softmax of its logits,
                     before penalties, temperature and truncation), whatever the mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

PENALTY_RANGE = 2.0


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def validate(self) -> None:
        from ..errors import UserError

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise UserError(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise UserError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 <= self.min_p < 1.0:
            raise UserError(f"min_p must be in [0, 1) (0 = off), got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -PENALTY_RANGE <= v <= PENALTY_RANGE:
                raise UserError(f"{name} must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}], got {v}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise UserError(f"seed must be an integer >= 0, got {self.seed!r}")
        if not 0 <= self.top_logprobs <= 20:
            raise UserError(f"top_logprobs must be in 0..20, got {self.top_logprobs}")


def raw_logprobs(rows: mx.array, tokens: Sequence[int], top: int) -> list[dict]:
    """Log-softmax of `rows` [n, V] at `tokens`, with the `top` most likely alternatives."""
    lp = rows.astype(mx.float32)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    out = []
    for i, t in enumerate(tokens):
        entry = {"token": int(t), "logprob": float(lp[i, int(t)].item())}
        if top:
            idx = mx.argsort(-lp[i])[:top]
            entry["top"] = [(int(j), float(lp[i, int(j)].item())) for j in idx.tolist()]
        out.append(entry)
    return out
