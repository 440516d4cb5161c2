"""A float64 numpy reference of the drafters, written from drafters-spec.md §1.4-§1.8 and §3.2
(not from the MLX code). It reads the checkpoint files directly.

`mutate` switches one detail to a plausible wrong variant, so tests can show that each detail
is observable (the correct reference matches, every mutated one does not).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

MUTATIONS_GEMMA = (
    "full_rope",
    "rope_first_dims",
    "no_v_norm",
    "v_from_normed_k",
    "attn_scale_hd",
    "softcap_after_bias",
    "no_embed_scale",
    "plus_one_norm",
    "no_layer_scalar",
    "no_sandwich",
)


def _bf16(x: float) -> float:
    """Round to bfloat16 (round-to-nearest-even on the top 16 bits of the float32)."""
    b = np.array([x], np.float32).view(np.uint32)[0]
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return float(np.array([b], np.uint32).view(np.float32)[0])


def rms(x, w=None, eps=1e-6, plus_one=False):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    if w is None:
        return y
    return y * ((1.0 + w) if plus_one else w)


def rope(x, pos, inv_freq, rot_dims=None):
    """rotate-half RoPE on x [..., L, hd] over the first rot_dims dims (all by default)."""
    hd = x.shape[-1]
    d = hd if rot_dims is None else rot_dims
    half = d // 2
    ang = pos[:, None].astype(np.float64) * inv_freq[None, :half]
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2, rest = x[..., :half], x[..., half:d], x[..., d:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def silu(x):
    return x / (1 + np.exp(-x))


class Reference:
    def __init__(self, drafter_dir, target_dir=None, mutate: str | None = None):
        self.cfg = json.loads((Path(drafter_dir) / "config.json").read_text())
        self.w = {k: v.astype(np.float64) for k, v in load_file(str(Path(drafter_dir) / "model.safetensors")).items()}
        self.m = mutate
        c = self.cfg
        self.zlab = "DFlashDraftModel" in (c.get("architectures") or [])
        self.gemma = "Gemma4DSparkModel" in (c.get("architectures") or [])
        if self.zlab:  # bound to the target's embed and head
            tw = {k: v.astype(np.float64) for k, v in load_file(str(Path(target_dir) / "model.safetensors")).items()}
            self.w["embed_tokens.weight"] = tw["model.embed_tokens.weight"]
            self.w["lm_head.weight"] = tw.get("lm_head.weight", tw["model.embed_tokens.weight"])
            tcfg = json.loads((Path(target_dir) / "config.json").read_text())
            # the target's embedding as its own forward computes it (Gemma: x bf16(sqrt(H)))
            self.zlab_embed_scale = (
                _bf16(np.sqrt(tcfg["hidden_size"])) if tcfg["model_type"].startswith("gemma") else 1.0
            )
            d = c["dflash_config"]
            self.block, self.mask = d.get("block_size", c.get("block_size")), d["mask_token_id"]
        else:
            self.block, self.mask = c["block_size"], c["mask_token_id"]
        self.H = self.w["fc.weight"].shape[0]
        self.L = 1 + max(int(k.split(".")[1]) for k in self.w if k.startswith("layers."))
        self.hd = self.w["layers.0.self_attn.q_norm.weight"].shape[0]
        self.nh = self.w["layers.0.self_attn.q_proj.weight"].shape[0] // self.hd
        self.nkv = self.w["layers.0.self_attn.k_proj.weight"].shape[0] // self.hd
        self.eps = c.get("rms_norm_eps", 1e-6)
        if self.gemma:
            full = c["rope_parameters"]["full_attention"]
            self.theta, self.pf = full["rope_theta"], full["partial_rotary_factor"]
        else:
            rp = c.get("rope_parameters") or {}
            self.theta, self.pf = rp.get("rope_theta", c.get("rope_theta", 10000.0)), 1.0

    # ---------------------------------------------------------------------------- pieces
    def _norm(self, x, name):
        return rms(x, self.w[name], self.eps, plus_one=self.m == "plus_one_norm")

    def _rope(self, x, pos):
        hd = self.hd
        if not self.gemma:
            return rope(x, pos, self.theta ** (-np.arange(0, hd, 2) / hd))
        if self.m == "full_rope":
            return rope(x, pos, self.theta ** (-np.arange(0, hd, 2) / hd))
        if self.m == "rope_first_dims":  # nn.RoPE(dims = pf * hd): pairs (i, i + pf*hd/2)
            d = int(self.pf * hd)
            return rope(x, pos, self.theta ** (-np.arange(0, d, 2) / d), rot_dims=d)
        n = int(self.pf * hd / 2)
        inv = np.array([self.theta ** (-2 * i / hd) if i < n else 0.0 for i in range(hd // 2)])
        return rope(x, pos, inv)

    def _mlp(self, x, i):
        p = f"layers.{i}.mlp."
        g = x @ self.w[p + "gate_proj.weight"].T
        g = gelu_tanh(g) if self.gemma else silu(g)
        return (g * (x @ self.w[p + "up_proj.weight"].T)) @ self.w[p + "down_proj.weight"].T

    def _attn(self, a, ctx, i, pos_ctx, pos_blk):
        p = f"layers.{i}.self_attn."
        B, T, hd = a.shape[0], ctx.shape[0], self.hd
        kin = np.concatenate([ctx, a], axis=0)
        q = (a @ self.w[p + "q_proj.weight"].T).reshape(B, self.nh, hd)
        k_raw = (kin @ self.w[p + "k_proj.weight"].T).reshape(T + B, self.nkv, hd)
        q = rms(q, self.w[p + "q_norm.weight"], self.eps, plus_one=self.m == "plus_one_norm")
        k = rms(k_raw, self.w[p + "k_norm.weight"], self.eps, plus_one=self.m == "plus_one_norm")
        if self.gemma:
            if self.m == "no_v_norm":
                v = k_raw
            elif self.m == "v_from_normed_k":
                v = k
            else:
                v = rms(k_raw, None, self.eps)
        else:
            v = (kin @ self.w[p + "v_proj.weight"].T).reshape(T + B, self.nkv, hd)
        pos_k = np.concatenate([pos_ctx, pos_blk])
        q = self._rope(q.transpose(1, 0, 2), pos_blk)  # [nh, B, hd]
        k = self._rope(k.transpose(1, 0, 2), pos_k)  # [nkv, T+B, hd]
        v = v.transpose(1, 0, 2)
        scale = 1.0 if (self.gemma and self.m != "attn_scale_hd") else hd**-0.5
        rep = self.nh // self.nkv
        out = np.zeros((self.nh, B, hd))
        for h in range(self.nh):
            s = q[h] @ k[h // rep].T * scale  # non-causal: every slot sees context + whole block
            s = np.exp(s - s.max(-1, keepdims=True))
            out[h] = (s / s.sum(-1, keepdims=True)) @ v[h // rep]
        return out.transpose(1, 0, 2).reshape(B, self.nh * hd) @ self.w[p + "o_proj.weight"].T

    # --------------------------------------------------------------------------- forward
    def hidden(self, ctx_rows, anchor: int):
        """Final-normed hidden states of all B slots for context rows [T, n*H] (positions 0..T-1)."""
        T = ctx_rows.shape[0]
        ctx = self._norm(ctx_rows.astype(np.float64) @ self.w["fc.weight"].T, "hidden_norm.weight")
        ids = [anchor] + [self.mask] * (self.block - 1)
        h = self.w["embed_tokens.weight"][ids]
        if self.gemma and self.m != "no_embed_scale":
            h = h * _bf16(np.sqrt(self.H))
        if self.zlab:
            h = h * self.zlab_embed_scale
        pos_ctx, pos_blk = np.arange(T), T + np.arange(self.block)
        for i in range(self.L):
            a = self._norm(h, f"layers.{i}.input_layernorm.weight")
            o = self._attn(a, ctx, i, pos_ctx, pos_blk)
            if not self.gemma:
                h = h + o
                h = h + self._mlp(self._norm(h, f"layers.{i}.post_attention_layernorm.weight"), i)
                continue
            if self.m == "no_sandwich":
                h = h + o
                h = h + self._mlp(self._norm(h, f"layers.{i}.pre_feedforward_layernorm.weight"), i)
            else:
                h = h + self._norm(o, f"layers.{i}.post_attention_layernorm.weight")
                f = self._mlp(self._norm(h, f"layers.{i}.pre_feedforward_layernorm.weight"), i)
                h = h + self._norm(f, f"layers.{i}.post_feedforward_layernorm.weight")
            if self.m != "no_layer_scalar":
                h = h * self.w[f"layers.{i}.layer_scalar"]
        h = self._norm(h, "norm.weight")
        return h[1:] if self.zlab else h

    def base_logits(self, hidden):
        u = hidden @ self.w["lm_head.weight"].T
        cap = self.cfg.get("final_logit_softcapping")  # z-lab: the drafter config's own, if any
        if cap and self.m != "softcap_after_bias":
            u = cap * np.tanh(u / cap)
        return u

    def draft(self, ctx_rows, anchor: int):
        """(tokens, z [k, V], confidence logits [k] or None): greedy, Markov sequential."""
        hid = self.hidden(ctx_rows, anchor)
        U = self.base_logits(hid)
        rank = int(self.cfg.get("markov_rank") or 0) if not self.zlab else 0
        cap = self.cfg.get("final_logit_softcapping")
        toks, zs, prevs = [], [], []
        prev = anchor
        for j in range(U.shape[0]):
            z = U[j].copy()
            if rank:
                z = z + self.w["markov_head.markov_w2.weight"] @ self.w["markov_head.markov_w1.weight"][prev]
                if self.m == "softcap_after_bias" and cap:
                    z = cap * np.tanh(z / cap)
            t = int(np.argmax(z))
            prevs.append(prev)
            toks.append(t)
            zs.append(z)
            prev = t if rank else prev
        conf = None
        if not self.zlab and self.cfg.get("enable_confidence_head"):
            feats = hid
            if self.cfg.get("confidence_head_with_markov") and rank:
                feats = np.concatenate([hid, self.w["markov_head.markov_w1.weight"][prevs]], axis=-1)
            conf = feats @ self.w["confidence_head.proj.weight"][0] + self.w["confidence_head.proj.bias"][0]
        return toks, np.stack(zs), conf, hid
