"""Split-invariant prefill on the CPU in float32: a prefill of positions [a, b) over a cache that
holds [0, a) gives bitwise the KV (and tapped rows) that a cold prefill of the whole prompt gives
those positions, wherever the chunks start and end. That is what lets the prefix cache reuse
every shared token of a conversation (serve/prefix_cache.py) and stay exact.

What a chunk's rows go through inside `context(target)` (each measured on the dev box, float32,
OpenBLAS preloaded and not: bench/prefix_split_bitwise.py --ops):
  linears    every nn.Linear and nn.QuantizedLinear of the target (a quantized one dequantized
             once per call, as kernels/wide_gemm.py does) through the row-invariant native product
             of kernels/invariant_linear.py, at any number of rows. OpenBLAS's SGEMM (0.3.21, Haswell
             kernels) is not row-invariant at any row count measured, 1 to 2,048: the rows of an
             M-row product differ from the same rows of a 2,300-row one, and how they group
             changes with the thread count (likely its edge tiles, which sum in another order);
             so no padding to a minimum row count makes it exact. MLX's CPU quantized matmul is
             row-invariant (kernels/invariant_linear.py) but is not the dense product a long
             prefill needs for speed. The native product measured 84-89 GFLOP/s against
             OpenBLAS's 95-100 at 2,048 rows (576x1536, 1536x576).
  attention  kernels/cpu_attention.attention_split for every chunk (a lone row too), whatever its
             size: per-row scores, max, exp and value sums in an order fixed by the absolute key
             positions.
  the rest   mx.fast.rms_norm (per row), mx.fast.rope at any offset (position p rotated the same
             whatever the chunk's offset), swiglu and the residual adds: measured independent of
             the rows around them.
Where: the default device is the CPU, the target computes in float32, every layer cache is a
plain KVCache (trim mode), the native extension is built, and every linear's input size and the
head dims are multiples of 8 (the product's vector). Elsewhere (GPUs, bf16/fp16, hybrid or
sliding caches) the prefill runs as before and the prefix cache keeps its fixed chunk grid.
`verified(target)` adds a measured self-check (a short prompt prefilled whole and split at odd
points must give bitwise the same KV) before the prefix cache trusts the path.
MLX_DSPARK_SPLIT_PREFILL=off turns the path off.
"""

from __future__ import annotations

import contextlib
import os
import threading

import mlx.core as mx
import mlx.nn as nn

from ..compat import retype_modules

_tls = threading.local()
_lock = threading.Lock()
_swapped: dict[int, tuple[int, list]] = {}  # id(model) -> (active contexts, retyped layers)


def _on() -> bool:
    return getattr(_tls, "on", False)


class SplitLinear(nn.Linear):
    """nn.Linear whose calls, on a thread inside `context`, run the row-invariant product."""

    def __call__(self, x):
        if _on():
            from . import invariant_linear as il

            y = il.dense(x, self["weight"], self.get("bias"))
            if y is not None:
                return y
        return nn.Linear.__call__(self, x)


class SplitQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear whose calls, on a thread inside `context`, dequantize once and run the
    row-invariant dense product."""

    def __call__(self, x):
        if _on():
            from . import invariant_linear as il

            w = mx.dequantize(
                self["weight"],
                self["scales"],
                self.get("biases"),
                group_size=self.group_size,
                bits=self.bits,
                mode=getattr(self, "mode", "affine"),
            ).astype(x.dtype)
            y = il.dense(x, w, self.get("bias"))
            if y is not None:
                return y
        return nn.QuantizedLinear.__call__(self, x)


_SPLIT = {nn.Linear: SplitLinear, nn.QuantizedLinear: SplitQuantizedLinear}


def _linears(model: nn.Module) -> list:
    kinds = tuple(_SPLIT) + tuple(_SPLIT.values())
    return [m for _, m in model.named_modules() if type(m) in kinds]


def _static_reason(target) -> str | None:
    """Why the path cannot serve this target on this device, from its shapes (cached)."""
    key = (str(mx.default_device()), os.environ.get("MLX_DSPARK_SPLIT_PREFILL", ""))
    memo = getattr(target, "_split_prefill_static", None)
    if memo is not None and memo[0] == key:
        return memo[1]
    why = _compute_static_reason(target)
    try:
        target._split_prefill_static = (key, why)
    except AttributeError:
        pass
    return why


def _compute_static_reason(target) -> str | None:
    from . import invariant_linear as il

    if os.environ.get("MLX_DSPARK_SPLIT_PREFILL", "").strip().lower() in ("off", "0", "no"):
        return "MLX_DSPARK_SPLIT_PREFILL=off"
    if mx.default_device() != mx.cpu:
        return "not on the CPU (the GPU prefill is not measured split-invariant)"
    if il.linear_path() != "native":
        return "the native extension (its row-invariant CPU product) is not built"
    model = getattr(target, "model", target)
    try:
        dtype = target.embed(mx.array([[0]], dtype=mx.int32)).dtype
    except Exception as e:  # a target without a plain embedding: not this path
        return f"cannot read its compute dtype ({type(e).__name__})"
    if dtype != mx.float32:
        return f"computes in {dtype}, not float32"
    from .wide_gemm import WideQuantizedLinear

    known = (*_SPLIT, *_SPLIT.values(), WideQuantizedLinear)
    for name, m in model.named_modules():
        if not isinstance(m, (nn.Linear, nn.QuantizedLinear)):
            continue
        if type(m) not in known:
            return f"{name}: a {type(m).__name__} (not a plain Linear / QuantizedLinear)"
        if isinstance(m, nn.QuantizedLinear):
            if getattr(m, "mode", "affine") != "affine":
                return f"{name}: {m.mode} quantization"
            k = m["scales"].shape[-1] * m.group_size
        else:
            k = m["weight"].shape[-1]
        if k % il.VEC:
            return f"{name}: input size {k} is not a multiple of {il.VEC}"
    head_dim = getattr(target, "head_dim", None)
    if isinstance(head_dim, int) and head_dim % il.VEC:
        return f"head dim {head_dim} is not a multiple of {il.VEC}"
    return None


def supported(target, cache) -> str | None:
    """Why a prefill of `target` over `cache` cannot run split-invariant (None: it can)."""
    from mlx_lm.models.cache import KVCache

    why = _static_reason(target)
    if why is not None:
        return why
    if cache is None or any(type(c) is not KVCache for c in cache):
        return "its caches are not all plain KVCache"
    return None


@contextlib.contextmanager
def context(target):
    """Run the wrapped prefill forward split-invariant (this thread): linears and attention."""
    from . import cpu_attention

    model = getattr(target, "model", target)
    key = id(model)
    with _lock:
        count, layers = _swapped.get(key, (0, None))
        if layers is None:
            layers = _linears(model)
            for base, cls in _SPLIT.items():
                group = [m for m in layers if type(m) in (base, cls)]
                if group:
                    retype_modules(group, cls)
        _swapped[key] = (count + 1, layers)
    prev = _on()
    _tls.on = True
    try:
        with cpu_attention.split_invariant():
            yield
    finally:
        _tls.on = prev
        with _lock:
            count, layers = _swapped[key]
            if count == 1:
                for base, cls in _SPLIT.items():
                    group = [m for m in layers if type(m) is cls]
                    if group:
                        retype_modules(group, base)
                del _swapped[key]
            else:
                _swapped[key] = (count - 1, layers)


def verified(target) -> bool:
    """The path serves this target (`supported`) and a self-check passed on it: a 45-token prompt
    prefilled in one chunk, and again in chunks ending at 13, 14 and 31 (a lone row among them),
    gives bitwise the same KV at every layer. Measured once per target (and device)."""
    key = (str(mx.default_device()), os.environ.get("MLX_DSPARK_SPLIT_PREFILL", ""))
    memo = getattr(target, "_split_prefill_verified", None)
    if memo is not None and memo[0] == key:
        return memo[1]
    ok = _self_check(target)
    try:
        target._split_prefill_verified = (key, ok)
    except AttributeError:
        pass
    return ok


def _self_check(target) -> bool:
    import numpy as np

    from . import cpu_attention

    cache = target.make_cache()
    if supported(target, cache) is not None:
        return False
    vocab = int(getattr(target, "vocab_size", 0) or 256)
    ids = [(37 * i + 11) % min(vocab, 4096) for i in range(45)]

    def kv(splits):
        c = target.make_cache()
        start = 0
        for end in [*splits, len(ids)]:
            with context(target), cpu_attention.active():  # as decode/loop.py's prefill_chunk
                target.forward(mx.array(ids[start:end], dtype=mx.int32)[None], c, taps=(), last_only=True)
            start = end
        mx.eval([x.state for x in c])
        return [(np.array(x.keys[..., : x.offset, :]), np.array(x.values[..., : x.offset, :])) for x in c]

    whole = kv([])
    for splits in ([13, 14, 31],):  # a lone row at 13
        other = kv(splits)
        if any(not (np.array_equal(a, c) and np.array_equal(b, d)) for (a, b), (c, d) in zip(whole, other)):
            return False
    return True
