"""The DSpark / DFlash Proposer: a block drafter behind the Proposer protocol.

Context bookkeeping, as DeepSpec's deepspec/eval/dspark/draft_ops.py keeps it between rounds. The
drafter's context must hold the fused target taps of every committed position before the anchor,
and nothing rejected:
  begin     the prompt rows [N, T] become pending context;
  observe   the verify's kept rows (anchor + accepted drafts; a plain step's fed token) are
            appended to the pending context;
  propose   pending rows are projected into the per-layer context cache as part of the block's
            backbone pass (or ahead of it, in chunks, when many have piled up), so the cache
            always ends exactly at the anchor: offset + pending == anchor position, checked
            every round. Block K/V never enter the cache (crop to the accepted point).

Draft ahead (greedy, compiled passes, drafts left on the device): a drafter round's verify is
enqueued with its accept point, then every verified row is ingested and the next block drafted
from that accept point, still on the device (before_accept); the host reads the accept point back
while the pass runs, and builds the next verify behind it. observe() crops the context to the
accepted rows. A round that does not use the block (lookup, a plain step) drops it.

Hybrid lookup drafts: when the context suffix has occurred before (NgramIndex), that free
continuation may be proposed instead of running the drafter. The context rows keep accumulating
and are fed to the next drafter pass. Whether a round goes to lookup, to the drafter or to a
plain step, and how many drafts it verifies, is the draft policy's decision (decode/policy.py:
the fixed rules, or the measured cost model with `--max-draft auto`); when the policy parks the
drafter, `wants_round` is False and the loop takes pipelined plain steps, whose tapped rows
still feed the drafter's context. Under the cost model a DSpark block read on the host is drafted
whole and then cut by its confidence head (DraftPolicy.cut); `--confidence-threshold` instead cuts
at the first slot below a fixed confidence (DeepSpec's evaluator).

Draft-token choice goes through `_choose` only: a lazy argmax at T = 0 without penalties (no
sync inside the block); otherwise decode/sampled.py's DraftSampler (one per generation, its
"draft" random stream) draws from the processed distribution (penalties, temperature, top-k,
top-p, min-p: the verify's own processing) and that distribution is returned as q, so the
reported q is exactly what the token was drawn from.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

from ..errors import UserError, option
from ..kernels.native_products import native_products
from .lookup import NgramIndex
from .policy import HYBRID_MIN_DEPTH, DraftPolicy, FixedPolicy
from .proposers import Draft, Proposer

INGEST_CHUNK = 1024  # pending context rows projected ahead of the block pass, per chunk


def _draft_sampler(sampling, n_prompt: int):
    try:
        from .sampled import DraftSampler  # lossless sampling
    except ImportError:
        raise UserError(
            "sampled DSpark/DFlash drafts (temperature > 0 or penalties) need lossless sampling "
            "(decode/sampled.py), which this build lacks; use --temperature 0"
        ) from None
    return DraftSampler(sampling, n_prompt)


def _lazy_argmax(sampling) -> bool:
    return sampling is None or (sampling.greedy and not sampling.has_penalties)


@dataclass
class _DrafterPass:
    """A drafter pass propose() has decided to run: from `anchor` over the new context `rows`."""

    t0: float
    anchor: int
    rows: mx.array | None
    max_draft: int
    sampling: object
    history: list
    cut: bool = False  # the policy cuts the drafted block by its confidences (DraftPolicy.cut)
    ahead: mx.array | None = None  # this block, drafted ahead (before_accept); rows is None then


def confident_prefix(conf_logits: list[float], threshold: float) -> int:
    """Number of leading slots to keep: the index of the first slot whose confidence
    sigmoid(s_j) is below `threshold` (all of them when none is, or when threshold <= 0)."""
    if threshold <= 0:
        return len(conf_logits)
    for j, s in enumerate(conf_logits):
        if _sigmoid(s) < threshold:
            return j
    return len(conf_logits)


def _sigmoid(s: float) -> float:
    return 1.0 / (1.0 + math.exp(-s)) if s > -700 else 0.0


class DrafterProposer(Proposer):
    # Compiled greedy drafts stay on the device into the verify forward (one sync per round);
    # False reads them back first, as the op-by-op pass does (the benches compare the two).
    device_drafts = True
    # With device drafts, a drafter round's successor block is drafted before the round's accept
    # point is read back (`before_accept`); False drafts it after (the benches compare the two).
    draft_ahead = True

    def __init__(
        self,
        drafter,
        *,
        confidence_threshold: float = 0.0,
        lookup_drafts: bool = True,
        policy: DraftPolicy | None = None,
    ):
        if confidence_threshold < 0 or confidence_threshold >= 1:
            raise UserError(f"{option('confidence-threshold')} must be in [0, 1), got {confidence_threshold}")
        if confidence_threshold > 0 and getattr(drafter, "conf_head", None) is None:
            raise UserError(
                f"{option('confidence-threshold')} needs a drafter with a confidence head; "
                f"{drafter.source} ({drafter.packaging}) has none"
            )
        self.drafter = drafter
        self.name = drafter.kind
        self.taps = tuple(drafter.taps)
        self.block_drafts = drafter.block_drafts
        self.threshold = float(confidence_threshold)
        self.lookup_drafts = bool(lookup_drafts)
        self._policy = policy
        self._reset()
        from ..compat import route_linears_to_invariant_op

        route_linears_to_invariant_op()  # how nn.Linear takes a CPU pass's native products (once)

    def _reset(self) -> None:
        self.state = None
        self.sampler = None  # DraftSampler: created at the first sampled draft, kept all generation
        self.n_prompt = 0
        self.pending: list[mx.array] = []
        self.n_pending = 0
        self.index = NgramIndex()
        self.last_lookup = False
        self.last_on_device = False  # the last drafter round's draft stayed on the device
        self._ahead: tuple | None = None  # (tokens, context length before the round) till observe
        self._ahead_ready: mx.array | None = None  # the next block, drafted ahead, till _prepare
        self._depth = self._n_hist = 0
        self.policy = self._policy or FixedPolicy(hybrid=True)
        self.counters = {
            "drafter_rounds": 0,
            "drafter_proposed": 0,
            "drafter_accepted": 0,
            "lookup_rounds": 0,
            "lookup_proposed": 0,
            "lookup_accepted": 0,
            "truncated_rounds": 0,
            "ahead_rounds": 0,
            "ahead_unused": 0,
            "drafter_s": 0.0,
        }

    # ------------------------------------------------------------------ protocol
    def runs_ahead(self) -> bool:
        """Do this proposer's greedy drafter rounds draft the next block ahead (a compiled pass,
        drafts left on the device, no confidence threshold)?"""
        from ..models import compiled_draft

        return (
            self.draft_ahead
            and self.device_drafts
            and self.threshold <= 0
            and compiled_draft.for_drafter(self.drafter) is not None
        )

    def use_policy(self, policy: DraftPolicy) -> None:
        """Decide draft lengths with `policy` (decode/policy.py) from now on."""
        self._policy = self.policy = policy

    def begin(self, target, prompt_ids: Sequence[int], prompt_hidden: mx.array | None) -> None:
        self._reset()
        self.n_prompt = len(prompt_ids)
        self.state = self.drafter.new_state()
        if prompt_hidden is None:
            raise RuntimeError("the drafter needs the prompt's tapped hidden states")
        self._add_rows(prompt_hidden)
        if self.lookup_drafts:
            self.index.extend(prompt_ids)

    def wants_round(self, history: Sequence[int]) -> bool:
        n = len(history)
        if self.policy.worth_trying("drafter", self.block_drafts, n):
            return True
        match = self._lookup_match(history)
        return match is not None and self.policy.worth_trying("lookup", 2 * match[1], n, match[1])

    def propose(self, history: Sequence[int], max_draft: int, sampling) -> Draft:
        with native_products():
            got = self._prepare(history, max_draft, sampling)
            return got if isinstance(got, Draft) else self._run_pass(got)

    def _run_pass(self, got: "_DrafterPass") -> Draft:
        """The Draft of one drafter pass: the block drafted ahead, the compiled greedy pass where
        there is one, else op by op."""
        if got.ahead is not None:
            self.counters["ahead_rounds"] += 1
            self.last_on_device = True
            return self._drafted_on_device(got, got.ahead[: got.max_draft])
        self.last_on_device = False
        lazy = self._compiled_sample(got)
        if lazy is not None:
            return self._compiled_draft(got, lazy)
        lazy = self._sample(got, self.drafter.block_hidden(got.anchor, got.rows, self.state))
        mx.eval(lazy[3])
        return self._drafted(got, *lazy)

    def before_accept(self, hidden: mx.array, accepted: mx.array, bonus: mx.array) -> None:
        """Draft ahead: a greedy drafter round's verify is enqueued, with its accept point
        (accepted, bonus: int32 [1], lazy, enqueued). Where this round's draft stayed on the device
        (the compiled pass, no confidence cut), every verified row goes into the context now and
        the next block is drafted from the accept point as it will be: anchor `bonus`, context
        length base + accepted + 1, the rows past it masked. The pass is enqueued behind the
        verify, so the host builds it while the verify runs, and builds the next verify while it
        runs. observe() crops the context to the accept point; _prepare uses the block if the
        next round is a drafter round, else drops it (its device time is lost): so only where the
        policy expects one (`continues`)."""
        from ..models import compiled_draft

        self._ahead = self._ahead_ready = None
        compiled = compiled_draft.for_drafter(self.drafter)
        if (
            not self.draft_ahead
            or not self.last_on_device
            or self.last_lookup
            or self.n_pending
            or compiled is None
            or compiled.eager < compiled_draft.EAGER_PASSES
            or not self.policy.continues("drafter", self.block_drafts)
        ):
            return
        base = self.state[0].offset
        with native_products():
            self.drafter.ingest(hidden, self.state)  # every verified row; observe crops
            toks = compiled.ahead(bonus, base + accepted + 1, self.state)
        if toks is None:  # cannot run here (warned): the context goes back to the round's start
            for c in self.state:
                c.crop(base)
            return
        mx.async_eval(toks)
        self._ahead = (toks, base)
        self.policy.drafted_ahead()

    def _compiled_draft(self, got: "_DrafterPass", lazy) -> Draft:
        """The Draft of a compiled greedy pass: left on the device where it may be, else read."""
        if self.device_drafts and not self._with_conf(got):
            self.last_on_device = True
            return self._drafted_on_device(got, lazy[3][0])
        mx.eval(lazy[3])
        return self._drafted(got, *lazy)

    def _drafted_on_device(self, got: "_DrafterPass", toks: mx.array) -> Draft:
        """The compiled pass's greedy draft left on the device: its pass is enqueued now (the
        host builds the verify forward meanwhile) and the draft is read back with the accept
        point, so the round has one host sync instead of two. Only without a confidence
        threshold: the cut it makes would need the confidences on the host first."""
        mx.async_eval(toks)
        self.counters["drafter_rounds"] += 1
        self.counters["drafter_proposed"] += int(toks.shape[0])
        self.counters["drafter_s"] += time.perf_counter() - got.t0  # host time: the pass ends in the verify's sync
        return Draft(device=toks)

    def _compiled_sample(self, got: "_DrafterPass"):
        """_sample's result from the drafter's compiled greedy pass (models/compiled_draft.py),
        or None where it has none (sampled drafts, the CPU by default, a state without a buffer)."""
        greedy_block = getattr(self.drafter, "greedy_block", None)
        if greedy_block is None or not _lazy_argmax(got.sampling):
            return None
        return self._greedy_lazy(got, greedy_block(got.anchor, got.rows, self.state, self._with_conf(got)))

    def _greedy_lazy(self, got: "_DrafterPass", out):
        """_sample's result shape for a compiled pass's (tokens, confidences), cut to the draft."""
        if out is None:
            return None
        k = min(got.max_draft, self.drafter.block_drafts)
        toks, conf = out[0][:k], (None if out[1] is None else out[1][:k])
        return None, [None] * k, conf, [toks] + ([conf] if conf is not None else [])

    @staticmethod
    def propose_rows(items: Sequence[tuple["DrafterProposer", Sequence[int], int, object]]) -> list[Draft]:
        """propose() for several generations, (proposer, history, max_draft, sampling) each: the
        rows that run the drafter share one backbone pass when they share the drafter."""
        with native_products():
            return DrafterProposer._propose_rows(items)

    @staticmethod
    def _propose_rows(items: Sequence[tuple["DrafterProposer", Sequence[int], int, object]]) -> list[Draft]:
        drafts: list[Draft | None] = [None] * len(items)
        pend = []
        for i, (p, history, max_draft, sampling) in enumerate(items):
            got = p._prepare(history, max_draft, sampling)
            if isinstance(got, Draft):
                drafts[i] = got
            else:
                pend.append((i, p, got))
        if len(pend) == 1 or len({id(p.drafter) for _, p, _ in pend}) > 1:
            for i, p, got in pend:
                drafts[i] = p._run_pass(got)  # a row drafting alone: its own pass, as in a solo round
        elif pend:
            d = pend[0][1].drafter
            rows_pass = getattr(d, "greedy_block_rows", None)
            with_conf = {p._with_conf(g) for _, p, g in pend}
            if rows_pass is not None and len(with_conf) == 1 and all(_lazy_argmax(g.sampling) for _, _, g in pend):
                outs = rows_pass(
                    [g.anchor for _, _, g in pend],
                    [g.rows for _, _, g in pend],
                    [p.state for _, p, _ in pend],
                    with_conf.pop(),
                )
                if outs is not None:
                    for (i, p, got), out in zip(pend, outs):
                        drafts[i] = p._compiled_draft(got, p._greedy_lazy(got, out))
                    return drafts
            hidden = d.block_hidden_rows(
                [g.anchor for _, _, g in pend], [g.rows for _, _, g in pend], [p.state for _, p, _ in pend]
            )
            lazies = [p._sample(got, hidden[b]) for b, (_, p, got) in enumerate(pend)]
            mx.eval([lz[3] for lz in lazies])
            for (i, p, got), lz in zip(pend, lazies):
                drafts[i] = p._drafted(got, *lz)
        return drafts

    def _prepare(self, history: Sequence[int], max_draft: int, sampling):
        """What propose() decides before the drafter runs: a final Draft (empty, or lookup's), or
        the drafter pass to run (_DrafterPass), which takes the block drafted ahead where one is
        waiting and it may (no new rows, no cut: a greedy pass from the cache as it stands)."""
        ahead = self._take_ahead()
        got = self._decide(history, max_draft, sampling)
        if isinstance(got, _DrafterPass) and ahead is not None:
            if got.rows is None and not got.cut and self.threshold <= 0 and _lazy_argmax(sampling):
                got.ahead, ahead = ahead, None
        self._drop(ahead)
        return got

    def _decide(self, history: Sequence[int], max_draft: int, sampling):
        anchor_pos = len(history) - 1
        if self.state[0].offset + self.n_pending != anchor_pos:
            raise RuntimeError(
                f"drafter context out of step: {self.state[0].offset} cached + {self.n_pending} "
                f"pending rows for an anchor at position {anchor_pos}"
            )
        if max_draft <= 0:
            return Draft()
        self._n_hist = len(history)
        draft = self._lookup_draft(history, max_draft)
        if draft is not None:
            return draft
        self.last_lookup = False
        n = len(history)
        if not self.policy.ready("drafter", n):
            return Draft()
        offered = min(max_draft, self.block_drafts)
        max_draft = self.policy.length("drafter", offered, n)
        if max_draft <= 0:
            return Draft()
        cut = self._cuts(sampling)
        if cut:  # the whole block is drafted; its confidences decide how much of it to verify
            max_draft = offered
        return _DrafterPass(
            time.perf_counter(), history[-1], self._take_rows(), max_draft, sampling, list(history), cut
        )

    def _take_ahead(self) -> mx.array | None:
        ahead, self._ahead_ready = self._ahead_ready, None
        return ahead

    def _drop(self, ahead: mx.array | None) -> None:
        """A block drafted ahead that this round does not use: counted, its device time lost."""
        if ahead is not None:
            self.counters["ahead_unused"] += 1

    def _cuts(self, sampling) -> bool:
        """Does the policy cut this round's block by its confidences? Where the drafter has a
        confidence head, no fixed threshold is set, and the drafts are read on the host (a
        compiled greedy pass leaves them on the device: one sync a round, no cut)."""
        if self.threshold > 0 or not self.policy.cuts_by_confidence or getattr(self.drafter, "conf_head", None) is None:
            return False
        from ..models import compiled_draft

        on_device = self.device_drafts and _lazy_argmax(sampling) and compiled_draft.for_drafter(self.drafter)
        return not on_device

    def _with_conf(self, got: "_DrafterPass") -> bool:
        """Does this pass compute its slots' confidences (a threshold or the policy cuts with them)?"""
        return self.threshold > 0 or got.cut

    def _sample(self, got: "_DrafterPass", hidden: mx.array):
        """The draft of slot states hidden [block_drafts, H], lazily: (tokens, q rows, confidences,
        the arrays to evaluate)."""
        k = min(got.max_draft, hidden.shape[0])
        sampling, hist = got.sampling, got.history
        penalties = sampling is not None and sampling.has_penalties

        def choose(row, drafted):
            if not penalties:  # the history only matters to penalties: no sync per slot
                return self._choose(row, sampling, hist)
            return self._choose(row, sampling, hist + [int(t.item()) for t in drafted])

        choose.argmax = _lazy_argmax(sampling)  # a plain argmax: the drafter may pick it within its draft vocabulary
        toks, qs, conf = self.drafter.sample(hidden[:k], got.anchor, choose, self._with_conf(got))
        return toks, qs, conf, [mx.stack(toks)] + ([conf] if conf is not None else [])

    def _drafted(self, got: "_DrafterPass", toks, qs, conf, outs) -> Draft:
        tokens = outs[0].tolist()
        if conf is not None:
            logits = conf.astype(mx.float32).tolist()
            if got.cut:
                keep = self.policy.cut("drafter", [_sigmoid(s) for s in logits])
            else:
                keep = confident_prefix(logits, self.threshold)
            if keep < len(tokens):
                self.counters["truncated_rounds"] += 1
            tokens = tokens[:keep]
        q = None
        if not _lazy_argmax(got.sampling) and tokens:
            q = mx.stack(qs[: len(tokens)])
        self.counters["drafter_rounds"] += 1
        self.counters["drafter_proposed"] += len(tokens)
        self.counters["drafter_s"] += time.perf_counter() - got.t0
        return Draft(tokens=tokens, q=q)

    def observe(self, n_proposed: int, n_accepted: int, hidden: mx.array | None) -> None:
        if hidden is None:
            raise RuntimeError("the drafter needs the tapped hidden states of the kept positions")
        self._drop(self._take_ahead())  # a block drafted ahead serves the round right after its own
        if self._ahead is not None:  # this round's rows are in the context: keep the accepted ones
            toks, base = self._ahead
            self._ahead = None
            for c in self.state:
                c.crop(base + n_accepted + 1)
            self._ahead_ready = toks
        else:
            self._add_rows(hidden)
        if n_proposed == 0:
            return
        n_hist = self._n_hist
        if self.last_lookup:
            self.counters["lookup_accepted"] += n_accepted
            self.policy.result("lookup", n_proposed, n_accepted, n_hist, self._depth)
        else:
            self.counters["drafter_accepted"] += n_accepted
            self.policy.result("drafter", n_proposed, n_accepted, n_hist)

    def stats(self) -> dict:
        c = dict(self.counters)
        c["drafter_s"] = round(c["drafter_s"], 6)
        c.update(self.policy.stats())
        return c

    # ------------------------------------------------------------------ internals
    def _choose(self, logits_row: mx.array, sampling, history: Sequence[int]):
        """(token, q_row) for one draft slot after `history` (committed + drafted so far).

        T = 0 without penalties: a lazy argmax, q_row None (one-hot). Otherwise a draw from the
        processed distribution, which is returned as q_row."""
        if _lazy_argmax(sampling):
            return mx.argmax(logits_row, axis=-1).astype(mx.int32), None
        if self.sampler is None:
            self.sampler = _draft_sampler(sampling, self.n_prompt)
        return self.sampler.step(logits_row, history)

    def _add_rows(self, rows: mx.array) -> None:
        if rows.ndim == 3:
            rows = rows[0]
        if rows.shape[0]:
            self.pending.append(rows)
            self.n_pending += rows.shape[0]
        if self.n_pending > INGEST_CHUNK:  # long prompts, or many lookup rounds in a row
            self._ingest_pending(keep=0)

    def _ingest_pending(self, keep: int) -> None:
        rows = mx.concatenate(self.pending, axis=0) if len(self.pending) > 1 else self.pending[0]
        n = rows.shape[0] - keep
        with native_products():
            for i in range(0, n, INGEST_CHUNK):
                self.drafter.ingest(rows[i : min(i + INGEST_CHUNK, n)], self.state)
                mx.eval([c.state for c in self.state])
        self.pending = [rows[n:]] if keep else []
        self.n_pending = keep

    def _take_rows(self) -> mx.array | None:
        if not self.pending:
            return None
        rows = mx.concatenate(self.pending, axis=0) if len(self.pending) > 1 else self.pending[0]
        self.pending, self.n_pending = [], 0
        return rows

    def _lookup_match(self, history: Sequence[int]) -> tuple[int, int] | None:
        """(start, depth) of the n-gram match a lookup draft would copy, where lookup drafts are on,
        not parked, and the match is at least HYBRID_MIN_DEPTH deep; else None. wants_round and
        _lookup_draft both ask here, so a round is never planned on a match the draft refuses."""
        if not self.lookup_drafts or not self.policy.ready("lookup", len(history)):
            return None
        self.index.sync(history)
        start, depth = self.index.match(history)
        return (start, depth) if start >= 0 and depth >= HYBRID_MIN_DEPTH else None

    def _lookup_draft(self, history: Sequence[int], max_draft: int) -> Draft | None:
        n_hist = len(history)
        match = self._lookup_match(history)
        if match is None:
            return None
        start, depth = match
        if not self.policy.prefer_lookup(
            max_draft, depth, self.block_drafts if self.policy.ready("drafter", n_hist) else 0
        ):
            return None
        k = self.policy.length("lookup", max_draft, n_hist, depth)
        if k <= 0:
            return None
        self._depth = depth
        seq = self.index.tokens
        n = len(seq)
        tokens: list[int] = []
        for i in range(k):  # an overlapping copy: a periodic suffix continues periodically
            j = start + i
            tokens.append(seq[j] if j < n else tokens[j - n])
        self.last_lookup = True
        self.counters["lookup_rounds"] += 1
        self.counters["lookup_proposed"] += len(tokens)
        return Draft(tokens=list(tokens))
