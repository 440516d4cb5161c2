"""A block drafter's greedy pass (backbone, lm_head, Markov chain, confidences) as one compiled
graph per context buffer block: the drafter's side of what models/compiled_decode.py does for the
target's decode forward.

Why: on a GPU the drafter pass of a round is host-bound like the target's step: ~930 graph ops
(5 backbone layers over the block, then the chain of block_drafts lm_head rows) built in Python
every round (bench/results/round-profile-cpu.md). A trace is replayed from C++ instead.

What makes one trace serve every round: the new context rows are ingested first, op by op (their
count varies), so the compiled block sees no context rows, only the cache. Each layer's cache goes
in as its whole buffer (whole CAPACITY_STEP blocks) with the context length as an int32 array;
the block's keys and values are appended after the buffer, and attention masks the buffer's
positions at and past the context length (`_BlockKV`). The anchor token is an array too, so both
may still be on the device: `ahead` drafts from a round's accept point before it is read back. The
chain runs over the whole block (each slot's token depends only on the slots before it), and the
caller keeps the first k.

Drafts need no exactness (the target verifies every one): the graph rounds as it does, and it is
deterministic. A pass that fails to trace or run on this backend falls back, with a warning, to the
op-by-op pass for that drafter from then on. Greedy drafting only (a plain argmax per slot);
sampled drafts take the op-by-op path. Where it runs: where the target's decode forward is compiled
(compiled_decode.wanted()). One pass serves one generation or several (`rows`: the batch engine's
rows share it): the projections over every row's block and every row's chain at once
(greedy_rows), each row's attention over its own buffer; a generation drafting alone is its one-row
case, its chain the op-by-op pass's own.

A process's first EAGER_PASSES solo passes of a drafter run op by op (`earned`), then the pass
is traced: a fresh process's first compiled pass cost ~0.16 s on an H100, inside the decode
(bench/results/auto-h200.md). A generation that drafts greedy pays both before its prefill, in
its process's warm-up (decode/warmup.py), so its decode runs the compiled pass from its first
round. (Not yet measured on the GPU.)
"""

from __future__ import annotations

import warnings

import mlx.core as mx

from .compiled_decode import pad_to_blocks, wanted
from .draft_vocab import greedy_choice

EAGER_PASSES = 4  # solo passes per process (per drafter) op by op before the pass is compiled


class _BlockKV:
    """One layer's ContextKV inside the trace: the buffer, then the block's rows appended."""

    def __init__(self, offset: mx.array, keys: mx.array, values: mx.array, mask: mx.array):
        self.offset = offset  # int32 scalar: the context length, the block's first position
        self.keys, self.values, self.mask = keys, values, mask

    def write(self, k: mx.array, v: mx.array, keep: int):
        if keep:
            raise ValueError("the compiled block takes no context rows")
        return mx.concatenate([self.keys, k], axis=2), mx.concatenate([self.values, v], axis=2)


_greedy = greedy_choice  # (kept under its old name: the tests import it from here)


