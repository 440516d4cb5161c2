"""THE verify loop. One round = propose -> verify -> accept -> commit/rollback.

Every mode runs through one `Generation` (stepped by generate(), stream_generate(), the server and
`run()`): baseline is a Proposer that never drafts, lookup, DSpark and DFlash are Proposers that
do. Two kinds of round exist:

  plain step  the pending token is fed alone; its successor is sampled lazily and the next step
              is enqueued before the pending token is read back (pipelined, like mlx-lm's
              generate_step). Taken whenever the proposer does not want a round.
  spec round  the anchor (last committed token) plus k drafted tokens are verified in one
              forward; the acceptor returns how many drafts survive and the next token; the
              target cache is trimmed back to the accept point.

Invariant: the last committed token is never in the target cache; the next forward feeds it.
A plain step's output token is "pending": computed lazily, committed when read back.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import mlx.core as mx

from .. import kernels
from ..compat import note_decoding_thread
from ..kernels import cpu_attention, split_prefill
from ..models.target import Target
from .accept import make_acceptor
from .proposers import Draft, Proposer
from .sampling import SamplingParams

PREFILL_CHUNK = 2048


@dataclass
class LoopResult:
    tokens: list[int] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per decode forward
    drafted: list[int] = field(default_factory=list)  # tokens proposed per decode forward
    finish_reason: str = "length"  # "stop" (EOS or stop string), "length", "cancelled"
    prefill_s: float = 0.0
    decode_s: float = 0.0
    warm_up_s: float = 0.0  # the process's first rounds, run before the prefill (decode/warmup.py)
    prompt_tokens: int = 0
    logprobs: list[dict] | None = None
    proposer_stats: dict = field(default_factory=dict)
    # Why drafting stopped (the target's cache could not be rolled back), and after how many
    # tokens; None while speculation ran (or was never asked for).
    speculation_off: str | None = None
    speculation_off_at: int | None = None


_warned: set[str] = set()


def _drafts(proposer: Proposer) -> bool:
    return type(proposer).propose is not Proposer.propose


def _switch_off(res: LoopResult, target: Target, cache: list) -> None:
    """Speculation cannot run on this cache: say so once per process and reason, record it."""
    kinds = ", ".join(sorted({type(c).__name__ for c in cache}))
    res.speculation_off = (
        f"{target.model_type}: its cache ({kinds}) cannot be rolled back here, so this generation decodes plainly"
    )
    res.speculation_off_at = len(res.tokens)
    if res.speculation_off not in _warned:
        _warned.add(res.speculation_off)
        print(f"mlx-dspark: warning: {res.speculation_off}", file=sys.stderr)


# on_tokens(new_token_ids) -> "stop" | "cancel" | None. Called once per commit, in order.
TokenCallback = Callable[[list[int]], "str | None"]


def _prefill(
    target: Target,
    cache: list,
    prompt: Sequence[int],
    taps: Sequence[int],
    should_cancel: Callable[[], bool] | None = None,
    progress: Callable[[int], None] | None = None,
):
    """Feed the prompt; return the last row of logits and the tapped rows of every position,
    or (None, None) when `should_cancel` said so between chunks. `progress(n)` hears how many
    of the prompt's tokens are in after each chunk.

    As mlx-lm's generate_step does, all but the last token go through in chunks and the last
    token goes through alone, so the first generated token comes from the same arithmetic as
    in plain mlx-lm decoding (in bf16 on a GPU, a different split can flip a near-tie).

    Where kernels/split_prefill.py serves the target (the CPU in float32, plain KV caches), a
    chunk's rows do not depend on where it starts or ends: a prefill resumed at any position (a
    prefix-cache hit, serve/prefix_cache.py) gives bitwise the KV of a cold one. Elsewhere the
    chunks end at absolute positions that are multiples of PREFILL_CHUNK (counted from the
    cache's start, not from where this call starts), so a prefill that resumes at such a
    multiple computes every later position in the same chunk, over the same keys, as a cold
    prefill of the whole prompt: bitwise the same KV and logits, whatever the BLAS or the
    attention op does with the chunk's row count."""
    ids = mx.array(list(prompt), dtype=mx.int32)
    hidden_parts = []
    n = len(prompt)
    base = next((c.offset for c in cache if isinstance(getattr(c, "offset", None), int)), 0)
    start = 0
    split = split_prefill.supported(target, cache) is None
    while start < n - 1:
        end = min((base + start) // PREFILL_CHUNK * PREFILL_CHUNK + PREFILL_CHUNK - base, n - 1)
        out = prefill_chunk(target, cache, ids[start:end][None], taps, split)
        if out.hidden is not None:
            hidden_parts.append(out.hidden[0])
        mx.eval([c.state for c in cache] + ([out.hidden] if out.hidden is not None else []))
        start = end
        if progress is not None:
            progress(end)
        if should_cancel is not None and should_cancel():
            return None, None
    out = target.forward(ids[n - 1 :][None], cache, taps=taps, last_only=True)
    if out.hidden is not None:
        hidden_parts.append(out.hidden[0])
    hidden = mx.concatenate(hidden_parts, axis=0) if hidden_parts else None
    return out.logits[0, -1], hidden


def prefill_chunk(target: Target, cache: list, chunk: mx.array, taps: Sequence[int], split: bool | None = None):
    """One prefill chunk [1, w] through the target (ForwardOut, logits of its last row only):
    split-invariant where kernels/split_prefill.py serves the target and its cache (`split`
    None: decide here), else with the dense wide GEMM and the blocked CPU attention."""
    if split is None:
        split = split_prefill.supported(target, cache) is None
    ctx = split_prefill.context(target) if split else kernels.prefill_context(target, chunk.shape[1])
    with ctx, cpu_attention.active():
        return target.forward(chunk, cache, taps=taps, last_only=True)


@dataclass
class Commit:
    """What one step committed: token ids and, when the generation decodes text, their text."""

    tokens: list[int]
    text: str = ""


@dataclass
class Feed:
    """What a step feeds the target: `tokens` [width] (int32; a plain step's pending token is
    still lazy) over the generation's cache, with `taps`; `finish(out)` takes that forward's
    ForwardOut (logits [1, width, V], hidden [1, width, T] or None) and returns the Commit."""

    tokens: mx.array
    width: int
    taps: tuple
    finish: Callable


@dataclass
class CacheState:
    """A finished generation's target cache and what it holds, handed to a prefix cache:
    `tokens` are exactly the positions in `cache` (its mlx-lm layer caches, no longer used by the
    generation), `hidden` their tapped rows for `taps` (None where none were kept)."""

    tokens: list[int]
    cache: list
    taps: tuple[int, ...] = ()
    hidden: mx.array | None = None
    checkpoint: tuple[int, list] | None = None  # (prompt length, Target.snapshot at the prompt's end)
    # Leading positions that went through _prefill's chunks (the prompt but its last token); the
    # prefix cache keeps the whole chunks of its grid among them.
    prefilled: int = 0


class Generation:
    """One generation you can step. It owns the target cache, the proposer's state, the
    acceptor (and its RNG), the history and, when given a text stream, the detokenizer and the
    stop strings. `step()` runs prefill first, then one round or one pipelined plain step, and
    returns what it committed; text is derived from each commit, so no committed token can miss
    the text. Cancelling is not stepping again (or `cancel()`, which records it).

    `reuse=(n, hidden)`: the first `n` prompt positions are already in `cache` (a prefix-cache
    hit; `hidden` their tapped rows when the proposer taps), so prefill feeds the rest only.
    `keep_state=True` keeps what `snapshot()` needs to hand the cache to a prefix cache;
    `checkpoint_prompt=True` also snapshots the cache at the prompt's end (checkpoint mode).
    `on_prefill(done, total)` hears the prefill's progress after each chunk."""

    def __init__(
        self,
        target: Target,
        prompt: Sequence[int],
        proposer: Proposer | None = None,
        *,
        max_new_tokens: int = 256,
        max_draft: int = 16,
        sampling: SamplingParams | None = None,
        stop_token_ids: Sequence[int] = (),
        cache: list | None = None,
        should_cancel: Callable[[], bool] | None = None,
        text=None,
        reuse: tuple[int, mx.array | None] | None = None,
        keep_state: bool = False,
        on_prefill: Callable[[int, int], None] | None = None,
        checkpoint_prompt: bool = False,
    ):
        note_decoding_thread()  # a clean exit after decoding in a thread: compat.py says why
        self.target, self.prompt = target, list(prompt)
        self.proposer = proposer or Proposer()
        self.sampling = sampling or SamplingParams()
        self.acceptor = make_acceptor(self.sampling)
        if hasattr(self.acceptor, "begin"):
            self.acceptor.begin(self.prompt)  # penalties count generated tokens only
        self.max_new_tokens, self.max_draft = int(max_new_tokens), int(max_draft)
        self.stops = set(int(t) for t in stop_token_ids)
        self.should_cancel, self.text = should_cancel, text
        self.res = LoopResult(prompt_tokens=len(self.prompt))
        if self.sampling.logprobs:
            self.res.logprobs = []
        self.history = list(self.prompt)
        self.cache = cache if cache is not None else target.make_cache()
        self.taps = tuple(self.proposer.taps)
        self.speculate = _drafts(self.proposer)
        if self.speculate and not target.can_trim(self.cache, 1):
            _switch_off(self.res, target, self.cache)  # no drafts and no taps from the start
            self.speculate, self.taps = False, ()
        self.reuse = reuse
        self.keep_state = keep_state
        self.checkpoint_prompt, self.checkpoint = checkpoint_prompt and keep_state, None
        self.on_prefill = on_prefill  # (prompt tokens in the cache so far, prompt length)
        self.fed: list[int] = []  # the tokens in the target cache, in order (with keep_state)
        self.fed_hidden: list[mx.array] = []  # their tapped rows, in chunks (with keep_state)
        self.kept_taps = self.taps
        self.pending: mx.array | None = None
        self.pending_row: mx.array | None = None
        self.pending_is_round = False
        self._read_at = 0.0  # when the pending token was last read back (a round is timed from there)
        self.prefilled = False
        self.done = False
        self.solo = False  # inside step(): a round's proposer may draft ahead (not in a batch)
        self._may_draft_ahead = type(self.proposer).before_accept is not Proposer.before_accept

    # ------------------------------------------------------------------ driving
    def __iter__(self):
        while not self.done:
            yield self.step()

    def step(self) -> Commit:
        """Prefill (the first call), then one round or one plain step. Returns what it committed."""
        if self.done:
            return Commit([])
        if not self.prefilled:
            return self._prefill()
        t = self._read_at = time.perf_counter()
        try:
            feed = self.plan()
            if isinstance(feed, Commit):
                return feed
            self.solo = True
            commit = feed.finish(self.target.forward(feed.tokens.reshape(1, -1), self.cache, taps=feed.taps))
            policy = getattr(self.proposer, "policy", None)
            if policy is not None and policy.adaptive and (feed.width > 1 or feed.finish == self._finish_plain):
                # the cost model's live correction: rounds, timed from the read-back of the token
                # before them (waiting for the plain step in flight is that step's cost, which the
                # pipelined steps measure), and pipelined plain steps (a synchronous one follows a
                # round and is its cost, not plain decoding's)
                policy.timed(feed.width, time.perf_counter() - (self._read_at if feed.width > 1 else t))
            return commit
        finally:
            self.solo = False
            self.res.decode_s += time.perf_counter() - t

    def cancel(self) -> None:
        """End now; what was committed stays committed."""
        if not self.done:
            self.res.finish_reason = "cancelled"
            self._finish()

    def run(self) -> LoopResult:
        for _ in self:
            pass
        return self.res

    # ------------------------------------------------------------------ state
    def snapshot(self) -> CacheState | None:
        """The target cache and the tokens it holds, once done (needs keep_state); else None."""
        if not self.keep_state or not self.prefilled or not self.done:
            return None
        hidden = None
        if self.kept_taps and self.fed_hidden:
            hidden = mx.concatenate(self.fed_hidden, axis=0)
            if hidden.shape[0] != len(self.fed):
                hidden = None
        return CacheState(
            tokens=list(self.fed),
            cache=self.cache,
            taps=self.kept_taps if hidden is not None else (),
            hidden=hidden,
            checkpoint=self.checkpoint,
            prefilled=max(len(self.prompt) - 1, 0),
        )

    def _fed(self, tokens: list[int], hidden: mx.array | None) -> None:
        if not self.keep_state:
            return
        self.fed.extend(tokens)
        if self.kept_taps and hidden is not None:
            self.fed_hidden.append(hidden)
        elif self.kept_taps:
            self.kept_taps, self.fed_hidden = (), []  # taps stopped: keep no partial rows

    def _trim(self, n: int) -> None:
        if n <= 0:
            return
        self.target.trim(self.cache, n)
        if not self.keep_state:
            return
        del self.fed[-n:]
        while n and self.fed_hidden:
            last = self.fed_hidden[-1]
            if last.shape[0] <= n:
                n -= last.shape[0]
                self.fed_hidden.pop()
            else:
                self.fed_hidden[-1] = last[: last.shape[0] - n]
                n = 0

    # ------------------------------------------------------------------ steps
    def _prefill(self) -> Commit:
        t0 = time.perf_counter()
        self.prefilled = True
        n_reused, reused_hidden = self.reuse or (0, None)
        if n_reused:
            self.fed = list(self.prompt[:n_reused]) if self.keep_state else []
            if self.keep_state and self.kept_taps and reused_hidden is not None:
                self.fed_hidden = [reused_hidden]
        total = len(self.prompt)
        report = None if self.on_prefill is None else (lambda n: self.on_prefill(n_reused + n, total))
        if report is not None and n_reused:
            report(0)
        logits, hidden = _prefill(
            self.target, self.cache, self.prompt[n_reused:], self.taps, self.should_cancel, report
        )
        if logits is None:
            self.res.prefill_s = time.perf_counter() - t0
            self.res.finish_reason = "cancelled"
            self._finish()
            return Commit([])
        self._fed(self.prompt[n_reused:], hidden)
        if self.checkpoint_prompt:  # the cache holds exactly the prompt here
            self.checkpoint = (len(self.prompt), self.target.snapshot(self.cache))
        if n_reused and hidden is not None:
            hidden = mx.concatenate([reused_hidden, hidden], axis=0) if reused_hidden is not None else None
        self.pending = self.acceptor.sample(logits, self.history)
        self.pending_row = logits[None] if self.sampling.logprobs else None
        mx.async_eval(self.pending)
        if self.speculate:
            self.proposer.begin(self.target, self.prompt, hidden)
        mx.eval(self.pending)
        self.res.prefill_s = time.perf_counter() - t0
        if self.max_new_tokens <= 0:
            self.res.finish_reason = "length"
            self._finish()
        return Commit([])

    def plan(self) -> "Feed | Commit":
        """The next step up to its target forward: a Feed (the tokens to feed over `self.cache`,
        and `finish(out)`, which completes the step from that forward), or a Commit when the
        step ended without one (the pending token ended the generation). `step()` runs the Feed
        alone; decode/batch.py runs the Feeds of several generations in one forward. Only for a
        prefilled generation that is not done."""
        got = self.plan_begin()
        if isinstance(got, int):
            return self.plan_draft(self.proposer.propose(self.history, got, self.sampling))
        return got

    def plan_begin(self, drafts: bool = True) -> "Feed | Commit | int":
        """plan() up to the proposer: a Feed or a Commit as plan() returns them, or the number of
        tokens to draft; then plan_draft(proposer.propose(history, k, sampling)) gives the Feed
        (decode/batch.py asks several proposers at once in between). `drafts` False: a plain
        step, the proposer not asked (decode/batch.py's DraftGate)."""
        target, cache, acceptor = self.target, self.cache, self.acceptor
        remaining = self.max_new_tokens - len(self.res.tokens)
        plain = (
            self.pending is not None
            and acceptor.lazy_ok
            and remaining > 1
            and not (drafts and self.speculate and self.proposer.wants_round(self.history))
        )
        if plain:
            # Pipelined plain step: the forward of the pending token is enqueued before it is read back.
            return Feed(self.pending.reshape(1), 1, self.taps, self._finish_plain)

        first = Commit([])
        if self.pending is not None:
            tok = int(self.pending.item())
            self._read_at = time.perf_counter()
            self.pending = None
            first = self._commit([tok], self.pending_row, 0, self.pending_is_round)
            if self.done:
                return first
        self._first = first
        k = min(self.max_draft, self.max_new_tokens - len(self.res.tokens) - 1)
        if k > 0 and self.speculate and not target.can_trim(cache, k):
            _switch_off(self.res, target, cache)  # e.g. a sliding window that has filled up
            self.speculate, self.taps = False, ()
        if k > 0 and self.speculate and drafts:
            self._k = k
            return k
        return self.plan_draft(Draft())

    def plan_draft(self, draft: Draft) -> Feed:
        """The Feed of plan_begin()'s step with the proposer's draft (an empty one: a plain step)."""
        first, self._first = self._first, Commit([])
        anchor = self.history[-1]
        if draft.device is not None:
            if draft.size > self._k:
                draft.device = draft.device[: self._k]
        elif draft.tokens:
            draft.tokens = [int(t) for t in draft.tokens[: self._k]]
            if draft.q is not None:
                draft.q = draft.q[: len(draft.tokens)]
        if not draft.size:
            # Synchronous plain step (the proposer declined after all).
            return Feed(
                mx.array([anchor], dtype=mx.int32), 1, self.taps, lambda out: self._finish_sync(out, anchor, first)
            )
        if draft.device is not None:  # the drafter's tokens go in as they are, unread
            block = mx.concatenate([mx.array([anchor], dtype=mx.int32), draft.device])
        else:
            block = mx.array([anchor] + draft.tokens, dtype=mx.int32)
        return Feed(
            block,
            1 + draft.size,
            self.taps,
            lambda out: self._finish_round(out, anchor, draft, first),
        )

    def _finish_plain(self, out) -> Commit:
        target, cache, taps = self.target, self.cache, self.taps
        nxt = self.acceptor.sample(out.logits[0, -1], self.history)
        mx.async_eval(nxt)
        tok = int(self.pending.item())
        self._fed([tok], out.hidden[0] if taps else None)
        commit = self._commit([tok], self.pending_row, 0, self.pending_is_round)
        if self.done:
            if target.can_trim(cache, 1):
                self._trim(1)  # the pending token's forward was not needed
            return commit
        if taps:
            self.proposer.observe(0, 0, out.hidden[0])
        self.pending, self.pending_is_round = nxt, True
        self.pending_row = out.logits[0, -1:] if self.sampling.logprobs else None
        return commit

    def _finish_sync(self, out, anchor: int, first: Commit) -> Commit:
        taps = self.taps
        self._fed([anchor], out.hidden[0] if taps else None)
        if taps:
            self.proposer.observe(0, 0, out.hidden[0])
        self.pending = self.acceptor.sample(out.logits[0, -1], self.history)
        # Start the forward now: the next step (pipelined) builds its own forward while this one
        # runs, instead of enqueueing both at once after building (a GPU idled through that build).
        mx.async_eval(self.pending)
        self.pending_row = out.logits[0, -1:] if self.sampling.logprobs else None
        self.pending_is_round = True
        return first

    def _finish_round(self, out, anchor: int, draft: Draft, first: Commit) -> Commit:
        taps, k = self.taps, draft.size
        lazy = None
        enqueue = getattr(self.acceptor, "enqueue", None)
        room = self.max_new_tokens - len(self.res.tokens)  # a round after this one needs 3 or more
        if self._may_draft_ahead and self.solo and taps and enqueue is not None and room > 2:
            # the accept point, lazy: the proposer may draft the next block on it before it is read
            lazy = enqueue(out.logits[0], draft)
            self.proposer.before_accept(out.hidden[0], *lazy)
        if lazy is None:
            n_acc, nxt_tok = self.acceptor.verify(out.logits[0], draft, self.history)  # reads the draft back
        else:
            n_acc, nxt_tok = self.acceptor.verify(out.logits[0], draft, self.history, lazy)
        self._fed([anchor] + draft.tokens, out.hidden[0] if taps else None)
        self._trim(k - n_acc)
        self.proposer.observe(k, n_acc, out.hidden[0, : n_acc + 1] if taps else None)
        commit = self._commit(draft.tokens[:n_acc] + [nxt_tok], out.logits[0, : n_acc + 1], k, True)
        return Commit(first.tokens + commit.tokens, first.text + commit.text)

    def _commit(self, tokens: list[int], rows: mx.array | None, drafted: int, is_round: bool) -> Commit:
        """Append tokens (cut at a stop token and at max_new_tokens), derive their text, and end
        the generation where a stop token, a stop string or the length says so."""
        res = self.res
        cut = len(tokens)
        for i, t in enumerate(tokens):
            if t in self.stops:
                cut = i
                res.finish_reason = "stop"
                break
        cut = min(cut, self.max_new_tokens - len(res.tokens))
        kept = tokens[:cut]
        if is_round:
            # A stop token accepted at index e ends the round with e+1 tokens and no bonus.
            res.accept_lengths.append(min(len(tokens), cut + (1 if res.finish_reason == "stop" else 0)))
            res.drafted.append(drafted)
        if res.logprobs is not None and kept and rows is not None:
            res.logprobs.extend(self.acceptor.token_logprobs(rows[: len(kept)], kept, self.history))
        res.tokens.extend(kept)
        self.history.extend(kept)
        before = self.text.emitted if self.text is not None else 0
        if self.text is not None and kept and self.text.add(kept):
            res.finish_reason = "stop"  # a stop string
        if res.finish_reason == "stop":
            self._finish()
        elif len(res.tokens) >= self.max_new_tokens:
            res.finish_reason = "length"
            self._finish()
        text = self.text.text[before : self.text.emitted] if self.text is not None else ""
        return Commit(kept, text)

    def _finish(self) -> None:
        """The end: the text's held-back tail (a possible stop-string start, a split character)
        is released, and the proposer's counters are read."""
        self.done = True
        if self.text is not None:
            self.text.finish()
        self.res.proposer_stats = self.proposer.stats()


def run(
    target: Target,
    prompt: Sequence[int],
    proposer: Proposer | None = None,
    *,
    max_new_tokens: int = 256,
    max_draft: int = 16,
    sampling: SamplingParams | None = None,
    stop_token_ids: Sequence[int] = (),
    on_tokens: TokenCallback | None = None,
    cache: list | None = None,
    should_cancel: Callable[[], bool] | None = None,
) -> LoopResult:
    """Generate up to `max_new_tokens` after `prompt` (token ids): a Generation stepped to the
    end. Output is exactly what plain decoding of `target` gives (greedy), or an exact sample of
    it (T > 0). `on_tokens(new_ids)` may answer "stop" or "cancel" to end it."""
    g = Generation(
        target,
        prompt,
        proposer,
        max_new_tokens=max_new_tokens,
        max_draft=max_draft,
        sampling=sampling,
        stop_token_ids=stop_token_ids,
        cache=cache,
        should_cancel=should_cancel,
    )
    for commit in g:
        if commit.tokens and on_tokens is not None and not g.done:
            verdict = on_tokens(commit.tokens)
            if verdict == "cancel":
                g.cancel()
            elif verdict:
                g.res.finish_reason = "stop"
                g._finish()
        elif commit.tokens and on_tokens is not None:
            on_tokens(commit.tokens)
    return g.res
