"""The prefix cache: a new prompt that starts like an earlier conversation reuses its target KV
(and the drafter's context rows) and prefills only the rest.

Trim mode, for targets whose every layer is a plain `KVCache`: an entry holds the tokens its
cache holds; a hit on a prompt sharing `n` of them restores a fresh cache trimmed to `n` (fresh
array objects, so the entry is never written through) and the generation prefills `prompt[n:]`.
At least the last prompt token is always fed, so the first new token comes from a forward as in
a cold run.

Warm equals cold bitwise (KV, logits, tokens, text) because every reused position holds the
bits a cold prefill of the new prompt computes there. An entry keeps only the positions that went
through the prefill's chunks (the prompt but its last token: that token and the generated ones
came from decode forwards, another arithmetic). Where the prefill is split-invariant
(kernels/split_prefill.py: the CPU in float32 with plain KV caches, its self-check passed at
load; `grid` 1) an entry keeps all of them and a hit reuses every shared token but the last:
a follow-up turn prefills only the previous answer and the new message. Elsewhere (GPUs, other
dtypes; `grid` = decode.loop.PREFILL_CHUNK) a row DOES depend on how the prompt was split
(OpenBLAS's edge tiles, MLX's attention over a chunk's key count, the routing between attention
ops), so the prefill's chunks end at multiples of PREFILL_CHUNK counted from position 0, an
entry keeps only its prompt's whole chunks of that grid and a hit reuses a multiple of it: up to
PREFILL_CHUNK - 1 prompt tokens are prefilled again, and a prompt of at most PREFILL_CHUNK tokens
leaves no entry (tests/test_prefix_cache_bitwise.py checks both). Entries are keyed by which of
the two prefills computed them (`model_key`): their bits differ.

Checkpoint mode, for targets whose caches cannot be trimmed back to any earlier point (hybrid
GDN layers, sliding windows; models/snapshot.py knows their layers): an entry is the whole
cache as it stood at a prompt boundary (`Target.snapshot` right after a generation's prefill,
evaluated into fresh arrays). It is reused whole, and only when a later prompt extends its
tokens exactly (and by at least one token, which is fed). Its last positions were computed in
other chunk shapes than a cold prefill of the longer prompt uses, so warm equals cold only to
float rounding here, not bitwise (greedy tokens agree unless a near-tie flips). Anything else
is a miss whose cause
(`last_report` / the `report` dict of `lookup`: where the prompt diverged and the text there,
e.g. a chat template that re-renders the `<think>` opener) the server puts in `x_mlx_dspark`.
Checkpoint entries stay in RAM (no spill).

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
FORMAT = "mlx-dspark-prefix-2"  # 2: entries hold only positions a cold prefill computes alike (1's are ignored)


def grid(target) -> int:
    """Where trim-mode reuse may stop: anywhere (1) when the target's prefill is split-invariant
    here (kernels/split_prefill.py, its self-check passed), else at a multiple of the prefill's
    chunk grid (decode/loop.py)."""
    from ..decode import loop
    from ..kernels import split_prefill

    return 1 if split_prefill.verified(target) else loop.PREFILL_CHUNK


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
        _prefill_kind(target),  # a split-invariant prefill computes other bits than the BLAS one
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def _prefill_kind(target) -> str:
    from ..kernels import split_prefill

    return "split-invariant" if split_prefill.verified(target) else "grid"


def cache_mode(target) -> tuple[str | None, str | None]:
    """("trim" | "checkpoint", None) for the mode that serves this target, or (None, why not)."""
    from mlx_lm.models.cache import KVCache

    cache = target.make_cache()
    kinds = {type(c).__name__ for c in cache}
    if kinds == {KVCache.__name__}:
        return "trim", None
    snap = getattr(target, "snapshot", None)
    if snap is not None and snap(cache) is not None:
        return "checkpoint", None
    return None, (
        f"the prefix cache needs plain KV caches (trim mode) or layers it can snapshot (checkpoint mode); "
        f"this target has {', '.join(sorted(kinds))}"
    )


def unsupported_reason(target) -> str | None:
    """Why no prefix-cache mode can serve this target (None: one can)."""
    return cache_mode(target)[1]


@dataclass
class Entry:
    tokens: tuple[int, ...]
    keys: list  # per layer [B, H, L, D]
    values: list
    taps: tuple[int, ...] = ()
    hidden: mx.array | None = None
    used: float = field(default_factory=time.monotonic)
    snap: list | None = None  # checkpoint mode: Target.snapshot of the cache holding `tokens`

    @property
    def nbytes(self) -> int:
        from ..models.snapshot import _flat

        arrays = [*self.keys, *self.values] + [x for e in self.snap or [] for x in _flat(e) if x is not None]
        return sum(int(a.nbytes) for a in arrays) + (int(self.hidden.nbytes) if self.hidden is not None else 0)

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
        self.mode, self.off_reason = cache_mode(target)
        self.grid = grid(target) if self.mode == "trim" else 1
        if self.mode == "checkpoint":
            spill_dir = None  # checkpoint entries stay in RAM
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
    def lookup(self, prompt, taps=(), report: dict | None = None) -> Hit | None:
        """The longest usable prefix of `prompt` held by an entry, restored into a fresh cache.
        `report` (a dict) receives what happened: mode, hit, reused_tokens, and a miss's cause."""
        if report is not None:
            report.update(mode=self.mode or "off", hit=False, reused_tokens=0)
        if not self.enabled:
            if report is not None:
                report["miss"] = self.off_reason
            return None
        if self.mode == "checkpoint":
            return self._lookup_checkpoint(list(prompt), tuple(taps), report)
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
            if report is not None:
                report.update(hit=True, reused_tokens=n_best)
            return Hit(cache=self._restore(best, n_best), reused=n_best, hidden=best.hidden[:n_best] if taps else None)

    def _lookup_checkpoint(self, prompt: list, taps: tuple, report: dict | None) -> Hit | None:
        """Checkpoint mode: the entry whose tokens the prompt extends (by >= 1 token), whole."""
        with self._lock:
            usable = [
                e
                for e in self.ram
                if len(e.tokens) < len(prompt)
                and tuple(prompt[: len(e.tokens)]) == e.tokens
                and (not taps or (e.taps == taps and e.hidden is not None))
            ]
            if not usable:
                self.stats["misses"] += 1
                self._last = None
                if report is not None:
                    report["miss"] = self._miss_cause(prompt, taps)
                return None
            best = max(usable, key=lambda e: len(e.tokens))
            best.used = time.monotonic()
            self.ram.sort(key=lambda e: -e.used)
            n = len(best.tokens)
            self.stats["hits"] += 1
            self.stats["reused_tokens"] += n
            self._last = best.digest
            if report is not None:
                report.update(hit=True, reused_tokens=n)
            return Hit(cache=self.target.restore(best.snap), reused=n, hidden=best.hidden if taps else None)

    def _miss_cause(self, prompt: list, taps: tuple) -> str:
        if not self.ram:
            return "no checkpoint yet (checkpoint mode keeps the cache at each prompt's end)"
        e = max(self.ram, key=lambda e: _common(e.tokens, prompt))
        n = _common(e.tokens, prompt)
        if n == len(e.tokens) == len(prompt):
            return "the prompt is a cached prompt itself: its last token must be fed again, a checkpoint cannot"
        if n == len(e.tokens):
            return f"the checkpoint was taken for drafter taps {list(e.taps)}, this request taps {list(taps)}"
        if n == len(prompt):
            return f"the prompt ({len(prompt)} tokens) is shorter than the closest checkpoint ({len(e.tokens)} tokens)"
        return (
            f"the prompt diverges from the closest checkpoint at token {n} of its {len(e.tokens)}: "
            f"cached {self._text(e.tokens[n : n + 6])!r}, prompt {self._text(prompt[n : n + 6])!r}"
        )

    def _text(self, ids) -> str:
        try:
            return self.target.tokenizer.decode(list(ids))
        except Exception:  # no tokenizer: the ids say it
            return str(list(ids))

    def _usable(self, tokens, entry_taps, has_hidden, prompt, taps) -> int:
        n = min(_common(tokens, prompt), len(prompt) - 1)
        if taps and entry_taps is not None and (tuple(entry_taps) != tuple(taps) or not has_hidden):
            return 0
        return max(n, 0) // self.grid * self.grid  # off the split-invariant path: resume on the chunk grid

    def store(self, state) -> None:
        """Keep a finished generation's cache (decode.loop.CacheState)."""
        if not self.enabled or state is None or not state.tokens:
            return
        if self.mode == "checkpoint":
            return self._store_checkpoint(state)
        if any(int(c.offset) != len(state.tokens) for c in state.cache):
            log.warning("prefix cache: a cache does not hold the tokens it was handed; not stored")
            return
        # Only the positions a cold prefill computes the same way: those that went through the
        # prefill's chunks (not the lone last prompt token nor the generated ones: the decode
        # path computes them), and off the split-invariant path only their whole chunks of the grid.
        n = min(len(state.tokens), state.prefilled) // self.grid * self.grid
        if n <= 0:
            return
        keys = [c.keys[..., :n, :] for c in state.cache]
        values = [c.values[..., :n, :] for c in state.cache]
        hidden = state.hidden[:n] if state.hidden is not None else None
        mx.eval(keys, values, *([hidden] if hidden is not None else []))
        entry = Entry(tuple(state.tokens[:n]), keys, values, tuple(state.taps), hidden)
        with self._lock:
            # An entry whose tokens the new one extends says nothing the new one does not.
            self.ram = [e for e in self.ram if e.tokens != entry.tokens[: len(e.tokens)]]
            for stem, tokens in list(self.disk.items()):
                if tokens == entry.tokens[: len(tokens)]:
                    self._drop_file(stem)
            self._insert(entry)

    def _store_checkpoint(self, state) -> None:
        """Keep the generation's prompt-boundary snapshot (decode.loop.CacheState.checkpoint)."""
        if state.checkpoint is None:
            return
        n, snap = state.checkpoint
        if snap is None or n > len(state.tokens):
            return
        hidden = state.hidden[:n] if state.hidden is not None and state.hidden.shape[0] >= n else None
        entry = Entry(
            tuple(state.tokens[:n]), [], [], tuple(state.taps) if hidden is not None else (), hidden, snap=snap
        )
        with self._lock:
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
                "mode": self.mode or "off",
                **({"off": self.off_reason} if self.off_reason else {}),
                # trim mode: reuse stops anywhere (1, the split-invariant prefill) or on the chunk grid
                **({"grid": self.grid} if self.mode == "trim" else {}),
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
        if self.dir is None or e.snap is not None:
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
