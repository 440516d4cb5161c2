"""The training-time forward of a DSpark / DFlash drafter: many blocks of many sequences at once.

It runs the very modules the inference path loads (models/dspark.py `DSparkModel`, its
`Backbone` layers from models/drafter_backbone.py: same parameters, same names), but attends
with DeepSpec's training mask (deepspec/modeling/dspark/common.py) instead of a context cache:

  a block b of sequence s, anchored at position p_b (slots j = 0..B-1 at positions p_b + j),
  attends to the fused context ctx_t of its own sequence for t < p_b, and to all B slots of its
  own block (both directions). Nothing else.

That equals the inference attention, where the context cache holds exactly the positions before
the anchor. Scores are computed in two parts, [A*B x T] against the context and [B x B] inside
each block, and normalised jointly, so no block sees another block's keys and no (A*B)^2 mask
is ever built.

Only the qwen3 layer style is trained (what `distill` writes for every target: a
Qwen3DSparkModel-layout drafter); the Gemma-4 sandwich layers are load-only.
"""

from __future__ import annotations

import mlx.core as mx

NEG_INF = -1e30


def _heads(x: mx.array, n: int, hd: int) -> mx.array:
    return x.reshape(*x.shape[:-1], n, hd)


def layer_forward(layer, h: mx.array, ctx: mx.array, anchors: mx.array, ctx_ok: mx.array, rope) -> mx.array:
    """One draft layer over blocks. h [S, A*B, H] block states, ctx [S, T, H] fused context,
    anchors [S, A] anchor positions, ctx_ok [S, A*B, T] bool (t < anchor of the row's block)."""
    attn = layer.self_attn
    cfg = attn.cfg
    S, AB, _ = h.shape
    A = anchors.shape[1]
    B = AB // A
    T = ctx.shape[1]
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    g = nh // nkv
    offs = anchors.reshape(-1)

    a = layer.input_layernorm(h)
    # Block rows: queries, keys and values at positions anchor + j (one RoPE offset per block).
    q = attn.q_norm(_heads(attn.q_proj(a), nh, hd)).reshape(S * A, B, nh, hd).transpose(0, 2, 1, 3)
    q = rope(q, offset=offs)  # [SA, nh, B, hd]
    kb = attn.k_norm(_heads(attn.k_proj(a), nkv, hd)).reshape(S * A, B, nkv, hd).transpose(0, 2, 1, 3)
    kb = rope(kb, offset=offs)  # [SA, nkv, B, hd]
    vb = _heads(attn.v_proj(a), nkv, hd).reshape(S * A, B, nkv, hd).transpose(0, 2, 1, 3)
    # Context rows: keys and values at positions 0..T-1 (each layer projects the same ctx).
    kc = rope(attn.k_norm(_heads(attn.k_proj(ctx), nkv, hd)).transpose(0, 2, 1, 3), offset=0)  # [S, nkv, T, hd]
    vc = _heads(attn.v_proj(ctx), nkv, hd).transpose(0, 2, 1, 3)

    scale = cfg.attn_scale
    # [S, nkv, g, A*B, hd]: row r = a*B + j, head = kv*g + gi (the GQA grouping of SDPA)
    qs = (q * scale).reshape(S, A, nkv, g, B, hd).transpose(0, 2, 3, 1, 4, 5).reshape(S, nkv, g, AB, hd)
    sc = qs @ kc[:, :, None].swapaxes(-1, -2)  # [S, nkv, g, AB, T]
    sc = mx.where(ctx_ok[:, None, None], sc, mx.array(NEG_INF, sc.dtype))
    qb = (q * scale).reshape(S * A, nkv, g, B, hd)
    sb = qb @ kb[:, :, None].swapaxes(-1, -2)  # [SA, nkv, g, B, B]
    sb = sb.reshape(S, A, nkv, g, B, B).transpose(0, 2, 3, 1, 4, 5).reshape(S, nkv, g, AB, B)
    w = mx.softmax(mx.concatenate([sc, sb], axis=-1).astype(mx.float32), axis=-1).astype(q.dtype)
    wc, wb = w[..., :T], w[..., T:]
    out = wc @ vc[:, :, None]  # [S, nkv, g, AB, hd]
    wb = wb.reshape(S, nkv, g, A, B, B).transpose(0, 3, 1, 2, 4, 5).reshape(S * A, nkv, g, B, B)
    ob = (wb @ vb[:, :, None]).reshape(S, A, nkv, g, B, hd).transpose(0, 2, 3, 1, 4, 5).reshape(S, nkv, g, AB, hd)
    out = (out + ob).reshape(S, nh, AB, hd).transpose(0, 2, 1, 3).reshape(S, AB, nh * hd)
    h = h + attn.o_proj(out)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def block_hidden(
    model,
    taps: mx.array,
    tokens: mx.array,
    anchors: mx.array,
    block_size: int,
    mask_token_id: int,
    embed_scale: float = 1.0,
    embed=None,
) -> mx.array:
    """Final-normed slot states [S, A, B, H] of the blocks anchored at `anchors` [S, A].

    taps [S, T, len(taps) * H_t]: the target's tapped rows of each sequence (right-padded);
    tokens [S, T]: the sequences' token ids; `embed` (ids -> embeddings): instead of the model's
    own embed_tokens (z-lab DFlash embeds with the target's, family scaling included)."""
    if model.bcfg.style != "qwen3":
        raise ValueError("distill trains qwen3-style drafter layers only")
    S, A = anchors.shape
    B = block_size
    T = tokens.shape[1]
    ctx = model.fuse(taps)  # [S, T, H]
    x0 = mx.take_along_axis(tokens, anchors, axis=1)  # [S, A]
    ids = mx.concatenate([x0[..., None], mx.full((S, A, B - 1), mask_token_id, dtype=tokens.dtype)], axis=-1)
    h = model.embed_tokens(ids) if embed is None else embed(ids)
    if embed_scale != 1.0:
        h = h * embed_scale
    h = h.astype(model.norm.weight.dtype).reshape(S, A * B, -1)
    row_anchor = mx.repeat(anchors, B, axis=1)  # [S, A*B]
    ctx_ok = mx.arange(T)[None, None, :] < row_anchor[..., None]  # [S, A*B, T]
    for layer in model.layers:
        h = layer_forward(layer, h, ctx, anchors, ctx_ok, model._rope)
    return model.norm(h).reshape(S, A, B, -1)


__all__ = ["block_hidden", "layer_forward"]
