"""Causal attention for long float32 prefills on the CPU, computed in row blocks through numpy.

Why: MLX's CPU build (0.32.x, x86) has no fused attention; mx.fast.scaled_dot_product_attention
falls back to matmul, a mask select and a softmax whose exp runs one float at a time (about 20 ns
per score on the dev box, against 0.6 ns for numpy's vectorized exp). A prefill's attention is
quadratic in the prompt, so a 20k-token prompt (Claude Code's default one) spent most of half an
hour in that exp on the demo model. This op does the same arithmetic in blocks of query rows:
scores by a BLAS matmul into a reused buffer, the causal mask on the diagonal block only (keys
past a block's last row are never computed), softmax in place, then the value matmul; about 4x
faster at 2k x 12k (bench/bench_cpu_attention.py).

Where: only while `active()` is on in the calling thread (decode/loop.py's prefill turns it on
around each chunk), on the CPU, in float32, with mask "causal" and at least MIN_SCORES scores;
compat.route_prefill_attention_to_cpu_op routes mlx-lm's calls here. Verify rounds, decode steps,
GPUs and every other call keep MLX's own kernel. The result matches MLX's to float32 rounding
(not bitwise): plain and speculative decoding share the prefill, so output stays identical
between them. `attention_blocks`' rows depend on their chunk (the row blocks and the keys they
span, OpenBLAS's tiles, and whether the chunk is routed here at all), as MLX's do with OpenBLAS.

Inside `split_invariant()` (kernels/split_prefill.py turns it on for a split-invariant prefill)
every causal call of the chunk, whatever its size and a lone row included, runs
`attention_split` instead: each row's arithmetic is fixed by its absolute position, so a
prefix-cache hit resumed anywhere computes the rows a cold prefill computes, bitwise.
"""

from __future__ import annotations

import contextlib
import sys
import threading

import mlx.core as mx
import numpy as np

MIN_SCORES = 1 << 20  # Lq * Lk below this: MLX's own kernel (short prompts keep its exact arithmetic)
BLOCK_FLOATS = 1 << 23  # score buffer per block (32 MB): rows per block = BLOCK_FLOATS / (rep * Lk)

_local = threading.local()


@contextlib.contextmanager
def active():
    """Route long causal float32 attention on the CPU through `attention` inside this block (this thread)."""
    from ..compat import route_prefill_attention_to_cpu_op

    route_prefill_attention_to_cpu_op(sys.modules[__name__])
    prev = getattr(_local, "on", False)
    _local.on = True
    try:
        yield
    finally:
        _local.on = prev


def is_active() -> bool:
    return getattr(_local, "on", False)


@contextlib.contextmanager
def split_invariant():
    """Inside `active()`: every causal call (any size) runs `attention_split`, whose rows do not
    depend on the chunk they are computed in (this thread)."""
    prev = getattr(_local, "split", False)
    _local.split = True
    try:
        yield
    finally:
        _local.split = prev


def split_active() -> bool:
    return getattr(_local, "split", False)


def split_supported(q, k, v) -> bool:
    """attention_split takes these shapes: head dims a multiple of the invariant product's
    vector (kernels/invariant_linear.py), its native CPU path built."""
    from . import invariant_linear as il

    return q.shape[3] % il.VEC == 0 and il.linear_path() == "native"


def wants(q, k, v, mask, scale) -> bool:
    """Whether this call (as mlx-lm makes it) should run here."""
    if not (
        is_active()
        and scale is not None
        and isinstance(q, mx.array)
        and isinstance(k, mx.array)
        and isinstance(v, mx.array)
        and q.ndim == 4
        and k.ndim == 4
        and v.ndim == 4
        and q.dtype == k.dtype == v.dtype == mx.float32
        and k.shape[2] >= q.shape[2]
        and q.shape[1] % k.shape[1] == 0
        and mx.default_device() == mx.cpu
    ):
        return False
    causal = isinstance(mask, str) and mask == "causal"
    if split_active():  # every chunk of a split-invariant prefill, a lone row (mask None) too
        return (causal or (mask is None and q.shape[2] == 1)) and split_supported(q, k, v)
    return causal and q.shape[2] >= 2 and q.shape[2] * k.shape[2] >= MIN_SCORES


