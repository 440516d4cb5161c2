"""A target's RoPE and RMS norms on the CPU, each as one native op (csrc/target_rope.cpp, and the
drafter's rms_norm in csrc/draft_ops.cpp).

MLX's CPU build (0.32.x) runs mx.fast.rope and mx.fast.rms_norm as their fallbacks: ~29 and ~7 ops
built in the graph and run one by one. A decode forward of the demo target (30 layers) calls rope
60 times and rms_norm 61 times; those fallbacks were ~10-15 ms of a ~60 ms step, in graph
building and in evaluation (bench/results/cpu-ops.md). compat.route_target_norm_and_rope sends
the calls made inside the target's decode forward on the CPU (kernels/invariant.py `active`:
plain steps, verify rounds and the kernel prefill alike) here:

  rope(x, dims, ..., offset)   mx.fast.rope with a base (offset an int, a scalar array or one per
                               batch row); None for what the op does not express (freqs, another
                               dtype or device): MLX's own op runs
  rms_norm(x, weight, eps)     x * rsqrt(mean(x^2) + eps) * weight over the last axis (the
                               reference: draft_ops.rms_norm_reference)

Both compute each row from that row alone (and its position), so a verify block's rows equal the
plain steps' bitwise and the drafting modes stay equal to baseline. They round differently from
MLX's fallbacks (the references below agree to float32 rounding), so the CPU's decode path is the
same in every mode but is not MLX's op for op, as its native linears already are not.
`MLX_DSPARK_KERNELS=reference`, or `MLX_DSPARK_TARGET_OPS=off` (for A/B measurements, read once
at import so the decode forward reads no environment for it; the calibration keys it), keeps
MLX's ops.
"""

from __future__ import annotations

import os

import mlx.core as mx

from . import native
from .draft_ops import rms_norm_reference  # noqa: F401  (the norm's semantics: one reference for both)


# ----------------------------------------------------------------------------- references
def rope_reference(x: mx.array, dims: int, *, traditional: bool, base: float, scale: float, offset) -> mx.array:
    """The op's semantics in MLX: row l of batch row b at position offset[b] + l (offset an int, a
    scalar or [B]), its first `dims` features rotated by (position * scale) * base^(-2i/dims), in
    the pairs (i, i + dims/2) (or (2i, 2i + 1) when traditional); the rest as they are."""
    L, D = x.shape[-2], x.shape[-1]
    half = dims // 2
    inv = mx.power(mx.array(base, mx.float32), -mx.arange(half, dtype=mx.float32) / half)
    off = mx.array(offset, mx.int32).reshape(-1) if not isinstance(offset, mx.array) else offset.reshape(-1)
    pos = (off.astype(mx.float32)[:, None] + mx.arange(L, dtype=mx.float32)[None]) * scale  # [nb, L]
    ang = pos[..., None] * inv  # [nb, L, half]
    if off.size > 1:  # one offset per batch row: [B, 1, ..., L, half]
        ang = ang.reshape(off.size, *([1] * (x.ndim - 3)), L, half)
    c, s = mx.cos(ang), mx.sin(ang)
    if traditional:
        pairs = x[..., :dims].reshape(*x.shape[:-1], half, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        rot = mx.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(*x.shape[:-1], dims)
    else:
        a, b = x[..., :half], x[..., half:dims]
        rot = mx.concatenate([a * c - b * s, a * s + b * c], axis=-1)
    return rot if dims == D else mx.concatenate([rot, x[..., dims:]], axis=-1)


# --------------------------------------------------------------------------------- routing
_ENABLED = os.environ.get("MLX_DSPARK_TARGET_OPS", "on").strip().lower() not in ("off", "0", "false")


def enabled() -> bool:
    """Whether the target's RoPE and norms may take the native ops (MLX_DSPARK_TARGET_OPS at import, default on)."""
    return _ENABLED


def _ext(x: mx.array):
    """The extension where x (float32, the CPU) takes the native ops, else None."""
    if not _ENABLED or x.dtype != mx.float32 or mx.default_device() != mx.cpu:
        return None
    ext = native.ext(warn=False)
    return ext if getattr(ext, "rope", None) is not None else None


def rope(x: mx.array, dims: int, *, traditional: bool, base, scale: float, offset, freqs=None) -> mx.array | None:
    ext = _ext(x)
    if ext is None or freqs is not None or base is None or x.ndim < 2 or dims % 2 or dims > x.shape[-1]:
        return None
    if isinstance(offset, mx.array):
        if offset.ndim > 1 or not mx.issubdtype(offset.dtype, mx.integer):
            return None
        if offset.size > 1 and (x.ndim < 3 or offset.size != x.shape[0]):
            return None
    elif isinstance(offset, int):
        offset = mx.array(offset, mx.int32)
    else:
        return None
    return ext.rope(x, offset, dims=dims, traditional=bool(traditional), base=float(base), scale=float(scale))


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array | None:
    ext = _ext(x)
    if ext is None or x.ndim < 1 or (weight is not None and (weight.dtype != mx.float32 or weight.ndim != 1)):
        return None
    return ext.rms_norm(x, weight, eps=float(eps))
