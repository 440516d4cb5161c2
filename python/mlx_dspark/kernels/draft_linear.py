"""A drafter's linear layers on the CPU from float16 weight panels (csrc/draft_linear.cpp).

A drafter pass streams every drafter weight through the CPU once per round for a handful of rows,
so on the CPU its cost follows the bytes it reads: the demo drafter's float32 layers and its
draft-vocabulary head are ~107 MB a pass, a fifth of what the target's decode step reads
(bench/results/cpu-ops.md). Inside `native_products()` (a drafter pass on the CPU) a float weight
is packed once into float16 panels and its products run through the native op from then on:

  pack(w [N, K])            -> panels [ceil(N / 16), K, 16] float16, column c of panel p = row 16p + c
  draft_linear_reference    the op's semantics in MLX: x @ unpack(panels).T (+ bias), float32

Drafts need no exactness (the target verifies every one), so the float16 rounding of the weights
(relative 2^-11) only moves the drafts; the output is unchanged. A weight with a value float16
cannot hold (|w| > 65504) is not packed and keeps the float32 kernel.
"""

from __future__ import annotations

import mlx.core as mx

PANEL = 16
F16_MAX = 65504.0


def pack(weight: mx.array) -> mx.array | None:
    """weight [N, K] (any float dtype) -> float16 panels [ceil(N / 16), K, 16], or None where a
    value does not fit float16."""
    if weight.ndim != 2 or not mx.issubdtype(weight.dtype, mx.floating):
        return None
    if float(mx.abs(weight).max()) > F16_MAX:
        return None
    n, k = weight.shape
    pad = -n % PANEL
    w = weight.astype(mx.float16)
    if pad:
        w = mx.concatenate([w, mx.zeros((pad, k), dtype=mx.float16)], axis=0)
    panels = mx.contiguous(w.reshape(-1, PANEL, k).transpose(0, 2, 1))
    mx.eval(panels)
    return panels


def unpack(panels: mx.array, n: int) -> mx.array:
    """The weight [n, K] (float32) that `panels` hold."""
    p, k, _ = panels.shape
    return panels.transpose(0, 2, 1).reshape(p * PANEL, k)[:n].astype(mx.float32)


def draft_linear_reference(x: mx.array, panels: mx.array, n: int, bias: mx.array | None = None) -> mx.array:
    """x [M, K] float32 -> [M, n] float32: x @ W.T (+ bias) with W the panels' float16 weight."""
    y = x.astype(mx.float32) @ unpack(panels, n).T
    return y if bias is None else y + bias.astype(mx.float32)


def draft_linear(x: mx.array, panels: mx.array, n: int, bias: mx.array | None = None) -> mx.array | None:
    """The native op on x [..., K] (float32, the CPU), or None where it does not run."""
    from . import native

    ext = native.ext(warn=False)
    if ext is None or not hasattr(ext, "draft_linear") or x.dtype != mx.float32:
        return None
    if mx.default_device() != mx.cpu:
        return None
    lead = x.shape[:-1]
    y = ext.draft_linear(x.reshape(-1, x.shape[-1]), panels, bias, n=n)
    return y.reshape(*lead, n)


__all__ = ["PANEL", "draft_linear", "draft_linear_reference", "pack", "unpack"]
