"""The prefix cache: a new prompt that starts like an earlier conversation reuses its target KV
(and the drafter's context rows) and prefills only the rest.

Trim mode, for targets whose every layer is a plain `KVCache`: an entry holds the exact tokens
its cache holds; a hit on a prompt sharing `n` of them restores a fresh cache trimmed to `n`
(fresh array objects, so the entry is never written through) and the generation prefills
`prompt[n:]`. At least the last prompt token is always fed, so the first new token comes from a
forward as in a cold run. Greedy output is the same as a cold run wherever the forward's rows do
not depend on how the prompt was split (CPU float32, and the width-invariant GPU path).

Slots are kept most-recently-used first in RAM (`slots`, a byte budget); an entry pushed out of
RAM is written to `spill_dir` when there is one and read back on a later hit, also after a
restart. An entry on disk is keyed by the model (source, family, shapes, precision, MLX version)
and its exact tokens; one that does not match or does not read is ignored with a warning and
deleted, never trusted. Any error in a request drops the entry it used (`invalidate`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

log = logging.getLogger("mlx_dspark.serve")
FORMAT = "mlx-dspark-prefix-1"


def model_key(target) -> str:
    """What an entry must have been computed by: the same weights at the same precision."""
    cfg = getattr(target, "config", {}) or {}
    embed = getattr(target, "embed_tokens", None)
    dtype = str(getattr(getattr(embed, "weight", None), "dtype", "")) if embed is not None else ""
    parts = [
        str(getattr(target, "source", "") or target.name),
        target.model_type,
        str(target.hidden_size),
        str(target.num_layers),
        str(target.vocab_size),
        dtype,
        json.dumps(cfg.get("quantization"), sort_keys=True),
        str(getattr(target, "kv_bits", None)),
        mx.__version__,
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def unsupported_reason(target) -> str | None:
    """Why trim mode cannot serve this target (None: it can)."""
    from mlx_lm.models.cache import KVCache

    kinds = {type(c).__name__ for c in target.make_cache()}
    if kinds == {KVCache.__name__}:
        return None
    return (
        f"the prefix cache's trim mode needs plain KV caches; this target has {', '.join(sorted(kinds))} "
        "(checkpoint mode for these is not built yet)"
    )


@dataclass
class Entry:
    tokens: tuple[int, ...]
    keys: list  # per layer [B, H, L, D]
    values: list
    taps: tuple[int, ...] = ()
    hidden: mx.array | None = None
    used: float = field(default_factory=time.monotonic)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (*self.keys, *self.values)) + (
            int(self.hidden.nbytes) if self.hidden is not None else 0
        )

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(list(self.tokens)).encode()).hexdigest()[:24]


@dataclass
class Hit:
    cache: list
    reused: int  # prompt positions already in `cache`
    hidden: mx.array | None  # their tapped rows, when the generation taps


def _common(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    def __init__(self, target, *, slots: int = 2, max_ram_mb: float | None = None, spill_dir: str | None = None):
        if slots < 1:
            raise ValueError("prefix cache slots must be at least 1")
        self.target = target
        self.slots = slots
        self.max_bytes = int(max_ram_mb * 2**20) if max_ram_mb else None
        self.key = model_key(target)
        self.off_reason = unsupported_reason(target)
        self.ram: list[Entry] = []  # most recently used first
        self.dir = Path(spill_dir).expanduser() / self.key if spill_dir else None
        self.disk: dict[str, tuple[int, ...]] = {}  # file stem -> tokens
        self.stats = {"hits": 0, "misses": 0, "reused_tokens": 0, "spilled": 0, "loaded": 0, "ignored": 0}
        self._lock = threading.Lock()
        self._last: str | None = None  # digest of the entry the last hit used
        if self.dir is not None and self.off_reason is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._index_disk()

    @property
    def enabled(self) -> bool:
        return self.off_reason is None

    # ---------------------------------------------------------------- lookup / store
    def lookup(self, prompt, taps=()) -> Hit | None:
        """The longest usable prefix of `prompt` held by an entry, restored into a fresh cache."""
        if not self.enabled:
            return None
        with self._lock:
            best, where, n_best = None, None, 0
            for e in self.ram:
                n = self._usable(e.tokens, e.taps, e.hidden is not None, prompt, taps)
                if n > n_best:
                    best, where, n_best = e, "ram", n
            for stem, tokens in self.disk.items():
                n = self._usable(tokens, None, None, prompt, taps)
                if n > n_best:
                    loaded = self._read(stem)
                    if loaded is not None:
                        n = self._usable(loaded.tokens, loaded.taps, loaded.hidden is not None, prompt, taps)
                        if n > n_best:
                            best, where, n_best = loaded, "disk", n
            if best is None:
                self.stats["misses"] += 1
                self._last = None
                return None
            if where == "disk":
                self.stats["loaded"] += 1
                self._insert(best)
            best.used = time.monotonic()
            self.ram.sort(key=lambda e: -e.used)
            self.stats["hits"] += 1
            self.stats["reused_tokens"] += n_best
            self._last = best.digest
            return Hit(cache=self._restore(best, n_best), reused=n_best, hidden=best.hidden[:n_best] if taps else None)

    @staticmethod
    def _usable(tokens, entry_taps, has_hidden, prompt, taps) -> int:
        n = min(_common(tokens, prompt), len(prompt) - 1)
        if taps and entry_taps is not None and (tuple(entry_taps) != tuple(taps) or not has_hidden):
            return 0
        return max(n, 0)

    def store(self, state) -> None:
        """Keep a finished generation's cache (decode.loop.CacheState)."""
        if not self.enabled or state is None or not state.tokens:
            return
        n = len(state.tokens)
        keys = [c.keys[..., :n, :] for c in state.cache]
        values = [c.values[..., :n, :] for c in state.cache]
        if any(int(c.offset) != n for c in state.cache):
            log.warning("prefix cache: a cache does not hold the tokens it was handed; not stored")
            return
        mx.eval(keys, values)
        entry = Entry(tuple(state.tokens), keys, values, tuple(state.taps), state.hidden)
        with self._lock:
            # An entry whose tokens the new one extends says nothing the new one does not.
            self.ram = [e for e in self.ram if e.tokens != entry.tokens[: len(e.tokens)]]
            for stem, tokens in list(self.disk.items()):
                if tokens == entry.tokens[: len(tokens)]:
                    self._drop_file(stem)
            self._insert(entry)

    def invalidate(self) -> None:
        """A request failed: drop the entry it used (RAM and disk), trust nothing half-done."""
        with self._lock:
            if self._last is not None:
                self.ram = [e for e in self.ram if e.digest != self._last]
                self._drop_file(self._last)
            self._last = None

    def describe(self) -> dict:
        with self._lock:
            return {
                "enabled": self.enabled,
                **({"off": self.off_reason} if self.off_reason else {}),
                "slots": self.slots,
                "in_ram": len(self.ram),
                "ram_mb": round(sum(e.nbytes for e in self.ram) / 2**20, 2),
                "on_disk": len(self.disk),
                **self.stats,
            }

    # ---------------------------------------------------------------- internals
    def _restore(self, e: Entry, n: int) -> list:
        from mlx_lm.models.cache import KVCache

        cache = []
        for k, v in zip(e.keys, e.values):
            c = KVCache()
            c.keys, c.values, c.offset = k[..., :n, :], v[..., :n, :], n
            cache.append(c)
        return cache

    def _insert(self, entry: Entry) -> None:
        self.ram = [e for e in self.ram if e.tokens != entry.tokens]
        self.ram.insert(0, entry)
        while len(self.ram) > self.slots or (
            self.max_bytes and len(self.ram) > 1 and sum(e.nbytes for e in self.ram) > self.max_bytes
        ):
            self._spill(self.ram.pop())

    def _spill(self, e: Entry) -> None:
        if self.dir is None:
            return
        stem = e.digest
        arrays = {f"k.{i}": k for i, k in enumerate(e.keys)} | {f"v.{i}": v for i, v in enumerate(e.values)}
        if e.hidden is not None:
            arrays["hidden"] = e.hidden
        meta = {
            "format": FORMAT,
            "model_key": self.key,
            "tokens": json.dumps(list(e.tokens)),
            "taps": json.dumps(list(e.taps)),
            "layers": str(len(e.keys)),
        }
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        try:
            mx.save_safetensors(tmp, arrays, metadata=meta)
            os.replace(tmp, self.dir / f"{stem}.safetensors")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        self.disk[stem] = e.tokens
        self.stats["spilled"] += 1

    def _index_disk(self) -> None:
        from ..models.checkpoints import safetensors_header

        for f in sorted(self.dir.glob("*.safetensors")):
            try:
                meta = safetensors_header(f).get("__metadata__") or {}
                if meta.get("format") != FORMAT or meta.get("model_key") != self.key:
                    raise ValueError("written for another model or format")
                self.disk[f.stem] = tuple(int(t) for t in json.loads(meta["tokens"]))
            except Exception as e:  # a stale or corrupt entry is never trusted
                self._ignore(f, e)

    def _read(self, stem: str) -> Entry | None:
        f = self.dir / f"{stem}.safetensors"
        try:
            arrays, meta = mx.load(str(f), return_metadata=True)
            if meta.get("format") != FORMAT or meta.get("model_key") != self.key:
                raise ValueError("written for another model or format")
            tokens = tuple(int(t) for t in json.loads(meta["tokens"]))
            n_layers = int(meta["layers"])
            keys = [arrays[f"k.{i}"] for i in range(n_layers)]
            values = [arrays[f"v.{i}"] for i in range(n_layers)]
            if n_layers != self.target.num_layers or any(k.shape[-2] != len(tokens) for k in keys + values):
                raise ValueError("its arrays do not hold its tokens")
            hidden = arrays.get("hidden")
            if hidden is not None and hidden.shape[0] != len(tokens):
                raise ValueError("its tapped rows do not match its tokens")
            return Entry(tokens, keys, values, tuple(json.loads(meta.get("taps", "[]"))), hidden)
        except Exception as e:
            self._ignore(f, e)
            self.disk.pop(stem, None)
            return None

    def _ignore(self, f: Path, why: Exception) -> None:
        log.warning("prefix cache: ignoring %s (%s)", f.name, why)
        self.stats["ignored"] += 1
        try:
            f.unlink()
        except OSError:
            pass

    def _drop_file(self, stem: str) -> None:
        if self.dir is not None and self.disk.pop(stem, None) is not None:
            try:
                (self.dir / f"{stem}.safetensors").unlink()
            except OSError:
                pass
