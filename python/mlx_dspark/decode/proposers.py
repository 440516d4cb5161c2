"""The Proposer protocol: what every speculative mode implements.

A round of the verify loop (decode/loop.py) is: propose -> verify -> accept -> commit/rollback.
A mode is a Proposer; the loop is never copied.

Life cycle, for one generation:
  begin(target, prompt_ids, prompt_hidden)  after the target's prefill. `prompt_hidden` holds the
                                            tapped rows of every prompt position [N, len(taps)*H]
                                            (None when `taps` is empty).
  wants_round(history)                      cheap: may the loop spend a synced round on a draft
                                            now? False lets the loop take pipelined plain steps.
                                            `history` may lag the newest token by one.
  propose(history, max_draft, sampling)     a Draft of at most `max_draft` tokens that continue
                                            `history` (its last item is the anchor: committed,
                                            not yet fed to the target). Empty = plain step.
  before_accept(hidden, accepted, bonus)    optional, greedy solo rounds: the verify is enqueued
                                            and its accept point with it (int32 [1] each, lazy),
                                            `hidden` every verified row's taps [k + 1, T]. A
                                            proposer may enqueue its next draft on them before
                                            they are read back (drafting.py: draft ahead).
  observe(n_proposed, n_accepted, hidden)   after verify: `hidden` holds the tapped rows of the
                                            positions that were fed and kept, i.e. the anchor and
                                            the accepted drafts ([n_accepted + 1, T]); plain steps
                                            report (0, 0, row of the fed token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import mlx.core as mx

if TYPE_CHECKING:
    from ..models.target import Target
    from .sampling import SamplingParams


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    # Draft distributions q [k, V] at the verify temperature, after the same truncation and
    # penalties as the target's p. None means the proposal is deterministic (q is one-hot).
    q: mx.array | None = None
    # A greedy draft still on the device: int32 [k], lazy (its pass enqueued with async_eval).
    # The loop feeds it to the verify forward as it is and the acceptor reads it back in the
    # same sync as the accept point, so the round syncs once; `tokens` is filled then.
    device: mx.array | None = None

    @property
    def size(self) -> int:
        return len(self.tokens) if self.device is None else int(self.device.shape[0])

    def read(self) -> list[int]:
        """The draft's tokens, read back from the device where they are still there."""
        if self.device is not None:
            self.tokens, self.device = [int(t) for t in self.device.tolist()], None
        return self.tokens


class Proposer:
    """Base class and the baseline mode: proposes nothing, so every step is a plain step."""

    name = "baseline"
    taps: tuple[int, ...] = ()

    def begin(self, target: "Target", prompt_ids: Sequence[int], prompt_hidden: mx.array | None) -> None:
        pass

    def wants_round(self, history: Sequence[int]) -> bool:
        return False

    def propose(self, history: Sequence[int], max_draft: int, sampling: "SamplingParams | None") -> Draft:
        return Draft()

    def before_accept(self, hidden: mx.array, accepted: mx.array, bonus: mx.array) -> None:
        pass

    def observe(self, n_proposed: int, n_accepted: int, hidden: mx.array | None) -> None:
        pass

    def stats(self) -> dict:
        """Mode-specific counters for the result (for example lookup hits)."""
        return {}
