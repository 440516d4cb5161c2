"""Lookup: drafter-free n-gram speculation.

The recent suffix of prompt + output is matched against earlier context; the tokens that
followed the match are proposed and verified like any draft.

  * Index: every n-gram (MIN_N..MAX_N) maps to the end positions where it occurred, updated
    incrementally as tokens are committed, so a lookup is a few dict probes.
  * Match depth: how far back the match keeps agreeing with the suffix. A match at least
    LONG_DEPTH deep earns a draft of up to ~2x its depth (capped by `long_draft`): verbatim
    copies commit tens of tokens per forward.
  * Acceptance gate: a draft whose first token is rejected costs a synced, wider forward for
    nothing (on a GPU a synced round also loses the pipelining of plain steps). So
      - short matches (depth < LONG_DEPTH: common phrases in prose) are tried only while they
        pay: a running rate of short rounds that commit at least one draft; below
        SHORT_MIN_RATE they are skipped, with one probe every SHORT_PROBE_EVERY tokens so the
        rate can recover;
      - after `PARK_AFTER` fruitless rounds in a row the proposer parks for a while (doubling up
        to `PARK_MAX` tokens), so the loop takes pipelined plain steps;
      - long drafts that keep failing are cut back to the short length until one succeeds again.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from .proposers import Draft, Proposer

MIN_N, MAX_N = 2, 4
SHORT_DRAFT = 8
LONG_DEPTH = 8
PARK_AFTER = 3
PARK_MIN, PARK_MAX = 8, 256
SHORT_MIN_RATE = 0.5
SHORT_PROBE_EVERY = 32


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
            self.extend(history[len(self.tokens):])

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
                    while (depth < end and depth < 4 * LONG_DEPTH
                           and self.tokens[end - depth - 1] == history[n_hist - depth - 1]):
                        depth += 1
                    return end, depth
        return -1, 0


class LookupProposer(Proposer):
    name = "lookup"

    def __init__(self, long_draft: int = 32, short_draft: int = SHORT_DRAFT):
        self.long_draft = long_draft
        self.short_draft = short_draft
        self.index = NgramIndex()
        self.parked_until = 0
        self.park_len = PARK_MIN
        self.misses = 0
        self.long_ok = True
        self._last_long = False
        self._last_short = False
        self.short_rate = 1.0
        self.next_short_probe = 0
        self.hits = self.proposed = self.accepted = 0

    def begin(self, target, prompt_ids, prompt_hidden) -> None:
        self.index = NgramIndex()
        self.index.extend(prompt_ids)
        self.parked_until = 0
        self.park_len = PARK_MIN
        self.misses = 0
        self.short_rate = 1.0
        self.next_short_probe = 0

    def _worth_trying(self, depth: int, n_hist: int) -> bool:
        if depth >= LONG_DEPTH or self.short_rate >= SHORT_MIN_RATE:
            return True
        return n_hist >= self.next_short_probe

    def wants_round(self, history: Sequence[int]) -> bool:
        if len(history) < self.parked_until:
            return False
        self.index.sync(history)
        start, depth = self.index.match(history)
        return start >= 0 and self._worth_trying(depth, len(history))

    def propose(self, history: Sequence[int], max_draft: int, sampling) -> Draft:
        if len(history) < self.parked_until:
            return Draft()
        self.index.sync(history)
        start, depth = self.index.match(history)
        if start < 0 or not self._worth_trying(depth, len(history)):
            return Draft()
        k = self.short_draft
        self._last_long = False
        self._last_short = depth < LONG_DEPTH
        if depth >= LONG_DEPTH and self.long_ok:
            k = max(k, min(self.long_draft, 2 * depth))
            self._last_long = True
        k = min(k, max_draft)
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
        if self._last_short:
            self.short_rate = 0.75 * self.short_rate + 0.25 * (1.0 if n_accepted else 0.0)
            if not n_accepted and self.short_rate < SHORT_MIN_RATE:
                self.next_short_probe = len(self.index.tokens) + SHORT_PROBE_EVERY
        if n_accepted == 0:
            self.misses += 1
            if self.misses >= PARK_AFTER:
                self.parked_until = len(self.index.tokens) + self.park_len
                self.park_len = min(2 * self.park_len, PARK_MAX)
                self.misses = 0
        else:
            self.misses = 0
            self.park_len = max(PARK_MIN, self.park_len // 2)
        if self._last_long:
            # Long drafts must earn their width: cut back after a mostly-rejected one.
            self.long_ok = n_accepted * 2 >= n_proposed
        elif n_accepted == n_proposed:
            self.long_ok = True

    def stats(self) -> dict:
        return {"lookup_hits": self.hits, "lookup_proposed": self.proposed, "lookup_accepted": self.accepted}
