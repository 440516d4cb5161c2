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

After a width-1 forward (written in place) `rewind(1)` steps offset and index back, mlx-lm's own
trim arithmetic. The slot keeps the dropped token's key where the ring held the key of position
offset - max_size; no later query can see that entry: the next width-1 forward overwrites that
very slot before attending, and a wider forward drops exactly the oldest ring entry (its
`_update_concat` keeps max_size - 1). Rolling back more than one in-place position is refused.
"""

from __future__ import annotations

from mlx_lm.models.cache import RotatingKVCache


class RewindableRotatingKVCache(RotatingKVCache):
    def __init__(self, max_size, keep=0):
        super().__init__(max_size, keep)
        self._round = None  # (keys, values, offset, idx) before the last wide forward + its keys, values

    def update_and_fetch(self, keys, values):
        if keys.shape[2] > 1:
            self._round = (self.keys, self.values, self.offset, self._idx, keys, values)
        else:
            self._round = None
        return super().update_and_fetch(keys, values)

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
        keys, values = r[4], r[5]
        m = keys.shape[2] - n
        if m < 0:
            raise RuntimeError(f"cannot roll a sliding-window cache back {n} positions: its last forward fed {keys.shape[2]}")
        self.keys, self.values, self.offset, self._idx = r[:4]
        del r  # the restored buffer must be the only reference, so the in-place writes donate it
        for j in range(m):
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


def has_rotating(cache: list) -> bool:
    return any(isinstance(c, RotatingKVCache) for c in cache)
