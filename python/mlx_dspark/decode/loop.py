"""THE verify loop. One round = propose -> verify -> accept -> commit/rollback.

Every mode runs through `run()`: baseline is a Proposer that never drafts, lookup, DSpark and
DFlash are Proposers that do. Two kinds of round exist:

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
    res.speculation_off = (f"{target.model_type}: its cache ({kinds}) cannot be rolled back here, "
                           "so this generation decodes plainly")
    res.speculation_off_at = len(res.tokens)
    if res.speculation_off not in _warned:
        _warned.add(res.speculation_off)
        print(f"mlx-dspark: warning: {res.speculation_off}", file=sys.stderr)


# on_tokens(new_token_ids) -> "stop" | "cancel" | None. Called once per commit, in order.
TokenCallback = Callable[[list[int]], "str | None"]


def _prefill(target: Target, cache: list, prompt: Sequence[int], taps: Sequence[int],
             should_cancel: Callable[[], bool] | None = None):
    """Feed the prompt; return the last row of logits and the tapped rows of every position,
    or (None, None) when `should_cancel` said so between chunks.

    As mlx-lm's generate_step does, all but the last token go through in chunks and the last
    token goes through alone, so the first generated token comes from the same arithmetic as
    in plain mlx-lm decoding (in bf16 on a GPU, a different split can flip a near-tie)."""
    ids = mx.array(list(prompt), dtype=mx.int32)
    hidden_parts = []
    n = len(prompt)
    for start in range(0, n - 1, PREFILL_CHUNK):
        chunk = ids[start : min(start + PREFILL_CHUNK, n - 1)][None]
        with kernels.prefill_context(target, chunk.shape[1]):
            out = target.forward(chunk, cache, taps=taps, last_only=True)
        if out.hidden is not None:
            hidden_parts.append(out.hidden[0])
        mx.eval([c.state for c in cache] + ([out.hidden] if out.hidden is not None else []))
        if should_cancel is not None and should_cancel():
            return None, None
    out = target.forward(ids[n - 1 :][None], cache, taps=taps, last_only=True)
    if out.hidden is not None:
        hidden_parts.append(out.hidden[0])
    hidden = mx.concatenate(hidden_parts, axis=0) if hidden_parts else None
    return out.logits[0, -1], hidden


def run(target: Target, prompt: Sequence[int], proposer: Proposer | None = None, *,
        max_new_tokens: int = 256, max_draft: int = 16, sampling: SamplingParams | None = None,
        stop_token_ids: Sequence[int] = (), on_tokens: TokenCallback | None = None,
        cache: list | None = None, should_cancel: Callable[[], bool] | None = None) -> LoopResult:
    """Generate up to `max_new_tokens` after `prompt` (token ids). Output is exactly what plain
    decoding of `target` gives (greedy), or an exact sample of it (T > 0)."""
    proposer = proposer or Proposer()
    sampling = sampling or SamplingParams()
    acceptor = make_acceptor(sampling)
    if hasattr(acceptor, "begin"):
        acceptor.begin(prompt)  # penalties count generated tokens only
    stops = set(int(t) for t in stop_token_ids)
    res = LoopResult(prompt_tokens=len(prompt))
    if sampling.logprobs:
        res.logprobs = []
    history = list(prompt)
    cache = cache if cache is not None else target.make_cache()
    taps = tuple(proposer.taps)
    speculate = _drafts(proposer)
    if speculate and not target.can_trim(cache, 1):
        _switch_off(res, target, cache)  # no drafts and no taps from the start: plain decoding
        speculate, taps = False, ()

    t0 = time.perf_counter()
    logits, prompt_hidden = _prefill(target, cache, prompt, taps, should_cancel)
    if logits is None:
        res.finish_reason = "cancelled"
        res.prefill_s = time.perf_counter() - t0
        return res
    pending = acceptor.sample(logits, history)
    pending_row = logits[None] if sampling.logprobs else None
    pending_is_round = False  # the first token after prefill is not a round
    mx.async_eval(pending)
    if speculate:
        proposer.begin(target, prompt, prompt_hidden)
    mx.eval(pending)
    res.prefill_s = time.perf_counter() - t0
    t1 = time.perf_counter()

    def commit(tokens: list[int], rows: mx.array | None, drafted: int, is_round: bool) -> bool:
        """Append tokens; return True when generation must end."""
        cut = len(tokens)
        for i, t in enumerate(tokens):
            if t in stops:
                cut = i
                res.finish_reason = "stop"
                break
        room = max_new_tokens - len(res.tokens)
        if cut > room:
            cut = room
        kept = tokens[:cut]
        if is_round:
            # A stop token accepted at index e ends the round with e+1 tokens and no bonus.
            res.accept_lengths.append(min(len(tokens), cut + (1 if res.finish_reason == "stop" else 0)))
            res.drafted.append(drafted)
        if res.logprobs is not None and kept and rows is not None:
            res.logprobs.extend(acceptor.token_logprobs(rows[: len(kept)], kept, history))
        res.tokens.extend(kept)
        history.extend(kept)
        # Hand the kept tokens on before anything ends generation: a round that accepts drafts
        # and then a stop token still owes its drafts to the text.
        if kept and on_tokens is not None:
            verdict = on_tokens(kept)
            if verdict:
                res.finish_reason = "cancelled" if verdict == "cancel" else "stop"
                return True
        if res.finish_reason == "stop":
            return True
        if len(res.tokens) >= max_new_tokens:
            res.finish_reason = "length"
            return True
        return False

    done = max_new_tokens <= 0
    if done:
        res.finish_reason = "length"
    while not done:
        remaining = max_new_tokens - len(res.tokens)
        plain = (pending is not None and acceptor.lazy_ok and remaining > 1
                 and not (speculate and proposer.wants_round(history)))
        if plain:
            # Pipelined plain step: enqueue the forward of the pending token, then read it back.
            out = target.forward(pending.reshape(1, 1), cache, taps=taps)
            nxt = acceptor.sample(out.logits[0, -1], history) if acceptor.lazy_ok else None
            if nxt is not None:
                mx.async_eval(nxt)
            tok = int(pending.item())
            if commit([tok], pending_row, 0, pending_is_round):
                if target.can_trim(cache, 1):
                    target.trim(cache, 1)  # the pending token's forward was not needed
                break
            if taps:
                proposer.observe(0, 0, out.hidden[0])
            if nxt is None:
                nxt = acceptor.sample(out.logits[0, -1], history)
            pending, pending_is_round = nxt, True
            pending_row = out.logits[0, -1:] if sampling.logprobs else None
            continue

        if pending is not None:
            tok = int(pending.item())
            if commit([tok], pending_row, 0, pending_is_round):
                break
            pending = None
        anchor = history[-1]
        k = min(max_draft, max_new_tokens - len(res.tokens) - 1)
        draft = Draft()
        if k > 0 and speculate and not target.can_trim(cache, k):
            _switch_off(res, target, cache)  # e.g. a sliding window that has filled up
            speculate, taps = False, ()
        if k > 0 and speculate:
            draft = proposer.propose(history, k, sampling)
            draft.tokens = [int(t) for t in draft.tokens[:k]]
            if draft.q is not None:
                draft.q = draft.q[: len(draft.tokens)]
        if not draft.tokens:
            # Synchronous plain step (the proposer declined after all).
            out = target.forward(mx.array([[anchor]], dtype=mx.int32), cache, taps=taps)
            if taps:
                proposer.observe(0, 0, out.hidden[0])
            pending = acceptor.sample(out.logits[0, -1], history)
            pending_row = out.logits[0, -1:] if sampling.logprobs else None
            pending_is_round = True
            continue

        k = len(draft.tokens)
        out = target.forward(mx.array([[anchor] + draft.tokens], dtype=mx.int32), cache, taps=taps)
        n_acc, nxt_tok = acceptor.verify(out.logits[0], draft, history)
        target.trim(cache, k - n_acc)
        proposer.observe(k, n_acc, out.hidden[0, : n_acc + 1] if taps else None)
        done = commit(draft.tokens[:n_acc] + [nxt_tok], out.logits[0, : n_acc + 1], k, True)

    res.decode_s = time.perf_counter() - t1
    res.proposer_stats = proposer.stats()
    return res
