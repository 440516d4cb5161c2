"""The batch engine's rows as one compiled decode graph (decode/batch.py forward_rows): the
projections over every row's tokens at once, each row's cache written at its own position and
attended through the same offset form as its solo step (models/compiled_decode.py), so a row
computes what its solo step computes (the batch engine measures that at load: decode/batch.py
`check`). One trace per (row count, width bucket, KV blocks, taps).

Two layouts of the rows' KV, chosen per step:
  stacked  one buffer per layer for all rows ([B, Hkv, capacity, D], `RowStack`), kept from step
           to step while the same rows step together: one scatter writes every row's new keys,
           one launch of the "rows" offset form (a position per row) attends for all rows. A
           layer launches the same kernels whatever the row count (on an H100 a step of four
           rows went from 9.6 to 5.2 ms: bench/results/batch-h200.md, thirty-first session).
  apart    each row's own buffer, written and attended row by row (two writes and one attention
           launch per row and layer). Taken where stacking would pad the rows to a common
           capacity that wastes more than WASTE_SHARE of their own (one long conversation among
           short ones: every row would hold the long one's length).
"""

from __future__ import annotations

import mlx.core as mx

from .compiled_decode import CAPACITY_STEP, _BufferKV, _traced_forward, bucket, pad_to_blocks

# Stacked rows share one capacity: allowed while the padding it adds is at most this share of the
# rows' own block-rounded need (or one block a row, whichever is more).
WASTE_SHARE = 0.25


