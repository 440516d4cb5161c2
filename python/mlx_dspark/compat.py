"""The one place where behaviour of other packages is adjusted. Each item names the versions it is for."""

from __future__ import annotations

import copy


def fresh_detokenizer(tokenizer, keep_leading_space: bool = False):
    """A private streaming detokenizer for one generation.

    mlx-lm (0.32.x) keeps one detokenizer instance per TokenizerWrapper, shared by every caller,
    so concurrent or interleaved generations would mix their text: a shallow copy shares only
    the read-only token map. mlx-lm's detokenizers also drop the output's leading space, right
    for a chat answer but wrong for a raw completion (" world" after "Hello"); the BPE one has no
    switch for it (0.32.x), so `keep_leading_space` turns the trim off on this copy only.
    """
    d = copy.copy(tokenizer.detokenizer)
    d.reset()
    if keep_leading_space:
        if hasattr(d, "trim_space"):
            d.trim_space = False
        if hasattr(d, "_maybe_trim_space"):
            d._maybe_trim_space = lambda text: text
    return d


_sdpa_original = None


def route_causal_attention_to_invariant_op() -> None:
    """mlx-lm (0.32.x) attention layers call mx.fast.scaled_dot_product_attention (MLX 0.32.x) by
    attribute at call time, with mask "causal" (or None for one query) over a KV cache. Wrap that
    attribute once so that, while kernels.invariant.active() is on in the calling thread, such a
    call runs the width-invariant op instead (kernels/invariant.py). Calls with an array mask or
    attention sinks, other threads, and every call outside that block go to MLX's own kernel."""
    global _sdpa_original
    import mlx.core as mx

    if _sdpa_original is not None:
        return
    from .kernels import invariant

    original = mx.fast.scaled_dot_product_attention

    def scaled_dot_product_attention(q, k, v, *args, scale=None, mask=None, sinks=None, **kwargs):
        if (invariant.is_active() and not args and not kwargs and sinks is None and scale is not None
                and (mask == "causal" if isinstance(mask, str) else mask is None and q.shape[2] == 1)
                and invariant.supported(q, k, v)):
            return invariant.invariant_attention(q, k, v, float(scale))
        return original(q, k, v, *args, scale=scale, mask=mask, sinks=sinks, **kwargs)

    _sdpa_original = original
    mx.fast.scaled_dot_product_attention = scaled_dot_product_attention
