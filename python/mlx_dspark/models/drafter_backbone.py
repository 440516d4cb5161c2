"""The parallel drafter backbone shared by DSpark and DFlash (DeepSpec's
deepspec/modeling/dspark/*/modeling.py; z-lab's DFlash, arXiv 2602.06036).

One forward drafts a whole block: the block's input embeddings attend, non-causally, to
  * the context: the fused target taps of every committed position before the anchor
    (ctx_t = hidden_norm(fc(concat(taps_t)))), injected as extra keys/values into EVERY layer
    (each layer projects the same ctx_t with its own k_proj / v_proj), and
  * the block itself (all slots, both directions).

Context K/V depend only on (ctx_t, t), so each committed position is projected once and kept
in a per-layer `ContextKV` across rounds. Block K/V are written past the context and dropped
again (the cache's offset only advances over context rows): that is DeepSpec's
"append, then crop(start)", without a per-round concatenation of the whole cache.

Two layer styles:
  qwen3   pre-norm block, SiLU MLP, q_norm/k_norm, V unnormalised, scale head_dim^-0.5
  gemma4  sandwich norms (post-attention, pre/post-feed-forward), GELU-tanh MLP, k_eq_v
          (V = scale-free RMSNorm of the k_proj output), attention scale 1.0,
          proportional partial RoPE, x layer_scalar after the layer
RMSNorm weights multiply directly in both styles (Gemma 4 has no +1 offset).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from ..kernels import draft_ops


@dataclass
class BackboneConfig:
    style: str  # "qwen3" | "gemma4"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    context_dim: int  # fc input width = len(taps) * target hidden size
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"  # default | proportional | linear | llama3 | yarn | ...
    partial_rotary_factor: float = 1.0
    rope_scaling: dict = field(default_factory=dict)  # the raw scaling block, for mlx-lm's RoPE variants
    max_position_embeddings: int = 32768
    k_eq_v: bool = False

    @property
    def attn_scale(self) -> float:
        return 1.0 if self.style == "gemma4" else self.head_dim**-0.5


# ----------------------------------------------------------------------------------- RoPE
class ProportionalRoPE:
    """Gemma 4 "proportional" partial RoPE over the whole head_dim.

    inv_freq[i] = theta^(-2i/head_dim) for i < int(factor*head_dim/2), 0 beyond ("NoPE" pairs),
    applied rotate-half style over all head_dim dims: pair (i, i + head_dim/2). Zero inverse
    frequency is an infinite period, which mx.fast.rope takes as `freqs = inf`."""

    def __init__(self, head_dim: int, theta: float, partial_factor: float):
        rotated_pairs = int(partial_factor * head_dim / 2)
        exps = [2.0 * i / head_dim for i in range(rotated_pairs)]
        periods = [theta**e for e in exps] + [math.inf] * (head_dim // 2 - rotated_pairs)
        self.dims = head_dim
        self.freqs = mx.array(periods, dtype=mx.float32)
        self.rates = 1.0 / self.freqs  # radians per position of pair (i, i + head_dim/2); 0: NoPE
        mx.eval(self.rates)  # now: a lazy array cannot be evaluated by another thread (serve's)

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self.freqs)


class PlainRoPE:
    """NeoX-style RoPE over the first `dims` dims of each head (all of them by default)."""

    def __init__(self, dims: int, theta: float, full_head: bool = False):
        self.dims = dims
        self.theta = theta
        # Radians per position of pair (i, i + head_dim/2), the native attention's rotation; None
        # when only part of the head rotates (its pairs are (i, i + dims/2)).
        self.rates = theta ** (-mx.arange(0, dims, 2, dtype=mx.float32) / dims) if full_head else None
        if self.rates is not None:
            mx.eval(self.rates)  # now: a lazy array cannot be evaluated by another thread (serve's)

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        return mx.fast.rope(x, self.dims, traditional=False, base=self.theta, scale=1.0, offset=offset)


def make_rope(cfg: BackboneConfig):
    hd = cfg.head_dim
    if cfg.rope_type == "proportional":
        return ProportionalRoPE(hd, cfg.rope_theta, cfg.partial_rotary_factor)
    if cfg.rope_type == "default":
        dims = int(hd * cfg.partial_rotary_factor)
        return PlainRoPE(dims - dims % 2, cfg.rope_theta, full_head=dims == hd)
    # linear / llama3 / yarn / ...: mlx-lm implements these from the HF scaling block.
    from mlx_lm.models.rope_utils import initialize_rope

    rope = initialize_rope(
        dims=hd,
        base=cfg.rope_theta,
        traditional=False,
        scaling_config=dict(cfg.rope_scaling, rope_type=cfg.rope_type),
        max_position_embeddings=cfg.max_position_embeddings,
    )

    class _Wrapped:  # keep it out of the parameter tree
        def __call__(self, x, offset=0):
            return rope(x, offset=offset)

    return _Wrapped()


# ------------------------------------------------------------------------------ KV cache
class ContextKV:
    """Per-layer K/V of the committed context positions 0..offset-1.

    `write(k, v, keep)` stores rows at [offset, offset + L), returns K/V of [0, offset + L)
    for attention, then advances the offset by `keep` only: rows past it (the block) are
    transient and are overwritten by the next write."""

    step = 256

    def __init__(self):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def write(self, k: mx.array, v: mx.array, keep: int) -> tuple[mx.array, mx.array]:
        n = k.shape[2]
        need = self.offset + n
        if self.keys is None or need > self.keys.shape[2]:
            cap = ((need + self.step - 1) // self.step) * self.step
            kb = mx.zeros((k.shape[0], k.shape[1], cap, k.shape[3]), dtype=k.dtype)
            vb = mx.zeros((v.shape[0], v.shape[1], cap, v.shape[3]), dtype=v.dtype)
            if self.keys is not None and self.offset:
                kb[..., : self.offset, :] = self.keys[..., : self.offset, :]
                vb[..., : self.offset, :] = self.values[..., : self.offset, :]
            self.keys, self.values = kb, vb
        self.keys[..., self.offset : need, :] = k
        self.values[..., self.offset : need, :] = v
        out = self.keys[..., :need, :], self.values[..., :need, :]
        self.offset += keep
        return out

    def crop(self, n: int) -> None:
        """Forget context positions >= n."""
        self.offset = min(self.offset, max(int(n), 0))

    @property
    def state(self) -> list:
        return [] if self.keys is None else [self.keys, self.values]


_norm = draft_ops.rms_norm  # an nn.RMSNorm's output: the native op inside a drafter pass on the CPU


# ---------------------------------------------------------------------------------- layers
class DraftAttention(nn.Module):
    def __init__(self, cfg: BackboneConfig):
        super().__init__()
        H, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.q_proj = nn.Linear(H, nh * hd, bias=False)
        self.k_proj = nn.Linear(H, nkv * hd, bias=False)
        if not cfg.k_eq_v:
            self.v_proj = nn.Linear(H, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)

    def _kv(self, x: mx.array, rope, offset: int) -> tuple[mx.array, mx.array]:
        """Roped, k-normed keys and values of rows x [1, L, H] at positions offset.. ."""
        cfg = self.cfg
        B, L, _ = x.shape
        k = self.k_proj(x).reshape(B, L, cfg.num_kv_heads, cfg.head_dim)
        if cfg.k_eq_v:  # Gemma 4: V is the raw k_proj output, RMS-normalised without a scale
            v = mx.fast.rms_norm(k, None, cfg.rms_norm_eps)
        else:
            v = self.v_proj(x).reshape(B, L, cfg.num_kv_heads, cfg.head_dim)
        k = rope(_norm(self.k_norm, k).transpose(0, 2, 1, 3), offset=offset)
        return k, v.transpose(0, 2, 1, 3)

    def ingest(self, ctx: mx.array, rope, cache: ContextKV) -> None:
        k, v = self._kv(ctx, rope, cache.offset)
        cache.write(k, v, keep=ctx.shape[1])

    def __call__(self, x: mx.array, ctx: mx.array | None, rope, cache: ContextKV) -> mx.array:
        cfg = self.cfg
        B, L, _ = x.shape
        n_ctx = 0 if ctx is None else ctx.shape[1]
        rows = x if ctx is None else mx.concatenate([ctx, x], axis=1)
        start = cache.offset
        k, v = self._kv(rows, rope, start)
        keys, values = cache.write(k, v, keep=n_ctx)  # block rows are transient
        q = self.q_proj(x)
        if B == 1:
            fused = self._native(q[0], keys, values, rope, start + n_ctx)
            if fused is not None:
                return self.o_proj(fused[None])
        q = self.q_norm(q.reshape(B, L, cfg.num_heads, cfg.head_dim)).transpose(0, 2, 1, 3)
        q = rope(q, offset=start + n_ctx)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=cfg.attn_scale)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def _native(self, q: mx.array, keys, values, rope, position: int) -> mx.array | None:
        """q-norm, RoPE and attention of q [L, H*D] as one native op (a drafter pass on the CPU:
        kernels/draft_ops.py), or None."""
        cfg = self.cfg
        return draft_ops.attention(
            q, self.q_norm, keys, values, rope,
            num_heads=cfg.num_heads, position=position, scale=cfg.attn_scale, eps=cfg.rms_norm_eps,
        )  # fmt: skip

    def call_rows(self, x: mx.array, ctxs: list, rope, caches: list) -> mx.array:
        """__call__ for B rows at once: x [B, L, H] the rows' blocks, ctxs[b] row b's new context
        features ([1, n_b, H] or None), caches[b] its ContextKV. The projections run over all the
        rows together; RoPE, the cache writes and attention run per row, as for the row alone."""
        cfg = self.cfg
        B, L, _ = x.shape
        nkv, hd = cfg.num_kv_heads, cfg.head_dim
        pieces = [
            x[b : b + 1] if ctxs[b] is None else mx.concatenate([ctxs[b], x[b : b + 1]], axis=1) for b in range(B)
        ]
        rows = mx.concatenate(pieces, axis=1) if B > 1 else pieces[0]
        k = self.k_proj(rows).reshape(1, -1, nkv, hd)
        v = mx.fast.rms_norm(k, None, cfg.rms_norm_eps) if cfg.k_eq_v else self.v_proj(rows).reshape(1, -1, nkv, hd)
        k = _norm(self.k_norm, k)
        q_rows = self.q_proj(x)
        q = None
        outs, at = [], 0
        for b in range(B):
            n = pieces[b].shape[1]
            n_ctx = n - L
            start = caches[b].offset
            kb = rope(k[:, at : at + n].transpose(0, 2, 1, 3), offset=start)
            keys, values = caches[b].write(kb, v[:, at : at + n].transpose(0, 2, 1, 3), keep=n_ctx)
            mask = getattr(caches[b], "mask", None)  # a compiled pass's buffer (models/compiled_draft.py)
            fused = None if mask is not None else self._native(q_rows[b], keys, values, rope, start + n_ctx)
            if fused is not None:
                outs.append(fused.reshape(1, L, cfg.num_heads, hd).transpose(0, 2, 1, 3))
            else:
                if q is None:
                    q = self.q_norm(q_rows.reshape(B, L, cfg.num_heads, hd)).transpose(0, 2, 1, 3)
                qb = rope(q[b : b + 1], offset=start + n_ctx)
                outs.append(mx.fast.scaled_dot_product_attention(qb, keys, values, scale=cfg.attn_scale, mask=mask))
            at += n
        out = mx.concatenate(outs, axis=0) if B > 1 else outs[0]
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DraftMLP(nn.Module):
    def __init__(self, cfg: BackboneConfig):
        super().__init__()
        self.gelu = cfg.style == "gemma4"
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        g, u = self.gate_proj(x), self.up_proj(x)
        if not self.gelu:
            fused = draft_ops.silu_mul(g, u)  # a drafter pass on the CPU (kernels/draft_ops.py)
            if fused is not None:
                return self.down_proj(fused)
        g = nn.gelu_approx(g) if self.gelu else nn.silu(g)  # gelu_approx is the tanh form
        return self.down_proj(g * u)


class DraftLayer(nn.Module):
    def __init__(self, cfg: BackboneConfig):
        super().__init__()
        self.gemma = cfg.style == "gemma4"
        eps = cfg.rms_norm_eps
        self.self_attn = DraftAttention(cfg)
        self.mlp = DraftMLP(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=eps)
        if self.gemma:
            self.pre_feedforward_layernorm = nn.RMSNorm(cfg.hidden_size, eps=eps)
            self.post_feedforward_layernorm = nn.RMSNorm(cfg.hidden_size, eps=eps)
            self.layer_scalar = mx.ones((1,))

    def __call__(self, h: mx.array, ctx: mx.array | None, rope, cache: ContextKV) -> mx.array:
        return self._rest(h, self.self_attn(_norm(self.input_layernorm, h), ctx, rope, cache))

    def call_rows(self, h: mx.array, ctxs: list, rope, caches: list) -> mx.array:
        """__call__ for B rows at once (DraftAttention.call_rows)."""
        return self._rest(h, self.self_attn.call_rows(_norm(self.input_layernorm, h), ctxs, rope, caches))

    def _rest(self, h: mx.array, a: mx.array) -> mx.array:
        """The layer after its attention output `a`: residuals, norms, MLP."""
        if not self.gemma:
            h = h + a
            return h + self.mlp(_norm(self.post_attention_layernorm, h))
        h = h + _norm(self.post_attention_layernorm, a)
        h = h + _norm(self.post_feedforward_layernorm, self.mlp(_norm(self.pre_feedforward_layernorm, h)))
        return h * self.layer_scalar


class Backbone(nn.Module):
    """fc + hidden_norm fusion, the draft layers and the final norm. Tensor names are those of
    the checkpoints (top level: fc, hidden_norm, layers.N..., norm)."""

    def __init__(self, cfg: BackboneConfig):
        super().__init__()
        self.bcfg = cfg
        self.fc = nn.Linear(cfg.context_dim, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = [DraftLayer(cfg) for _ in range(cfg.num_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self._rope = make_rope(cfg)

    def make_context_cache(self) -> list[ContextKV]:
        return [ContextKV() for _ in self.layers]

    def fuse(self, rows: mx.array) -> mx.array:
        """Context features [1, n, H] from tapped target rows [n, len(taps) * H_target]."""
        if rows.ndim == 2:
            rows = rows[None]
        dtype = self.hidden_norm.weight.dtype
        return _norm(self.hidden_norm, self.fc(rows.astype(dtype)))

    def ingest(self, rows: mx.array, caches: list[ContextKV]) -> None:
        """Project context rows into every layer's cache without running a block."""
        ctx = self.fuse(rows)
        for layer, c in zip(self.layers, caches):
            layer.self_attn.ingest(ctx, self._rope, c)

    def run_block(self, emb: mx.array, rows: mx.array | None, caches: list[ContextKV]) -> mx.array:
        """Final-normed hidden states [1, B, H] of the block embeddings emb [1, B, H], after
        appending the new context rows (positions cache.offset..) to the caches."""
        ctx = self.fuse(rows) if rows is not None and rows.shape[0] else None
        h = emb
        for layer, c in zip(self.layers, caches):
            h = layer(h, ctx, self._rope, c)
        return _norm(self.norm, h)

    def run_block_rows(self, emb: mx.array, rows: list, caches: list) -> mx.array:
        """run_block for B rows at once: emb [B, S, H] the rows' block embeddings, rows[b] row b's
        new context rows ([n_b, T] or None), caches[b] its per-layer ContextKV list -> [B, S, H]."""
        sizes = [0 if r is None else int(r.shape[0]) for r in rows]
        ctxs: list = [None] * len(rows)
        if any(sizes):
            fused = self.fuse(mx.concatenate([r for r, n in zip(rows, sizes) if n], axis=0))
            at = 0
            for b, n in enumerate(sizes):
                if n:
                    ctxs[b] = fused[:, at : at + n]
                    at += n
        h = emb
        for i, layer in enumerate(self.layers):
            h = layer.call_rows(h, ctxs, self._rope, [c[i] for c in caches])
        return _norm(self.norm, h)
