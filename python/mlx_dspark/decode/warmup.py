"""A process's first speculative rounds, paid when a generation starts rather than in its decode.

On a GPU the decode forward is a compiled graph (models/compiled_decode.py), traced once per
width bucket, taps and KV capacity; a process's first round at a width also loads that trace's
kernels, and its very first round runs the acceptor's ops for the first time. On an H100 (the
demo in bf16, auto-h200.md, 22nd session) a fresh process's first lookup round took 65-90 ms and
each later new width 15-20 ms, against ~4 ms for the same round again: 10-30% of the decode of a
192-token answer, where plain decoding pays none of it.

`warm_rounds` runs, once per process for each set of taps, a scratch generation whose scripted
proposer verifies one round at every bucket width the loop may use (up to its cap), greedy, over
the first tokens of the prompt. That runs the loop's own code (plan, forward, accept, trim), so
whatever a first round pays is paid there, before the decode starts; the answer's generation then
starts on a fresh cache and proposer, so nothing of the scratch one reaches it. Greedy, so no
random state moves. Only where the forward is compiled: elsewhere a new width costs no trace.
"""

from __future__ import annotations

import time
from typing import Sequence

import mlx.core as mx

from .proposers import Draft, Proposer

PROMPT_TOKENS = 8  # the scratch prompt: this many of the real prompt's tokens
_warm: set[tuple] = set()  # (target id, taps, widths) warmed in this process


class _Script(Proposer):
    """Drafts one round of each given size, then nothing."""

    name = "warm-up"

    def __init__(self, sizes: Sequence[int], taps: tuple[int, ...]):
        self.sizes = list(sizes)
        self.taps = tuple(taps)

    def wants_round(self, history: Sequence[int]) -> bool:
        return bool(self.sizes)

    def propose(self, history: Sequence[int], max_draft: int, sampling) -> Draft:
        if not self.sizes:
            return Draft()
        k = min(self.sizes.pop(0), max_draft)
        return Draft(tokens=[int(history[-1])] * k)


def round_widths(target, max_draft: int) -> list[int]:
    """The bucket widths (anchor + drafts) a round of at most `max_draft` drafts may run at on
    `target`; [] where the forward is not compiled (nothing to warm)."""
    compiled = getattr(target, "compiled_decode", None)
    if compiled is None or max_draft < 1:
        return []
    from ..models.compiled_decode import bucket, buckets

    top = bucket(max_draft + 1)
    return [b for b in buckets() if 2 <= b < top] + [top]


def warm_rounds(target, proposer: Proposer, prompt: Sequence[int], max_draft: int) -> float:
    """Run the scratch rounds for `proposer`'s taps if this process has not yet; the seconds it
    took (0.0 when there was nothing to do)."""
    from .loop import Generation, _drafts

    if not _drafts(proposer) or not prompt:
        return 0.0
    widths = round_widths(target, max_draft)
    key = (id(target), tuple(proposer.taps), tuple(widths))
    if not widths or key in _warm:
        return 0.0
    _warm.add(key)
    t = time.perf_counter()
    script = _Script([w - 1 for w in widths], proposer.taps)
    g = Generation(
        target,
        list(prompt[:PROMPT_TOKENS]),
        script,
        max_new_tokens=sum(widths) + 2,
        max_draft=max(widths) - 1,
    )
    g.step()  # the prefill
    while script.sizes and g.speculate and not g.done:
        g.step()
    mx.synchronize()
    return time.perf_counter() - t


__all__ = ["round_widths", "warm_rounds"]
