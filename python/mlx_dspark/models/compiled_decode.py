"""The kernel path's decode forward as compiled graphs: one trace per (width bucket, taps, KV
capacity), replayed from C++ at every later step of that shape.

Why: on a GPU a small target's decode step is bound by the host, not the device. Building the
graph of a step in Python (mlx-lm's forward, the routing of every linear layer, the text that
mx.fast.cuda_kernel assembles for each launch) took 2.4 ms of a 5 ms step on the H200 for the
135M demo, where MLX's own forward builds in 1.3 ms (bench/results/invariance-h200.md). A compiled
graph builds none of that again, and MLX fuses its elementwise ops.

What makes a decode step traceable once for every position: the KV cache goes in as arrays (each
layer's whole buffer) and the write position as an int32 array, so nothing in the trace depends
on the position as a Python number. Inside the trace each layer's cache is a `_BufferKV`: it writes
the new keys and values with mx.slice_update at that position, RoPE takes the position as an
array, and attention (kernels/invariant.py, its offset form) reads each row's causal keys out of
the buffer by that position. The buffer holds whole CAPACITY_STEP blocks, so a width is traced
again only when its buffer grows, and prompts of different lengths share their traces.

Exactness: every decode forward of every width runs this one graph, so the load self-check
(invariance.rows_match: plain steps, one verify block, a split block) proves the compiled path
itself. Whether a target can be traced at all is decided at load (`probe`); a target that cannot
keeps the op-by-op kernel path for good. A forward over a cache the graphs do not take (a first
step on an empty cache) runs op by op, the same in every mode.

The batch engine's rows (`rows`, decode/batch.py) run as one graph per (row count, width bucket,
KV blocks, taps): models/compiled_rows.py.

MLX_DSPARK_COMPILE=auto (default: on where the linear layers run the GPU kernels) | on | off.
MLX_DSPARK_BUCKETS=1,8,17,33 (for measurements): the traced widths instead of BUCKETS.
"""

from __future__ import annotations

import os

import mlx.core as mx

CAPACITY_STEP = 1024  # KV positions a buffer grows by (each growth re-traces the widths in use)
# The widths a step is traced at: a w-token forward runs at the first of these >= w (past the last,
# a multiple of 16), its last token repeated in the pad rows. Rows are width-invariant, so the
# first w rows are those of a w-wide forward; the pad rows' keys land past the cache's offset,
# where nothing reads them and the next step overwrites them. Fewer traces (each ~0.2 s of host
# time once per buffer block on our 2-core CPU) for a few rows more in a round (on the H200 a
# compiled verify forward costs about the same from w = 2 to 16: bench/results/invariance-h200.md).
BUCKETS = (1, 2, 3, 4, 6, 8, 12, 17, 24, 33)
_env_buckets: dict = {}


def buckets() -> tuple[int, ...]:
    """BUCKETS, or the widths MLX_DSPARK_BUCKETS lists (a measurement knob: each traced width
    costs a fresh process its first-use compile once; bench/diag_cold_process.py)."""
    raw = os.environ.get("MLX_DSPARK_BUCKETS", "").strip()
    if not raw:
        return BUCKETS
    got = _env_buckets.get(raw)
    if got is None:
        from ..errors import UserError

        try:
            got = tuple(sorted({int(x) for x in raw.split(",") if x.strip()}))
        except ValueError:
            got = ()
        if not got or got[0] != 1:
            raise UserError(
                f"MLX_DSPARK_BUCKETS={raw!r}: give comma-separated widths starting at 1 (e.g. 1,8,17,33), "
                "or unset it for the default"
            )
        _env_buckets[raw] = got
    return got


