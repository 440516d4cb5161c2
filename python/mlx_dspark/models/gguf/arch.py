"""What each supported GGUF architecture means in mlx-lm terms: config.json and tensor names.

Two families: `llama` (SmolLM2, Llama, Mistral-style GGUFs) and `gemma3` (Gemma 3 text).
Quirks of llama.cpp's converter that are undone here:
  * llama: Q and K projection rows are permuted per head for llama.cpp's adjacent-pair RoPE
    (`permute` below; undone in quant.permute_rows), so the folder holds HF's layout and
    mlx-lm's standard (rotate-half) RoPE applies.
  * gemma3: every RMSNorm weight is stored as (1 + w), since llama.cpp multiplies by the weight
    while Gemma multiplies by (1 + w); mlx-lm's Gemma adds the 1 itself, so 1 is subtracted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ...errors import UserError

SUPPORTED_ARCHS = ("llama", "gemma3")


@dataclass(frozen=True)
class TensorRule:
    hf: str  # HF / mlx-lm name, with {i} for the block index
    permute: str | None = None  # "q" or "k": undo llama.cpp's RoPE row permutation
    minus_one: bool = False  # Gemma norm weights are stored as 1 + w
    matrix: bool = True  # a Linear / Embedding weight (quantizable)


_LLAMA_BLOCK = {
    "attn_norm.weight": TensorRule("input_layernorm.weight", matrix=False),
    "ffn_norm.weight": TensorRule("post_attention_layernorm.weight", matrix=False),
    "attn_q.weight": TensorRule("self_attn.q_proj.weight", permute="q"),
    "attn_k.weight": TensorRule("self_attn.k_proj.weight", permute="k"),
    "attn_v.weight": TensorRule("self_attn.v_proj.weight"),
    "attn_output.weight": TensorRule("self_attn.o_proj.weight"),
    "attn_q.bias": TensorRule("self_attn.q_proj.bias", permute="q", matrix=False),
    "attn_k.bias": TensorRule("self_attn.k_proj.bias", permute="k", matrix=False),
    "attn_v.bias": TensorRule("self_attn.v_proj.bias", matrix=False),
    "attn_output.bias": TensorRule("self_attn.o_proj.bias", matrix=False),
    "ffn_gate.weight": TensorRule("mlp.gate_proj.weight"),
    "ffn_up.weight": TensorRule("mlp.up_proj.weight"),
    "ffn_down.weight": TensorRule("mlp.down_proj.weight"),
}

_GEMMA3_BLOCK = {
    "attn_norm.weight": TensorRule("input_layernorm.weight", minus_one=True, matrix=False),
    "post_attention_norm.weight": TensorRule("post_attention_layernorm.weight", minus_one=True, matrix=False),
    "ffn_norm.weight": TensorRule("pre_feedforward_layernorm.weight", minus_one=True, matrix=False),
    "post_ffw_norm.weight": TensorRule("post_feedforward_layernorm.weight", minus_one=True, matrix=False),
    "attn_q_norm.weight": TensorRule("self_attn.q_norm.weight", minus_one=True, matrix=False),
    "attn_k_norm.weight": TensorRule("self_attn.k_norm.weight", minus_one=True, matrix=False),
    "attn_q.weight": TensorRule("self_attn.q_proj.weight"),
    "attn_k.weight": TensorRule("self_attn.k_proj.weight"),
    "attn_v.weight": TensorRule("self_attn.v_proj.weight"),
    "attn_output.weight": TensorRule("self_attn.o_proj.weight"),
    "ffn_gate.weight": TensorRule("mlp.gate_proj.weight"),
    "ffn_up.weight": TensorRule("mlp.up_proj.weight"),
    "ffn_down.weight": TensorRule("mlp.down_proj.weight"),
}

_TOP = {
    "llama": {
        "token_embd.weight": TensorRule("model.embed_tokens.weight"),
        "output_norm.weight": TensorRule("model.norm.weight", matrix=False),
        "output.weight": TensorRule("lm_head.weight"),
    },
    "gemma3": {
        "token_embd.weight": TensorRule("model.embed_tokens.weight"),
        "output_norm.weight": TensorRule("model.norm.weight", minus_one=True, matrix=False),
        "output.weight": TensorRule("lm_head.weight"),
    },
}
_BLOCKS = {"llama": _LLAMA_BLOCK, "gemma3": _GEMMA3_BLOCK}
_BLK = re.compile(r"blk\.(\d+)\.(.+)")
# Tensors that carry no weights of their own in mlx-lm's layout (handled through config.json).
CONFIG_ONLY = {"rope_freqs.weight"}


def tensor_rule(arch: str, name: str) -> tuple[str, TensorRule] | None:
    """(HF name, rule) for a GGUF tensor name, or None if the architecture has no such tensor."""
    if name in _TOP[arch]:
        rule = _TOP[arch][name]
        return rule.hf, rule
    m = _BLK.fullmatch(name)
    if m and m.group(2) in _BLOCKS[arch]:
        rule = _BLOCKS[arch][m.group(2)]
        return f"model.layers.{m.group(1)}.{rule.hf}", rule
    return None


def check_arch(arch: str | None, source: str) -> str:
    if arch not in SUPPORTED_ARCHS:
        raise UserError(
            f"{source}: GGUF architecture {arch!r} is not supported "
            f"(mlx-dspark imports {' and '.join(SUPPORTED_ARCHS)} GGUF files); "
            "convert that model to an mlx-lm folder with mlx_lm.convert and pass the folder"
        )
    return arch


def _f32(v) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(v)))


def _req(meta: dict, key: str, source: str):
    if key not in meta:
        raise UserError(
            f"{source}: GGUF metadata lacks {key!r}; the file is incomplete or not a {key.split('.')[0]} model"
        )
    return meta[key]


def _rope_scaling(meta: dict, arch: str, source: str) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        factor = float(_req(meta, f"{arch}.rope.scaling.factor", source))
        return {"type": "linear", "rope_type": "linear", "factor": factor}
    raise UserError(f"{source}: RoPE scaling {kind!r} in GGUF files is not supported (only linear)")


def llama3_rope_scaling(factors: np.ndarray, head_dim: int, base: float, source: str) -> dict:
    """Recover HF's llama3 rope_scaling from llama.cpp's `rope_freqs` tensor (per-dim divisors).

    llama.cpp computes them from (factor, low_freq_factor, high_freq_factor, original context);
    we try the published Llama 3.x settings and keep the one that reproduces the tensor."""
    f = np.asarray(factors, dtype=np.float64).reshape(-1)
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    factor = float(f.max())
    for low, high, old in ((1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 2.0, 8192)):
        smooth = (old / wavelen - low) / (high - low)
        want = np.where(
            wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, 1.0 / ((1 - smooth) / factor + smooth))
        )
        if want.shape == f.shape and np.allclose(want, f, rtol=1e-4, atol=1e-6):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": old,
            }
    raise UserError(f"{source}: its rope_freqs tensor matches no Llama 3 RoPE scaling setting mlx-dspark knows")


def build_config(
    arch: str,
    meta: dict,
    shapes: dict[str, tuple[int, ...]],
    source: str,
    rope_freqs: Callable[[], np.ndarray] | None = None,
) -> dict[str, Any]:
    """HF-style config.json for mlx-lm from GGUF metadata. `shapes` maps GGUF names to (rows, cols)."""
    p = arch + "."
    hidden = int(_req(meta, p + "embedding_length", source))
    n_head = int(_req(meta, p + "attention.head_count", source))
    n_kv = int(meta.get(p + "attention.head_count_kv", n_head))
    layers = int(_req(meta, p + "block_count", source))
    if "token_embd.weight" not in shapes:
        raise UserError(f"{source}: the GGUF file has no token_embd.weight tensor")
    vocab = shapes["token_embd.weight"][0]
    head_dim = int(meta.get(p + "attention.key_length", hidden // n_head))
    cfg: dict[str, Any] = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": int(_req(meta, p + "feed_forward_length", source)),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": _f32(_req(meta, p + "attention.layer_norm_rms_epsilon", source)),
        "vocab_size": vocab,
        "max_position_embeddings": int(meta.get(p + "context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in shapes,
    }
    for key, hf in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id")):
        if key in meta:
            cfg[hf] = int(meta[key])
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None and "eos_token_id" in cfg and int(eot) != cfg["eos_token_id"]:
        cfg["eos_token_id"] = [cfg["eos_token_id"], int(eot)]
    scaling = _rope_scaling(meta, arch, source)
    if arch == "llama":
        rot = meta.get(p + "rope.dimension_count")
        if rot is not None and int(rot) != head_dim:
            raise UserError(f"{source}: partial RoPE ({rot} of {head_dim} dims) is not supported for llama GGUF files")
        base = float(meta.get(p + "rope.freq_base", 10000.0))
        if rope_freqs is not None:
            scaling = llama3_rope_scaling(rope_freqs(), head_dim, base, source)
        cfg.update(
            model_type="llama",
            architectures=["LlamaForCausalLM"],
            rope_theta=_f32(base),
            rope_traditional=False,
            rope_scaling=scaling,
            attention_bias="blk.0.attn_q.bias" in shapes,
            mlp_bias=False,
        )
    else:  # gemma3
        # llama.cpp fixes these for Gemma 3 rather than storing them (llama-model.cpp, LLM_ARCH_GEMMA3):
        # a 5:1 local/global layer pattern, local RoPE base 10k, and the 27B's query scale.
        q_scalar = hidden // n_head if layers == 62 else head_dim
        cfg.update(
            model_type="gemma3_text",
            architectures=["Gemma3ForCausalLM"],
            rope_theta=_f32(meta.get(p + "rope.freq_base", 1_000_000.0)),
            rope_local_base_freq=10_000.0,
            rope_scaling=scaling,
            sliding_window=int(meta.get(p + "attention.sliding_window", 512)),
            sliding_window_pattern=6,
            query_pre_attn_scalar=q_scalar,
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
            hidden_activation="gelu_pytorch_tanh",
        )
    if n_head % n_kv:
        raise UserError(f"{source}: {n_head} attention heads do not divide into {n_kv} KV heads")
    return cfg
