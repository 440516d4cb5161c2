"""Lookup: drafter-free n-gram speculation.

The recent suffix of prompt + output is matched against earlier context; the tokens that
followed the match are proposed and verified like any draft.

  * Index: every n-gram (MIN_N..MAX_N) maps to the end positions where it occurred, updated
    incrementally as tokens are committed, so a lookup is a few dict probes.
  * Match depth: how far back the match keeps agreeing with the suffix (up to 4 * LONG_DEPTH).
  * Whether a match is worth a round, and how long a draft it earns, is decided by the draft
    policy (decode/policy.py): the fixed rules (short/long drafts, a success-rate gate for short
    matches, parking after fruitless rounds) or, with `--max-draft auto`, the measured cost model.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from .policy import LONG_DEPTH, SHORT_DRAFT, DraftPolicy, FixedPolicy
from .proposers import Draft, Proposer

MIN_N, MAX_N = 2, 4


class NgramIndex:
    def __init__(self):
        self.tokens: list[int] = []
        self.ends: dict[tuple, list[int]] = defaultdict(list)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens)
            for n in range(MIN_N, MAX_N + 1):
                if end >= n:
                    self.ends[tuple(self.tokens[end - n : end])].append(end)

    def sync(self, history: Sequence[int]) -> None:
        if len(history) > len(self.tokens):
            self.extend(history[len(self.tokens) :])

    def match(self, history: Sequence[int]) -> tuple[int, int]:
        """(start of the continuation, match depth) of the best earlier match, or (-1, 0)."""
        n_hist = len(history)
        for n in range(MAX_N, MIN_N - 1, -1):
            if n_hist < n:
                continue
            ends = self.ends.get(tuple(history[n_hist - n :]))
            if not ends:
                continue
            # The most recent occurrence that ends before the suffix itself.
            for end in reversed(ends):
                if end < n_hist:
                    depth = n
                    while (
                        depth < end
                        and depth < 4 * LONG_DEPTH
                        and self.tokens[end - depth - 1] == history[n_hist - depth - 1]
                    ):
                        depth += 1
                    return end, depth
        return -1, 0


class LookupProposer(Proposer):
    name = "lookup"

    def __init__(self, long_draft: int = 32, short_draft: int = SHORT_DRAFT, policy: DraftPolicy | None = None):
        self.long_draft = long_draft
        self.short_draft = short_draft
        self._policy = policy
        self.policy = policy or FixedPolicy(short_draft=short_draft, long_draft=long_draft)
        self.index = NgramIndex()
        self._depth = 0
        self.hits = self.proposed = self.accepted = 0

    def use_policy(self, policy: DraftPolicy) -> None:
        """Decide draft lengths with `policy` (decode/policy.py) from now on."""
        self._policy = self.policy = policy

    def begin(self, target, prompt_ids, prompt_hidden) -> None:
        self.index = NgramIndex()
        self.index.extend(prompt_ids)
        if self._policy is None:  # the fixed rules start afresh for each generation
            self.policy = FixedPolicy(short_draft=self.short_draft, long_draft=self.long_draft)

    def _match(self, history: Sequence[int]) -> tuple[int, int]:
        self.index.sync(history)
        return self.index.match(history)

    def wants_round(self, history: Sequence[int]) -> bool:
        if not self.policy.ready("lookup", len(history)):
            return False
        start, depth = self._match(history)
        return start >= 0 and self.policy.worth_trying("lookup", self.long_draft, len(history), depth)

    def propose(self, history: Sequence[int], max_draft: int, sampling) -> Draft:
        n = len(history)
        if not self.policy.ready("lookup", n):
            return Draft()
        start, depth = self._match(history)
        offered = min(max_draft, self.long_draft if depth >= LONG_DEPTH else max(self.short_draft, max_draft))
        if start < 0 or not self.policy.worth_trying("lookup", offered, n, depth):
            return Draft()
        k = self.policy.length("lookup", offered, n, depth)
        self._depth = depth
        # Copy with overlap (as LZ77 does): a match close to the end continues into the draft
        # itself, so a periodic run drafts its period over and over.
        seq = self.index.tokens
        tokens: list[int] = []
        for i in range(k):
            j = start + i
            tokens.append(seq[j] if j < len(seq) else tokens[j - len(seq)])
        if tokens:
            self.hits += 1
        return Draft(tokens=list(tokens))

    def observe(self, n_proposed: int, n_accepted: int, hidden) -> None:
        if n_proposed == 0:
            return
        self.proposed += n_proposed
        self.accepted += n_accepted
        self.policy.result("lookup", n_proposed, n_accepted, len(self.index.tokens), self._depth)

    def stats(self) -> dict:
        return {
            "lookup_hits": self.hits,
            "lookup_proposed": self.proposed,
            "lookup_accepted": self.accepted,
            **self.policy.stats(),
        }