def bucket(w: int) -> int:
    for b in buckets():
        if b >= w:
            return b
    return -(-w // 16) * 16


def pad_to_blocks(c, need: int = 0) -> None:
    """Grow a cache's keys / values buffers (axis 2) to whole CAPACITY_STEP blocks holding at least
    `need` positions: mlx-lm's prefill (256s) and a restored prefix (any length) then share the
    traces of their block. Positions past the cache's offset are never read."""
    cap = c.keys.shape[2]
    if cap >= need and cap % CAPACITY_STEP == 0:
        return
    grow = -(-max(need, cap) // CAPACITY_STEP) * CAPACITY_STEP - cap
    B, H, _, Dk = c.keys.shape
    c.keys = mx.concatenate([c.keys, mx.zeros((B, H, grow, Dk), c.keys.dtype)], axis=2)
    c.values = mx.concatenate([c.values, mx.zeros((B, H, grow, c.values.shape[3]), c.values.dtype)], axis=2)


def setting() -> str:
    raw = os.environ.get("MLX_DSPARK_COMPILE", "auto").strip().lower()
    return raw if raw in ("auto", "on", "off") else "auto"


def wanted() -> bool:
    """Compile the kernel path's decode forward here: where the linear layers run the GPU kernels
    (the host is the bottleneck there), or everywhere with MLX_DSPARK_COMPILE=on."""
    from ..kernels import invariant_linear

    mode = setting()
    if mode != "auto":
        return mode == "on"
    return invariant_linear.linear_path() in ("cuda", "metal")


def cache_fits(cache, tokens: mx.array) -> bool:
    """Every layer holds mlx-lm's plain KVCache, filled (the prompt's prefill ran) to one position,
    with the batch of `tokens`."""
    from mlx_lm.models.cache import KVCache

    if not cache or tokens.ndim != 2:
        return False
    off = cache[0].offset
    for c in cache:
        if type(c) is not KVCache or c.keys is None or c.offset != off or c.keys.shape[0] != tokens.shape[0]:
            return False
    return True


class _BufferKV:
    """One layer's KVCache inside the trace: the whole buffer, written at an array position."""

    def __init__(self, offset: mx.array, keys: mx.array, values: mx.array):
        self.offset = offset  # int32 scalar: RoPE's offset and the attention's first row position
        self._start = offset.reshape(1)
        self.keys, self.values = keys, values

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        from ..kernels import invariant

        self.keys = mx.slice_update(self.keys, keys.astype(self.keys.dtype), self._start, axes=(2,))
        self.values = mx.slice_update(self.values, values.astype(self.values.dtype), self._start, axes=(2,))
        invariant.expect_offset(self.offset)
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        from ..kernels.invariant import NotInvariant

        if return_array or window_size:
            raise NotInvariant("the model asks its cache for an array mask")
        return None if N == 1 else "causal"


def _traced_forward(target, tokens: mx.array, layers: list, taps: tuple) -> list:
    """Inside a trace: the target's forward over buffer caches, through the invariant ops; every
    layer that wrote its buffer must have had its attention read it ([logits] or [logits, hidden])."""
    from ..kernels import invariant

    try:
        with invariant.active():
            out = target._forward_native(tokens, layers, taps, False)
        if invariant.offset_pending():
            raise invariant.NotInvariant("a layer wrote its cache and read no attention from it")
    finally:
        invariant.take_offset()
    return [out.logits] if out.hidden is None else [out.logits, out.hidden]


class CompiledDecode:
    """The compiled decode forwards of one target (target.compiled_decode)."""

    def __init__(self, target):
        self._target = target
        self._fns: dict = {}  # taps -> mx.compile'd step
        self.batched = None  # models/compiled_rows.py's CompiledRows, made at the first batched step
        self.traces = 0  # how many times a step was traced (tests, benchmarks)

    def _step(self, taps: tuple):
        fn = self._fns.get(taps)
        if fn is None:
            target = self._target

            def step(tokens, offset, keys, values):
                self.traces += 1
                layers = [_BufferKV(offset, k, v) for k, v in zip(keys, values)]
                outs = _traced_forward(target, tokens, layers, taps)
                return outs, [c.keys for c in layers], [c.values for c in layers]

            fn = self._fns[taps] = mx.compile(step)
        return fn

    def __call__(self, tokens: mx.array, cache: list, taps) -> tuple:
        """The decode forward of tokens [B, w] on a `cache_fits` cache: (logits, hidden or None)."""
        w = tokens.shape[1]
        W = bucket(w)
        if W > w:
            tokens = mx.concatenate([tokens, mx.repeat(tokens[:, -1:], W - w, axis=1)], axis=1)
        off = cache[0].offset
        need = off + W
        for c in cache:
            pad_to_blocks(c, need)
        outs, keys, values = self._step(tuple(taps))(
            tokens, mx.array(off, dtype=mx.int32), [c.keys for c in cache], [c.values for c in cache]
        )
        for c, k, v in zip(cache, keys, values):
            c.keys, c.values, c.offset = k, v, off + w
        if W > w:
            outs = [o[:, :w] for o in outs]
        return outs[0], (outs[1] if len(outs) > 1 else None)


def attach(target) -> None:
    """Give target its compiled decode forward (target.compiled_decode) where `wanted` and it
    traces; the probe runs once per target and setting (benchmarks switch paths back and forth)."""
    if not wanted():
        target.compiled_decode = None
        return
    known = getattr(target, "_compiled_probe", None)
    if known is None:
        known = target._compiled_probe = probe(target) or False
    target.compiled_decode = known or None


def probe(target) -> CompiledDecode | None:
    """A CompiledDecode for `target` where its decode forward traces (a short prompt, then a plain
    step and a 2-wide block through the compiled graph), else None: the uncompiled kernel path.
    Any error of the trace means "cannot", never a half-compiled target."""
    vocab = max(target.vocab_size, 2)
    ids = mx.array([[(13 * i + 5) % vocab for i in range(7)]], dtype=mx.int32)
    compiled = CompiledDecode(target)
    try:
        cache = target.make_cache()
        mx.eval(target._forward_native(ids[:, :4], cache, (), True).logits)
        if not cache_fits(cache, ids):
            return None
        logits, _ = compiled(ids[:, 4:5], cache, ())
        more, _ = compiled(ids[:, 5:7], cache, ())
        mx.eval(logits, more)
    except (ValueError, TypeError, RuntimeError, AttributeError):  # NotInvariant included
        return None
    return compiled