def _blocks(n: int) -> int:
    return max(-(-n // CAPACITY_STEP), 1) * CAPACITY_STEP


def stack_fits(needs: list[int]) -> bool:
    """May rows needing `needs` positions share one capacity (the largest need's blocks)?"""
    own = [_blocks(n) for n in needs]
    waste = len(own) * max(own) - sum(own)
    return waste <= max(len(own) * CAPACITY_STEP, WASTE_SHARE * sum(own))


# ------------------------------------------------------------------------------------ stacked
class _StackedRowsKV:
    """One layer's caches of B rows inside a batched trace: one buffer [B, Hkv, capacity, D] for
    all rows, each row's new keys written at its own position by one scatter, and attention
    through the "rows" offset form (a position per row). RoPE reads the rows' positions as one
    [B] array."""

    def __init__(self, offsets: mx.array, where: mx.array, keys: mx.array, values: mx.array):
        self.offset = offsets  # [B] int32
        self._where = where  # [B, 1, W, 1] int32: the positions row b writes this step
        self.keys, self.values = keys, values

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        from ..kernels import invariant

        self.keys = mx.put_along_axis(self.keys, self._where, keys.astype(self.keys.dtype), axis=2)
        self.values = mx.put_along_axis(self.values, self._where, values.astype(self.values.dtype), axis=2)
        invariant.expect_offset(self.offset)
        return self.keys, self.values

    make_mask = _BufferKV.make_mask


class RowStack:
    """The KV of the rows of a batched step, one buffer per layer ([B, Hkv, capacity, D]), kept
    from step to step while the same caches step together in the same order.

    Each row's own cache (a generation's mlx-lm KVCache layers) holds views of its row of these
    buffers, so everything else (trims, snapshots, a solo step, the prefix cache) reads and
    writes them as before. A step reuses the buffers only when every row's cache still holds
    exactly the views the last step handed it; otherwise (a row joined, left, or its cache was
    replaced) the rows are gathered again, and rows that left get buffers of their own."""

    def __init__(self, caches: list, capacity: int):
        self.caches = list(caches)
        n_layers = len(caches[0])
        for cache in caches:
            for c in cache:
                pad_to_blocks(c, capacity)

        def gather(attr: str, i: int) -> mx.array:  # positions past `capacity` are never read
            return mx.concatenate([getattr(cache[i], attr)[:, :, :capacity] for cache in caches], axis=0)

        self.keys = [gather("keys", i) for i in range(n_layers)]
        self.values = [gather("values", i) for i in range(n_layers)]
        self._views: list = []

    @property
    def capacity(self) -> int:
        return int(self.keys[0].shape[2])

    def holds(self, caches: list) -> bool:
        """These caches, in this order, still hold this stack's views (nothing replaced them)."""
        if len(caches) != len(self.caches) or not self._views:
            return False
        for cache, mine, (kv, vv) in zip(caches, self.caches, self._views):
            if cache is not mine:
                return False
            for c, k, v in zip(cache, kv, vv):
                if c.keys is not k or c.values is not v:
                    return False
        return True

    def grow(self, need: int) -> None:
        """Room for `need` positions in every row (whole CAPACITY_STEP blocks)."""
        cap = self.capacity
        if need <= cap:
            return
        grow = _blocks(need) - cap

        def more(a):
            return mx.concatenate([a, mx.zeros((a.shape[0], a.shape[1], grow, a.shape[3]), a.dtype)], axis=2)

        self.keys, self.values = [more(a) for a in self.keys], [more(a) for a in self.values]

    def hand_out(self, keys: list, values: list, offsets: list, widths: list) -> None:
        """The step's new buffers: each row's cache gets views of its row and its new offset."""
        self.keys, self.values = keys, values
        B = len(self.caches)
        ks = [mx.split(k, B, axis=0) for k in keys]
        vs = [mx.split(v, B, axis=0) for v in values]
        self._views = []
        for b, (cache, off, w) in enumerate(zip(self.caches, offsets, widths)):
            kv, vv = [k[b] for k in ks], [v[b] for v in vs]
            for c, k, v in zip(cache, kv, vv):
                c.keys, c.values, c.offset = k, v, off + w
            self._views.append((kv, vv))

    def detach(self, caches: list) -> None:
        """These rows' caches, where they still hold this stack's views, get buffers of their own
        (so a finished row, or the prefix cache keeping it, does not keep every row's KV alive).
        A step over a detached row gathers the rows again (`holds` sees the cache changed)."""
        gone = {id(c) for c in caches}
        for cache, (kv, vv) in zip(self.caches, self._views):
            if id(cache) not in gone:
                continue
            for c, k, v in zip(cache, kv, vv):
                if c.keys is k:
                    c.keys = k * 1  # a copy of its own (bitwise: x * 1 == x), not a view
                if c.values is v:
                    c.values = v * 1


# -------------------------------------------------------------------------------------- apart
class _RowBuffers:
    """What an apart trace's cache hands attention: each row's own buffer and write position.
    compat.route_row_attention sees `row_attention` and hands the call here."""

    def __init__(self, keys: list, values: list, offsets: list):
        self.keys, self.values, self.offsets = keys, values, offsets

    def row_attention(self, q: mx.array, scale: float, sdpa) -> mx.array:
        """q [B, H, W, D]: row b's queries over row b's buffer, through the offset form a solo
        step runs (its pad queries read only keys at or before their own positions)."""
        from ..kernels import invariant

        W = q.shape[2]
        outs = []
        for b, (k, v, off) in enumerate(zip(self.keys, self.values, self.offsets)):
            invariant.expect_offset(off)
            outs.append(sdpa(q[b : b + 1], k, v, scale=scale, mask="causal" if W > 1 else None))
            if invariant.offset_pending():
                raise invariant.NotInvariant("a batched row's attention did not take its buffer's position")
        return mx.concatenate(outs, axis=0)


class _RowsBufferKV:
    """One layer's caches of B rows inside an apart trace: row b's whole buffer, written at its
    own position; RoPE reads the rows' positions as one [B] array."""

    def __init__(self, offsets: mx.array, keys: list, values: list):
        self.offset = offsets
        self._offs = [offsets[b] for b in range(offsets.shape[0])]
        self.keys, self.values = list(keys), list(values)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        for b, off in enumerate(self._offs):
            start = off.reshape(1)
            self.keys[b] = mx.slice_update(self.keys[b], keys[b : b + 1].astype(self.keys[b].dtype), start, axes=(2,))
            self.values[b] = mx.slice_update(
                self.values[b], values[b : b + 1].astype(self.values[b].dtype), start, axes=(2,)
            )
        kv = _RowBuffers(self.keys, self.values, self._offs)
        return kv, kv

    make_mask = _BufferKV.make_mask


# ------------------------------------------------------------------------------------- driver
def rows_of(compiled) -> CompiledRows:
    """The batched steps of a target's CompiledDecode (made at the first batched step)."""
    if compiled.batched is None:
        compiled.batched = CompiledRows(compiled._target, compiled)
    return compiled.batched


class CompiledRows:
    """The batched steps of one target's compiled decode (CompiledDecode.batched, `rows_of`)."""

    def __init__(self, target, owner):
        self._target, self._owner = target, owner  # owner: the CompiledDecode (its trace count)
        self._fns: dict = {}  # (stacked, taps) -> mx.compile'd step of several rows
        self._stack: RowStack | None = None  # the rows' KV of the last stacked step
        self.layouts = {"stacked": 0, "apart": 0}  # steps run by layout (tests, benchmarks)
        self.force: str | None = None  # "stacked" / "apart": every step in that layout (the load's check)

    def _step(self, stacked: bool, taps: tuple):
        fn = self._fns.get((stacked, taps))
        if fn is None:
            target, owner = self._target, self._owner
            n_layers = len(target.layers)

            def step_stacked(tokens, offsets, keys, values):
                owner.traces += 1
                W = tokens.shape[1]
                where = (offsets[:, None] + mx.arange(W, dtype=mx.int32)).reshape(-1, 1, W, 1)
                layers = [_StackedRowsKV(offsets, where, k, v) for k, v in zip(keys, values)]
                outs = _traced_forward(target, tokens, layers, taps)
                return outs, [c.keys for c in layers], [c.values for c in layers]

            def step_apart(tokens, offsets, keys, values):
                owner.traces += 1
                B = tokens.shape[0]
                layers = [
                    _RowsBufferKV(
                        offsets,
                        [keys[b * n_layers + i] for b in range(B)],
                        [values[b * n_layers + i] for b in range(B)],
                    )
                    for i in range(n_layers)
                ]
                outs = _traced_forward(target, tokens, layers, taps)
                new_k = [layers[i].keys[b] for b in range(B) for i in range(n_layers)]
                new_v = [layers[i].values[b] for b in range(B) for i in range(n_layers)]
                return outs, new_k, new_v

            fn = self._fns[(stacked, taps)] = mx.compile(step_stacked if stacked else step_apart)
        return fn

    def rows(self, feeds: list, taps) -> list:
        """One decode forward of several generations' tokens, (cache, tokens [1, w]) each, every
        cache `cache_fits` (models/compiled_decode.py): each row through the same ops, at its own
        position, as its solo step. Returns each row's (logits [1, w, V], hidden [1, w, T] or None)."""
        widths = [int(t.shape[1]) for _, t in feeds]
        W = bucket(max(widths))
        caches = [cache for cache, _ in feeds]
        offs = [int(cache[0].offset) for cache in caches]
        toks = []
        for (_, t), w in zip(feeds, widths):
            t = t.reshape(1, -1).astype(mx.int32)
            toks.append(t if W == w else mx.concatenate([t, mx.repeat(t[:, -1:], W - w, axis=1)], axis=1))
        tokens, offsets = mx.concatenate(toks, axis=0), mx.array(offs, dtype=mx.int32)
        stack = self._stack
        if stack is not None and stack.holds(caches):
            stack.grow(max(offs) + W)
        else:
            if stack is not None:  # rows that left the batch: KV of their own
                kept = {id(c) for c in caches}
                stack.detach([c for c in stack.caches if id(c) not in kept])
                self._stack = stack = None
            fits = stack_fits([off + W for off in offs]) if self.force is None else self.force == "stacked"
            if fits:
                stack = self._stack = RowStack(caches, _blocks(max(offs) + W))
        if stack is not None:
            self.layouts["stacked"] += 1
            outs, new_k, new_v = self._step(True, tuple(taps))(tokens, offsets, stack.keys, stack.values)
            stack.hand_out(new_k, new_v, offs, widths)
        else:
            outs = self._apart(caches, tokens, offsets, offs, widths, W, tuple(taps))
        return [
            (outs[0][b : b + 1, :w], outs[1][b : b + 1, :w] if len(outs) > 1 else None) for b, w in enumerate(widths)
        ]

    def _apart(self, caches, tokens, offsets, offs, widths, W, taps) -> list:
        from ..compat import route_row_attention

        route_row_attention()
        self.layouts["apart"] += 1
        keys, values = [], []
        for cache, off in zip(caches, offs):
            for c in cache:
                pad_to_blocks(c, off + W)
            keys += [c.keys for c in cache]
            values += [c.values for c in cache]
        outs, new_k, new_v = self._step(False, taps)(tokens, offsets, keys, values)
        n_layers = len(caches[0])
        for b, (cache, off, w) in enumerate(zip(caches, offs, widths)):
            for i, c in enumerate(cache):
                c.keys, c.values, c.offset = new_k[b * n_layers + i], new_v[b * n_layers + i], off + w
        return outs

    def release(self, caches: list | None = None) -> None:
        """These rows (default: all) leave batched steps: where they hold the row stack's views
        they get buffers of their own. The stack goes when no row is left in it."""
        stack = self._stack
        if stack is None:
            return
        gone = stack.caches if caches is None else caches
        stack.detach(gone)
        if not {id(c) for c in stack.caches} - {id(c) for c in gone}:
            self._stack = None
