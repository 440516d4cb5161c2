"""Exact rollback of sliding-window caches (mlx-lm's RotatingKVCache), also after the wrap.

mlx-lm's RotatingKVCache keeps the last `max_size` keys in a ring. Plain decoding writes each
token in place (the ring); a wider forward first puts the ring in temporal order, keeps its last
max_size - 1 entries and appends the block (`_update_concat`), so nothing of the old buffer is
overwritten. mlx-lm only allows trimming before the ring has wrapped.

`RewindableRotatingKVCache` rolls back any accept point of a wide forward (a verify round):
`rewind(n)` restores the buffer as it was before the forward (the concat path built new arrays,
so the old ones are intact) and writes the m = S - n accepted keys one at a time through mlx-lm's
own in-place path, as plain decoding would have. The ring then holds exactly the layout plain
decoding holds (same slots, same contents), so the following steps compute what plain decoding
computes. `rewind(0)` after a wide forward does the same for all S positions.

The verify forward itself must compute what plain decoding computes. Plain decoding attends
each query over the ring in slot order; mlx-lm's wide path attends over the temporal order, so
after the wrap the sums run in another order and the logits differ in their last bits (measured
on CPU float32). So a verify-shaped forward (`verify` set by Target.forward: width > 1, not a
prefill) attends over one gathered layout in which every query's keys appear in exactly its
plain ring order, the entries it must not see masked out (`_verify_layout`: mlx-lm's own
in-place update run on position ids, and the S ring orders merged into one). Prefill keeps
mlx-lm's path, so it matches mlx-lm's own generation.

After a width-1 forward (written in place) `rewind(1)` steps offset and index back, mlx-lm's own
trim arithmetic. The slot keeps the dropped token's key where the ring held the key of position
offset - max_size; no later query can see that entry: the next width-1 forward overwrites that
very slot before attending, and a wider forward drops exactly the oldest ring entry (its
`_update_concat` keeps max_size - 1). Rolling back more than one in-place position is refused.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache


class VerifyLayout:
    """For a verify of `width` tokens on one ring state. Index space: 0 is a zero row, 1..B the
    ring's B slots, B+1.. the block's tokens (the rows of concat(zero, ring, block))."""

    def __init__(self, order: list[int], visible: list[set[int]], rings: list[tuple[list[int], int]]):
        self.index = mx.array(order, dtype=mx.int32)  # what the verify attends over, in this order
        self.mask = mx.array([[o in v for o in order] for v in visible])  # [width, len(order)]
        # the ring plain decoding holds after j + 1 of the tokens: (slot contents, _idx)
        self.rings = [(mx.array(ids, dtype=mx.int32), idx) for ids, idx in rings]


@lru_cache(maxsize=1024)
def _verify_layout(buffer: int, offset: int, idx: int, keep: int, max_size: int, width: int) -> VerifyLayout | None:
    """Where each of `width` plain steps writes and what it attends over, merged into one order
    (None when no single order holds them all). A full ring (the steady state) in closed form,
    every other state by running mlx-lm's own in-place update on ids."""
    if buffer == max_size and offset >= max_size and width <= max_size - keep:
        return _full_ring_layout(idx, keep, max_size, width)
    return _simulated_layout(buffer, offset, idx, keep, max_size, width)


