"""Snapshots of a target's cache: the seam for checkpoint-mode prefix caching.

A recurrent layer cannot be trimmed back to an earlier prompt boundary, so reusing a prefix on a
hybrid target needs the cache as it was at that boundary. `snapshot(cache)` copies every layer's
state (KV up to its offset; a ring with its slots, offset and index; a GDN layer's conv and
recurrent state), evaluated, into fresh arrays; `restore(snap)` builds a fresh cache from it, again
on fresh arrays, so neither side ever writes through to the other (plain decoding writes KV and
rings in place). A restored cache continues bitwise as the original would have
(tests/test_hybrid.py). Layer kinds it does not know return None from `snapshot`.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache


def _copy(x):
    return None if x is None else mx.contiguous(x[...]) if isinstance(x, mx.array) else x


def snapshot(cache: list) -> list | None:
    from .hybrid import ReplayArraysCache
    from .sliding import RewindableRotatingKVCache

    snap, arrays = [], []
    for c in cache:
        if type(c) in (KVCache,):
            n = c.offset
            kv = (None, None) if c.keys is None else (_copy(c.keys[..., :n, :]), _copy(c.values[..., :n, :]))
            snap.append(("kv", kv, n))
        elif type(c) in (RotatingKVCache, RewindableRotatingKVCache):
            snap.append(("ring", type(c), (_copy(c.keys), _copy(c.values)), (c.offset, c._idx, c.keep, c.max_size)))
        elif type(c) in (ArraysCache, ReplayArraysCache):
            if c.lengths is not None or c.left_padding is not None:
                return None
            snap.append(("arrays", type(c), [_copy(x) for x in c.cache]))
        else:
            return None
        arrays.extend(x for x in _flat(snap[-1]) if x is not None)
    mx.eval(arrays)
    return snap


def _flat(entry):
    for part in entry[1:]:
        if isinstance(part, (tuple, list)):
            yield from (p for p in part if isinstance(p, mx.array))
        elif isinstance(part, mx.array):
            yield part


def restore(snap: list) -> list:
    out = []
    for entry in snap:
        kind = entry[0]
        if kind == "kv":
            c = KVCache()
            (k, v), n = entry[1], entry[2]
            if k is not None:
                c.keys, c.values, c.offset = _copy(k), _copy(v), n
        elif kind == "ring":
            cls, (k, v), (offset, idx, keep, max_size) = entry[1], entry[2], entry[3]
            c = cls(max_size, keep)
            c.keys, c.values, c.offset, c._idx = _copy(k), _copy(v), offset, idx
        else:
            cls, arrays = entry[1], entry[2]
            c = cls(len(arrays))
            c.cache = [_copy(x) for x in arrays]
        out.append(c)
    return out
