"""The drafter pass's small ops, fused on the CPU: attention, SiLU-and-multiply, RMS norm, the Markov chain.

MLX's CPU build (0.32.x, x86) evaluates exp one float at a time (about 20 ns an element) and each
op of a drafter pass covers only a handful of rows, so on the CPU the pass's softmax, SiLU, RoPE,
norms and its sequential Markov chain cost more than its 37 products (bench/results/
drafter-pass-cpu.md). csrc/draft_ops.cpp fuses each group into one primitive with a vectorised
exp; this module holds their pure-MLX references (the semantics) and routes the drafter to the
native ops inside `native_products()` (a drafter pass on the CPU, kernels/native_products.py):

  attention(q, ...)        q-norm + RoPE + attention of a block's rows over every key
  silu_mul(gate, up)       silu(gate) * up
  rms_norm(norm, x)        an nn.RMSNorm's x * rsqrt(mean(x^2) + eps) * weight (MLX's CPU build runs
                           mx.fast.rms_norm as ~7 ops: the pass's 17 norms were ~1.7 ms of its ~8)
  markov_greedy(U, ...)    t_j = ids[argmax(U_j + W2 . W1[t_{j-1}])], t_-1 = the anchor

Each returns None where the native op does not apply (another device, a dtype other than float32,
a RoPE it does not express, the pass not running), and the caller runs MLX's ops. Drafts need no
exactness (the target verifies every one), so the ops' polynomial exp changes no output.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import native, native_products


# ----------------------------------------------------------------------------- references
def attention_reference(
    q: mx.array,
    q_norm: mx.array,
    keys: mx.array,
    values: mx.array,
    inv_freq: mx.array,
    *,
    num_heads: int,
    position: int,
    scale: float,
    eps: float,
) -> mx.array:
    """q [L, H*D] -> [L, H*D]: RMS-norm each head (weight q_norm), rotate pairs (i, i + D/2) by
    (position + row) * inv_freq[i], attend over every key of keys / values [1, Hkv, Lk, D] (query
    head h reads kv head h // (H / Hkv)) with `scale`."""
    L = q.shape[0]
    D = keys.shape[-1]
    x = mx.fast.rms_norm(q.reshape(1, L, num_heads, D), q_norm, eps).transpose(0, 2, 1, 3)
    pos = (mx.arange(L, dtype=mx.float32) + position)[:, None] * inv_freq[None, :]
    c, s = mx.cos(pos), mx.sin(pos)
    a, b = x[..., : D // 2], x[..., D // 2 :]
    x = mx.concatenate([a * c - b * s, a * s + b * c], axis=-1)
    out = mx.fast.scaled_dot_product_attention(x, keys, values, scale=scale)
    return out.transpose(0, 2, 1, 3).reshape(L, num_heads * D)


def silu_mul_reference(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


def rms_norm_reference(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """x * rsqrt(mean(x^2) + eps) * weight over the last axis (the drafter's and the target's norms)."""
    y = x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)
    return y * weight if weight is not None else y


def markov_greedy_reference(
    logits: mx.array, w1: mx.array, w2: mx.array, vocab_ids: mx.array | None, anchor: mx.array
) -> mx.array:
    """logits [k, Vd], w1 [V, r], w2 [Vd, r] -> tokens [k] int32, one slot after another."""
    prev = anchor.reshape(1).astype(mx.int32)
    toks = []
    for j in range(logits.shape[0]):
        z = logits[j] + (w1[prev] @ w2.T)[0]
        t = mx.argmax(z).astype(mx.int32)
        t = vocab_ids[t] if vocab_ids is not None else t
        toks.append(t)
        prev = t.reshape(1)
    return mx.stack(toks)


# --------------------------------------------------------------------------------- routing
def _ext():
    """The extension, where a drafter pass on the CPU runs its ops natively, else None."""
    if not native_products.is_on():
        return None
    return native.ext(warn=False)


def _f32(*arrays) -> bool:
    return all(a.dtype == mx.float32 for a in arrays)


def inv_freq(rope) -> mx.array | None:
    """The rotation rates of `rope` (models/drafter_backbone.py: its `rates`) in the pairs
    (i, i + D/2) that the native attention rotates, or None where it rotates otherwise (partial or
    scaled RoPE)."""
    return getattr(rope, "rates", None)


def attention(q, q_norm, keys, values, rope, *, num_heads: int, position: int, scale: float, eps: float):
    """The native attention of q [L, H*D] (None: run MLX's ops)."""
    ext = _ext()
    if ext is None or keys.shape[0] != 1 or not _f32(q, q_norm.weight, keys, values):
        return None
    rates = inv_freq(rope)
    if rates is None or rates.shape[0] * 2 != keys.shape[-1]:
        return None
    return ext.draft_attention(
        q, q_norm.weight, keys, values, rates, num_heads=num_heads, position=int(position), scale=scale, eps=eps
    )


def silu_mul(gate: mx.array, up: mx.array) -> mx.array | None:
    ext = _ext()
    if ext is None or not _f32(gate, up):
        return None
    return ext.silu_mul(gate, up)


def rms_norm(norm, x: mx.array) -> mx.array:
    """norm(x) for an nn.RMSNorm `norm`: the native op inside a drafter pass on the CPU, else MLX's."""
    ext = _ext()
    if ext is None or not _f32(x, norm.weight):
        return norm(x)
    return ext.rms_norm(x, norm.weight, eps=norm.eps)


def markov_greedy(logits, w1, w2, vocab_ids, anchor) -> mx.array | None:
    ext = _ext()
    if ext is None or not _f32(logits, w1, w2):
        return None
    return ext.markov_greedy(logits, w1, w2, vocab_ids, anchor)


__all__ = [
    "attention",
    "attention_reference",
    "inv_freq",
    "markov_greedy",
    "markov_greedy_reference",
    "rms_norm",
    "rms_norm_reference",
    "silu_mul",
    "silu_mul_reference",
]