def _full_ring_layout(idx: int, keep: int, max_size: int, width: int) -> VerifyLayout:
    """Step j writes slot keep + (idx - keep + j) mod (max_size - keep) (idx = max_size wraps to
    keep) and attends over all max_size slots in slot order. Merged order: slot by slot, the block's
    entry written there, then the old one; each is visible from its write to its overwrite (a
    test holds each step's visible entries equal to what `plain_steps` says the step sees)."""
    import numpy as np

    ring = max_size - keep
    start = keep if idx >= max_size else idx
    slots = [keep + (start - keep + j) % ring for j in range(width)]
    written = {s: j for j, s in enumerate(slots)}  # width <= ring: each slot at most once
    order, life = [], []
    for s in range(max_size):
        j = written.get(s)
        if j is not None:
            order.append(max_size + 1 + j)
            life.append((j, width))
        if j != 0:  # the old entry, while it lives
            order.append(s + 1)
            life.append((0, width if j is None else j))
    lo, hi = np.array(life).T
    steps = np.arange(width)[:, None]
    lay = VerifyLayout.__new__(VerifyLayout)
    lay.index = mx.array(order, dtype=mx.int32)
    lay.mask = mx.array((steps >= lo[None]) & (steps < hi[None]))
    base = np.arange(1, max_size + 1)
    lay.rings = []
    for j, s in enumerate(slots):
        base = base.copy()
        base[s] = max_size + 1 + j
        lay.rings.append((mx.array(base.astype(np.int32)), s + 1))
    return lay


def plain_steps(buffer: int, offset: int, idx: int, keep: int, max_size: int, width: int):
    """mlx-lm's own in-place update run on ids for `width` plain steps: for each, the ids it
    attends over (in order) and the ring it leaves (slot contents, _idx). Ids: 0 an unwritten
    slot, 1..buffer the ring's slots, buffer+1.. the block's tokens."""
    sim = RotatingKVCache(max_size, keep)
    if buffer:
        sim.keys = mx.arange(1, buffer + 1, dtype=mx.float32).reshape(1, 1, buffer, 1)
        sim.values = sim.keys
    sim.offset, sim._idx = offset, idx
    seqs, rings = [], []
    for j in range(width):
        new = mx.full((1, 1, 1, 1), buffer + 1 + j, mx.float32)
        k, _ = sim._update_in_place(new, new)
        seqs.append([int(x) for x in k.reshape(-1).tolist()])
        rings.append(([int(x) for x in sim.keys.reshape(-1).tolist()], sim._idx))
    return seqs, rings


def _simulated_layout(buffer: int, offset: int, idx: int, keep: int, max_size: int, width: int) -> VerifyLayout | None:
    seqs, rings = plain_steps(buffer, offset, idx, keep, max_size, width)
    order = _merge(seqs)
    if order is None or 0 in order:  # no single order, or a step would attend to an unwritten slot
        return None
    return VerifyLayout(order, [set(seq) for seq in seqs], rings)


def _merge(seqs: list[list[int]]) -> list[int] | None:
    """One order of which every sequence is a subsequence: each item new to a sequence goes right
    after its predecessor there (a linked list, so O(total length)); None when that fails."""
    head, nxt = None, {}
    for seq in seqs:
        for t, x in enumerate(seq):
            if x in nxt or x == head:
                continue
            if t == 0:
                nxt[x], head = head, x
            else:
                nxt[x], nxt[seq[t - 1]] = nxt.get(seq[t - 1]), x
    order, x = [], head
    while x is not None:
        order.append(x)
        x = nxt.get(x)
    pos = {x: i for i, x in enumerate(order)}
    for seq in seqs:
        p = [pos[x] for x in seq]
        if any(a >= b for a, b in zip(p, p[1:])):
            return None
    return order


