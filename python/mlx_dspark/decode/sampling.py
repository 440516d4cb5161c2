"""Sampling parameters. Temperature 0 is exactly the greedy path, not a near-zero temperature."""

from __future__ import annotations

from dataclasses import dataclass


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

    def validate(self) -> None:
        from ..errors import UserError

        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 <= self.min_p < 1.0:
            raise UserError(f"min_p must be in [0, 1), got {self.min_p}")
        if not 0 <= self.top_logprobs <= 20:
            raise UserError(f"top_logprobs must be in 0..20, got {self.top_logprobs}")