def _scratch(n: int) -> np.ndarray:
    """A float32 buffer of at least n floats, kept per thread (fresh pages cost more than the math)."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < n:
        buf = np.empty(n, dtype=np.float32)
        _local.buf = buf
    return buf


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """`attention_split` inside `split_invariant()`, else `attention_blocks`."""
    if split_active():
        return attention_split(q, k, v, scale)
    return attention_blocks(q, k, v, scale)


def attention_split(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """The causal attention of `attention_blocks`, with every row computed the same way whatever
    its chunk: query row i (position p = Lk - Lq + i) gets bitwise the same output for any Lq,
    Lk > p and row block. Per row: scores q.k_j (j <= p) each one fixed-order dot over the head
    dim (the invariant product, kernels/invariant_linear.py: its recipe does not look at the
    number of rows or columns); the row max (exact in any order); exp (numpy's, elementwise:
    measured position-independent); the value sum and the softmax denominator (a column of ones
    next to the values) as one more invariant product over the keys [0, p], padded with zero
    terms to a multiple of 8 keys: a zero term leaves its accumulator unchanged, and key j always
    lands in accumulator lane j % 8. OpenBLAS's GEMM would not do: its tiles at the row edges
    reduce in another order, and which rows fall there follows the chunk's row count."""
    from . import invariant_linear as il

    mx.eval(q, k, v)
    B, H, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    rep = H // Hkv
    off = Lk - Lq
    lk8 = -(-Lk // il.VEC) * il.VEC
    rows = max(8, min(Lq, BLOCK_FLOATS // (rep * lk8)))
    qs = np.asarray(q) * np.float32(scale)
    kn, vn = np.asarray(k), np.asarray(v)
    out = np.empty((B, H, Lq, Dv), dtype=np.float32)
    neg_inf = np.float32(-np.inf)
    for b in range(B):
        for h in range(Hkv):
            kp = np.zeros((lk8, D), dtype=np.float32)
            kp[:Lk] = kn[b, h]
            vt = np.zeros((Dv + 1, lk8), dtype=np.float32)
            vt[:Dv, :Lk] = vn[b, h].T
            vt[Dv, :Lk] = 1.0
            kh, vth = mx.array(kp), mx.array(vt)
            for r0 in range(0, Lq, rows):
                r1 = min(r0 + rows, Lq)
                n = r1 - r0
                lim = -(-(off + r1) // il.VEC) * il.VEC  # keys the block's last row sees, padded
                qb = mx.array(qs[b, h * rep : (h + 1) * rep, r0:r1].reshape(rep * n, D))
                sm = il.dense(qb, kh[:lim])  # [rep * n, lim]
                mx.eval(sm)
                s = np.asarray(sm)  # a view of sm's memory: the softmax below writes it in place
                d0 = off + r0  # row j of the block sees keys up to d0 + j
                above = np.arange(lim - d0)[None, :] > np.arange(n)[:, None]
                s3 = s.reshape(rep, n, lim)
                np.copyto(s3[:, :, d0:], neg_inf, where=above[None])
                np.subtract(s, s.max(axis=1, keepdims=True), out=s)
                np.exp(s, out=s)
                o = np.asarray(il.dense(sm, vth[:, :lim]))  # [rep * n, Dv + 1], from the exp'd scores
                out[b, h * rep : (h + 1) * rep, r0:r1] = (o[:, :Dv] / o[:, Dv:]).reshape(rep, n, Dv)
    return mx.array(out)


def attention_blocks(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """q [B, H, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv] (float32) -> [B, H, Lq, Dv]; causal,
    aligned at the end (query i sits at position Lk - Lq + i), grouped heads (H a multiple of Hkv)."""
    mx.eval(q, k, v)
    qn, kn, vn = np.asarray(q), np.asarray(k), np.asarray(v)
    B, H, Lq, D = qn.shape
    Hkv, Lk, Dv = kn.shape[1], kn.shape[2], vn.shape[3]
    rep = H // Hkv
    off = Lk - Lq
    rows = max(16, min(Lq, BLOCK_FLOATS // (rep * Lk)))
    buf = _scratch(rep * rows * Lk)
    out = np.empty((B, H, Lq, Dv), dtype=np.float32)
    neg_inf = np.float32(-np.inf)
    for b in range(B):
        for h in range(Hkv):
            kh = np.ascontiguousarray(kn[b, h])
            vh = np.ascontiguousarray(vn[b, h])
            for r0 in range(0, Lq, rows):
                r1 = min(r0 + rows, Lq)
                n = r1 - r0
                lim = off + r1  # keys the block's last row sees
                qb = qn[b, h * rep : (h + 1) * rep, r0:r1].reshape(rep * n, D) * np.float32(scale)
                s = buf[: rep * n * lim].reshape(rep * n, lim)
                np.matmul(qb, kh[:lim].T, out=s)
                d0 = off + r0  # row j of the block sees keys up to d0 + j
                if lim - d0 > 1:
                    above = np.arange(lim - d0)[None, :] > np.arange(n)[:, None]
                    s3 = s.reshape(rep, n, lim)
                    np.copyto(s3[:, :, d0:], neg_inf, where=above[None])
                np.subtract(s, s.max(axis=1, keepdims=True), out=s)
                np.exp(s, out=s)
                total = s.sum(axis=1, keepdims=True)
                o = s @ vh[:lim]
                o /= total
                out[b, h * rep : (h + 1) * rep, r0:r1] = o.reshape(rep, n, Dv)
    return mx.array(out)
