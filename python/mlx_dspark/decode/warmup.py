"""A process's first speculative rounds, paid when a generation starts rather than in its decode.

On a GPU the decode forward is a compiled graph (models/compiled_decode.py), traced once per
width bucket, taps and KV capacity; a process's first round at a width also loads that trace's
kernels, and its very first round runs the acceptor's ops for the first time. On an H100 (the
demo in bf16, auto-h200.md, 22nd session) a fresh process's first lookup round took 65-90 ms and
each later new width 15-20 ms, against ~4 ms for the same round again: 10-30% of the decode of a
192-token answer, where plain decoding pays none of it.

`warm_rounds` runs, once per process for each set of taps, a scratch generation whose scripted
proposer verifies one round at every bucket width the loop may use (up to its cap), greedy, over
the first tokens of the prompt; for a drafter whose pass is compiled, another that drafts until
that pass is traced (a fresh process's first compiled pass cost ~160 ms on an H100). Both run
the loop's own code (plan, draft, forward, accept, trim), so whatever a first round pays is paid
there, before the decode starts; the answer's generation then starts on a fresh cache and
proposer, so nothing of the scratch ones reaches it. Greedy, so no random state moves. Only where
the forward is compiled: elsewhere a new width costs no trace.
"""

from __future__ import annotations

import time
import weakref
from typing import Sequence

import mlx.core as mx

from .proposers import Draft, Proposer

PROMPT_TOKENS = 8  # the scratch prompt: this many of the real prompt's tokens
# What this process warmed, per target and drafter object: (taps, widths) and "pass"
_warm: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _first(obj, key) -> bool:
    """Is `key` new for `obj` (then marked done)?"""
    done = _warm.setdefault(obj, set())
    if key in done:
        return False
    done.add(key)
    return True


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


def warm_rounds(target, proposer: Proposer, prompt: Sequence[int], max_draft: int, sampling=None) -> float:
    """Run the scratch rounds for `proposer` (drafting under `sampling`) this process has not run
    yet; the seconds they took (0.0 when there was nothing to do)."""
    from .loop import _drafts

    if not _drafts(proposer) or not prompt:
        return 0.0
    t = time.perf_counter()
    ran = _warm_widths(target, proposer, prompt, max_draft)
    ran = _warm_drafter(target, proposer, prompt, sampling) or ran
    if not ran:
        return 0.0
    mx.synchronize()
    return time.perf_counter() - t


def _warm_widths(target, proposer: Proposer, prompt: Sequence[int], max_draft: int) -> bool:
    from .loop import Generation

    widths = round_widths(target, max_draft)
    if not widths or not _first(target, (tuple(proposer.taps), tuple(widths))):
        return False
    script = _Script([w - 1 for w in widths], proposer.taps)
    g = Generation(
        target, list(prompt[:PROMPT_TOKENS]), script, max_new_tokens=sum(widths) + 2, max_draft=max(widths) - 1
    )
    g.step()  # the prefill
    while script.sizes and g.speculate and not g.done:
        g.step()
    return True


def _warm_drafter(target, proposer: Proposer, prompt: Sequence[int], sampling) -> bool:
    """A block drafter whose greedy pass is compiled (models/compiled_draft.py), drafting greedy
    (sampled drafts never take that pass: nothing to trace for them): a scratch generation of its
    own (a fresh proposer of the same drafter, the full block every round, no lookup) drafts
    until the drafter's pass has been traced, its op-by-op passes and ingest run first
    (EAGER_PASSES): a fresh process's first compiled pass cost ~160 ms on an H100, inside the
    decode."""
    from ..models import compiled_draft
    from .drafting import _lazy_argmax
    from .loop import Generation

    drafter = getattr(proposer, "drafter", None)
    if drafter is None or not _lazy_argmax(sampling):
        return False
    compiled = compiled_draft.for_drafter(drafter)
    if compiled is None or compiled.traces or not _first(drafter, "pass"):
        return False
    scratch = type(proposer)(drafter, lookup_drafts=False)
    rounds = compiled_draft.EAGER_PASSES + 1
    block = proposer.block_drafts
    g = Generation(
        target, list(prompt[:PROMPT_TOKENS]), scratch, max_new_tokens=(rounds + 1) * (block + 1) + 2, max_draft=block
    )
    g.step()
    while scratch.counters["drafter_rounds"] < rounds and g.speculate and not g.done:
        g.step()
    return True


__all__ = ["round_widths", "warm_rounds"]