class CompiledDraft:
    """The compiled greedy passes of one block drafter (`for_drafter`; BlockDrafter.greedy_block)."""

    def __init__(self, drafter):
        self._drafter = drafter
        self._row_fns: dict = {}  # with_conf -> mx.compile'd pass of one row or several (decode/batch.py)
        self.traces = 0
        self.failed: str | None = None  # why a pass could not run here: the drafter drafts op by op
        self.eager = 0  # solo passes run op by op so far (`earned`)

    def earned(self) -> bool:
        """Has this drafter drafted enough in this process to pay for its compiled solo pass?
        Each call that answers no counts one op-by-op pass."""
        if self.eager >= EAGER_PASSES:
            return True
        self.eager += 1
        return False

    def _pass(self, with_conf: bool):
        fn = self._row_fns.get(with_conf)
        if fn is None:
            d = self._drafter
            S, n = d.block_size, len(d.model.layers)
            rest = mx.array([d.mask_token_id] * (S - 1), dtype=mx.int32)

            def run(anchors, offsets, keys, values):
                self.traces += 1
                B = anchors.shape[0]
                caches = []
                for b in range(B):
                    cap = keys[b * n].shape[2]
                    pos = mx.arange(cap + S)
                    mask = ((pos < offsets[b]) | (pos >= cap))[None, None, None, :]
                    caches.append([_BlockKV(offsets[b], keys[b * n + i], values[b * n + i], mask) for i in range(n)])
                ids = mx.concatenate([anchors.reshape(B, 1), mx.broadcast_to(rest, (B, S - 1))], axis=1)
                emb = d.embed(ids.reshape(-1)).reshape(B, S, -1)
                h = d.model.run_block_rows(emb, [None] * B, caches)[:, d.spec.logits_start :]
                if B == 1:  # a generation alone: the chain of its op-by-op pass, traced
                    toks, _, conf = d.sample(h[0], anchors[0], _greedy, with_conf)
                    return [mx.stack(toks)[None]] + ([conf[None]] if conf is not None else [])
                toks, conf = d.greedy_rows(h, anchors, with_conf)  # every row's chain at once
                return [toks] + ([conf] if conf is not None else [])

            fn = self._row_fns[with_conf] = mx.compile(run)
        return fn

    def rows(self, anchors: list, rows: list, states: list, with_conf: bool):
        """__call__ for several generations in one traced pass: the projections over all rows'
        blocks at once, each row's attention over its own context buffer. A list of (tokens,
        confidences or None), lazy; None where a state has no buffer yet (op-by-op rows run)."""
        for r, st in zip(rows, states):
            if (r is None or not r.shape[0]) and any(c.keys is None for c in st):
                return None  # nothing ingested yet: op-by-op rows, nothing touched
        for r, st in zip(rows, states):
            if r is not None and r.shape[0]:
                self._drafter.ingest(r, st)
        try:
            return self._run(
                mx.array([int(a) for a in anchors], dtype=mx.int32),
                mx.array([st[0].offset for st in states], dtype=mx.int32),
                states,
                with_conf,
            )
        except (RuntimeError, ValueError, TypeError) as e:
            self._fail(e)
            d = self._drafter  # the rows are in the states already
            hidden = d.block_hidden_rows(anchors, [None] * len(anchors), states)
            got = []
            for b, a in enumerate(anchors):
                toks, _, conf = d.sample(hidden[b], a, _greedy, with_conf)
                got.append((mx.stack(toks), conf))
            return got

    def ahead(self, anchor: mx.array, offset: mx.array, state: list):
        """The greedy block (tokens, lazy) of one generation whose anchor token and context length
        are still on the device (int32 [1] each: a round's accept point before it is read back,
        decode/drafting.py's draft-ahead). The context rows up to `offset` are in `state` already;
        rows past it are masked. None where the pass cannot run here (it falls back as `rows`
        does, from the next pass on)."""
        if any(c.keys is None for c in state):
            return None
        try:
            anchors, offsets = anchor.reshape(1).astype(mx.int32), offset.reshape(1).astype(mx.int32)
            return self._run(anchors, offsets, [state], False)[0][0]
        except (RuntimeError, ValueError, TypeError) as e:
            self._fail(e)
            return None

    def _run(self, anchors: mx.array, offsets: mx.array, states: list, with_conf: bool) -> list:
        keys, values = [], []
        for st in states:
            for c in st:
                pad_to_blocks(c)
            keys += [c.keys for c in st]
            values += [c.values for c in st]
        traced = self.traces
        outs = self._pass(bool(with_conf))(anchors, offsets, keys, values)
        if self.traces != traced:
            mx.eval(outs)
        conf = outs[1] if len(outs) > 1 else None
        return [(outs[0][b], None if conf is None else conf[b]) for b in range(anchors.shape[0])]

    def _fail(self, e: Exception) -> None:
        self.failed = f"{type(e).__name__}: {e}"
        warnings.warn(f"the compiled drafter pass failed here ({self.failed}); drafting op by op", stacklevel=3)

    def __call__(self, anchor: int, rows: mx.array | None, state: list, with_conf: bool):
        """(tokens [block_drafts], confidences [block_drafts] or None), lazy, after ingesting
        `rows` into `state`; None where the state has no buffer yet (the op-by-op pass runs).
        A generation drafting alone is the one-row case of `rows`."""
        got = self.rows([anchor], [rows], [state], with_conf)
        return None if got is None else got[0]


def for_drafter(drafter) -> CompiledDraft | None:
    """The drafter's CompiledDraft where drafter passes compile here (made once per drafter and
    dropped when its head or vocabulary changes: BlockDrafter.restrict_vocab, DSpark's refresh
    and bind), else None."""
    if not wanted():
        return None
    got = getattr(drafter, "_compiled_draft", None)
    if got is None:
        got = drafter._compiled_draft = CompiledDraft(drafter)
    return None if got.failed else got