class RewindableRotatingKVCache(RotatingKVCache):
    def __init__(self, max_size, keep=0):
        super().__init__(max_size, keep)
        self._round = None  # what the last wide forward needs to be rewound
        self.verify = False  # the next forward is a verify round (set by Target.forward)

    def _layout(self, width: int) -> VerifyLayout | None:
        if not self.verify or width < 2:
            return None
        buffer = 0 if self.keys is None else self.keys.shape[2]
        # Once the ring is full the offset no longer changes what a step sees.
        offset = self.max_size if buffer == self.max_size and self.offset >= buffer else self.offset
        return _verify_layout(buffer, offset, self._idx, self.keep, self.max_size, width)

    def make_mask(self, N: int, window_size=None, return_array: bool = False):
        layout = self._layout(N)
        if layout is None:
            return super().make_mask(N, window_size=window_size, return_array=return_array)
        if window_size is not None and window_size != self.max_size:
            raise RuntimeError(
                f"a sliding window of {window_size} over a ring of {self.max_size} is not supported "
                "by exact verification"
            )
        return layout.mask

    def update_and_fetch(self, keys, values):
        S = keys.shape[2]
        if S == 1:
            self._round = None
            return super().update_and_fetch(keys, values)
        layout = self._layout(S)
        self.verify = False  # one forward (the mask was made from the same state, before this call)
        pre = (self.keys, self.values, self.offset, self._idx)
        if layout is None:  # a prefill (or a layout no single order holds): mlx-lm's wide path
            self._round = ("wide", pre, keys, values)
            return super().update_and_fetch(keys, values)
        B, H, _, D = keys.shape
        parts_k, parts_v = [mx.zeros((B, H, 1, D), keys.dtype)], [mx.zeros((B, H, 1, values.shape[3]), values.dtype)]
        if pre[0] is not None:
            parts_k.append(pre[0])
            parts_v.append(pre[1])
        ext_k = mx.concatenate(parts_k + [keys], axis=2)
        ext_v = mx.concatenate(parts_v + [values], axis=2)
        self._round = ("ring", pre, ext_k, ext_v, layout)
        self._set_ring(ext_k, ext_v, layout, pre[2], S)  # the state after all S, as plain decoding holds it
        return mx.take(ext_k, layout.index, axis=2), mx.take(ext_v, layout.index, axis=2)

    def _set_ring(self, ext_k, ext_v, layout: VerifyLayout, offset0: int, m: int) -> None:
        ids, idx = layout.rings[m - 1]
        self.keys, self.values = mx.take(ext_k, ids, axis=2), mx.take(ext_v, ids, axis=2)
        self.offset, self._idx = offset0 + m, idx

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        self.rewind(n)
        return n

    def rewind(self, n: int) -> None:
        """Keep the first S - n positions of the last forward (S its width); n = 0 commits it."""
        r, self._round = self._round, None
        if r is None:  # the last forward was one position, written in place
            if n > 1:
                raise RuntimeError(f"cannot roll a sliding-window cache back {n} positions after a one-token forward")
            if n == 1:
                super().trim(1)
            return
        kind, pre = r[0], r[1]
        S = r[2].shape[2] if kind == "wide" else len(r[4].rings)
        m = S - n
        if m < 0:
            raise RuntimeError(f"cannot roll a sliding-window cache back {n} positions: its last forward fed {S}")
        if kind == "ring":
            if n == 0:
                return  # already the state plain decoding holds
            if m > 0:
                self._set_ring(r[2], r[3], r[4], pre[2], m)
                return
        keys, values = (r[2], r[3]) if kind == "wide" else (None, None)
        self.keys, self.values, self.offset, self._idx = pre
        del r, pre  # the restored buffer must be the only reference, so the in-place writes donate it
        for j in range(m):  # kind "wide": plain decoding's own in-place writes of the kept tokens
            self._update_in_place(keys[..., j : j + 1, :], values[..., j : j + 1, :])


def convert_cache(cache: list) -> list:
    """mlx-lm's RotatingKVCache of each sliding layer -> RewindableRotatingKVCache (empty ones)."""
    out = []
    for c in cache:
        if type(c) is RotatingKVCache:
            if c.keys is not None:
                raise ValueError("convert_cache takes a fresh cache")
            c = RewindableRotatingKVCache(c.max_size, c.keep)
        out.append(c)
    return out


def mark_verify(cache, verify: bool) -> None:
    """Tell the sliding-window caches whether the coming forward is a verify round."""
    for c in cache or ():
        if isinstance(c, RewindableRotatingKVCache):
            c.verify = verify


def has_rotating(cache: list) -> bool:
    return any(isinstance(c, RotatingKVCache) for c in cache)
