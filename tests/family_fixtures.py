"""Tiny random targets of the non-dense families, written in their real Hugging Face layouts.

  qwen3_5      hybrid Gated DeltaNet + full attention; the multimodal checkpoint layout
               (config with text_config, tensors under model.language_model.*), zero-centred
               RMSNorm weights, conv1d stored [C, 1, K] as HF stores it
  qwen3_5_moe  the same with a sparse MoE block (experts packed as gate_up_proj / down_proj)
  qwen3_next   hybrid GDN, MoE (per-expert tensors), flat config
  gemma3_text  sliding-window (RotatingKVCache) layers interleaved with global ones
  qwen3_moe    dense attention, sparse MoE MLP (per-expert tensors), for the MoE path
  gemma4_text  mlx-lm's Gemma 4 text model: sliding / full layers, tied head, logit softcap, and
               the 26B-A4B-style MoE block beside the dense MLP (router + packed experts
               gate_up_proj / down_proj, as the HF checkpoint stores them); `moe=False` drops it

`write_family(path, family, ...)` writes config.json + model.safetensors + the tokenizer of
fixtures.py; `fixtures.write_model` forwards these family names here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "gemma3_text", "qwen3_moe", "gemma4_text")


def _weights(rng, std):
    def w(*shape, s=None):
        return (rng.standard_normal(shape) * (std if s is None else s) / np.sqrt(shape[-1] / 16)).astype(np.float32)

    return w


def _gdn(t, p, w, rng, *, hidden, hk, dk, hv, dv, kernel, packed_qkvz):
    key_dim, value_dim = hk * dk, hv * dv
    conv_dim = 2 * key_dim + value_dim
    if packed_qkvz:  # qwen3_next: per key head [q, k, v-group, z-group], then [b-group, a-group]
        t[p + "in_proj_qkvz.weight"] = w(2 * key_dim + 2 * value_dim, hidden)
        t[p + "in_proj_ba.weight"] = w(2 * hv, hidden)
    else:
        t[p + "in_proj_qkv.weight"] = w(conv_dim, hidden)
        t[p + "in_proj_z.weight"] = w(value_dim, hidden)
        t[p + "in_proj_b.weight"] = w(hv, hidden)
        t[p + "in_proj_a.weight"] = w(hv, hidden)
    t[p + "conv1d.weight"] = (rng.standard_normal((conv_dim, 1, kernel)) * 0.5).astype(np.float32)
    t[p + "dt_bias"] = (rng.standard_normal(hv) * 0.5).astype(np.float32)
    t[p + "A_log"] = np.log(rng.uniform(0.5, 8.0, hv)).astype(np.float32)
    t[p + "norm.weight"] = (1.0 + 0.1 * rng.standard_normal(dv)).astype(np.float32)
    t[p + "out_proj.weight"] = w(hidden, value_dim)


def _zero_centred(rng, n):
    return (0.1 * rng.standard_normal(n)).astype(np.float32)


def _qwen_hybrid(family, vocab, eos, rng, *, layers, hidden, moe, dk=16):
    heads, kv, hd, inter = 4, 2, 16, 128
    hk, hv, dv, kernel = 2, 4, 16, 4
    w = _weights(rng, 0.3)
    text = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "linear_num_value_heads": hv,
        "linear_num_key_heads": hk,
        "linear_key_head_dim": dk,
        "linear_value_head_dim": dv,
        "linear_conv_kernel_dim": kernel,
        "full_attention_interval": 2,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    if moe:
        text.update(
            {
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "decoder_sparse_step": 1,
                "moe_intermediate_size": 64,
                "shared_expert_intermediate_size": 64,
                "norm_topk_prob": True,
                "mlp_only_layers": [],
            }
        )
    if family == "qwen3_next":
        cfg = dict(
            text,
            model_type="qwen3_next",
            architectures=["Qwen3NextForCausalLM"],
            rope_theta=10000.0,
            partial_rotary_factor=0.25,
        )
        prefix = "model."
    else:
        text.update(
            model_type=family + "_text",
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [1, 1, 0],
                "mrope_interleaved": True,
            },
        )
        arch = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
        cfg = {
            "architectures": [arch],
            "model_type": family,
            "text_config": text,
            "tie_word_embeddings": False,
            "eos_token_id": eos,
            "torch_dtype": "float32",
        }
        prefix = "model.language_model."
    t = {
        prefix + "embed_tokens.weight": w(vocab, hidden, s=1.0),
        prefix + "norm.weight": _zero_centred(rng, hidden),
        "lm_head.weight": w(vocab, hidden),
    }
    for i in range(layers):
        p = f"{prefix}layers.{i}."
        if (i + 1) % text["full_attention_interval"]:
            _gdn(
                t,
                p + "linear_attn.",
                w,
                rng,
                hidden=hidden,
                hk=hk,
                dk=dk,
                hv=hv,
                dv=dv,
                kernel=kernel,
                packed_qkvz=family == "qwen3_next",
            )
        else:
            t[p + "self_attn.q_proj.weight"] = w(2 * heads * hd, hidden)  # queries and their gate
            t[p + "self_attn.k_proj.weight"] = w(kv * hd, hidden)
            t[p + "self_attn.v_proj.weight"] = w(kv * hd, hidden)
            t[p + "self_attn.o_proj.weight"] = w(hidden, heads * hd)
            t[p + "self_attn.q_norm.weight"] = _zero_centred(rng, hd)
            t[p + "self_attn.k_norm.weight"] = _zero_centred(rng, hd)
        t[p + "input_layernorm.weight"] = _zero_centred(rng, hidden)
        t[p + "post_attention_layernorm.weight"] = _zero_centred(rng, hidden)
        m = p + "mlp."
        if not moe:
            t[m + "gate_proj.weight"] = w(inter, hidden)
            t[m + "up_proj.weight"] = w(inter, hidden)
            t[m + "down_proj.weight"] = w(hidden, inter)
            continue
        E, mi, si = text["num_experts"], text["moe_intermediate_size"], text["shared_expert_intermediate_size"]
        t[m + "gate.weight"] = w(E, hidden)
        t[m + "shared_expert.gate_proj.weight"] = w(si, hidden)
        t[m + "shared_expert.up_proj.weight"] = w(si, hidden)
        t[m + "shared_expert.down_proj.weight"] = w(hidden, si)
        t[m + "shared_expert_gate.weight"] = w(1, hidden)
        if family == "qwen3_next":
            for e in range(E):
                t[m + f"experts.{e}.gate_proj.weight"] = w(mi, hidden)
                t[m + f"experts.{e}.up_proj.weight"] = w(mi, hidden)
                t[m + f"experts.{e}.down_proj.weight"] = w(hidden, mi)
        else:
            t[m + "experts.gate_up_proj"] = w(E, 2 * mi, hidden)
            t[m + "experts.down_proj"] = w(E, hidden, mi)
    return cfg, t


def _gemma3(vocab, eos, rng, *, layers, hidden, window):
    heads, kv, hd, inter = 2, 1, 32, 128
    w = _weights(rng, 0.3)
    cfg = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "query_pre_attn_scalar": hd,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "sliding_window": window,
        "sliding_window_pattern": 2,
        "rope_theta": 1e6,
        "rope_local_base_freq": 10000.0,
        "max_position_embeddings": 4096,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    t = {"model.embed_tokens.weight": w(vocab, hidden, s=0.1), "model.norm.weight": _zero_centred(rng, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = w(heads * hd, hidden)
        t[p + "self_attn.k_proj.weight"] = w(kv * hd, hidden)
        t[p + "self_attn.v_proj.weight"] = w(kv * hd, hidden)
        t[p + "self_attn.o_proj.weight"] = w(hidden, heads * hd)
        t[p + "self_attn.q_norm.weight"] = _zero_centred(rng, hd)
        t[p + "self_attn.k_norm.weight"] = _zero_centred(rng, hd)
        t[p + "mlp.gate_proj.weight"] = w(inter, hidden)
        t[p + "mlp.up_proj.weight"] = w(inter, hidden)
        t[p + "mlp.down_proj.weight"] = w(hidden, inter)
        for n in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            t[p + n + ".weight"] = _zero_centred(rng, hidden)
    return cfg, t


def _qwen3_moe(vocab, eos, rng, *, layers, hidden):
    heads, kv, hd, E, mi = 4, 2, 16, 4, 64
    w = _weights(rng, 0.3)
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": 128,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "num_experts": E,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": mi,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        "norm_topk_prob": True,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    ones = lambda n: (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    t = {
        "model.embed_tokens.weight": w(vocab, hidden, s=1.0),
        "model.norm.weight": ones(hidden),
        "lm_head.weight": w(vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = w(heads * hd, hidden)
        t[p + "self_attn.k_proj.weight"] = w(kv * hd, hidden)
        t[p + "self_attn.v_proj.weight"] = w(kv * hd, hidden)
        t[p + "self_attn.o_proj.weight"] = w(hidden, heads * hd)
        t[p + "self_attn.q_norm.weight"] = ones(hd)
        t[p + "self_attn.k_norm.weight"] = ones(hd)
        t[p + "input_layernorm.weight"] = ones(hidden)
        t[p + "post_attention_layernorm.weight"] = ones(hidden)
        t[p + "mlp.gate.weight"] = w(E, hidden)
        for e in range(E):
            t[p + f"mlp.experts.{e}.gate_proj.weight"] = w(mi, hidden)
            t[p + f"mlp.experts.{e}.up_proj.weight"] = w(mi, hidden)
            t[p + f"mlp.experts.{e}.down_proj.weight"] = w(hidden, mi)
    return cfg, t


def _gemma4(vocab, eos, rng, *, layers, hidden, window, moe):
    heads, hd, inter, E, mi = 2, 32, 128, 4, 64
    w = _weights(rng, 0.3)
    cfg = {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "head_dim": hd,
        "global_head_dim": hd,
        "num_key_value_heads": 1,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": False,
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0,
        "vocab_size": vocab,
        "vocab_size_per_layer_input": vocab,
        "sliding_window": window,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "use_double_wide_mlp": False,
        "enable_moe_block": moe,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "eos_token_id": eos,
        "torch_dtype": "float32",
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
    }
    if moe:
        cfg.update(num_experts=E, top_k_experts=2, moe_intermediate_size=mi)
    ones = lambda n: (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    t = {"model.embed_tokens.weight": w(vocab, hidden, s=0.1), "model.norm.weight": ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = w(heads * hd, hidden)
        t[p + "self_attn.k_proj.weight"] = w(hd, hidden)
        t[p + "self_attn.v_proj.weight"] = w(hd, hidden)
        t[p + "self_attn.o_proj.weight"] = w(hidden, heads * hd)
        t[p + "self_attn.q_norm.weight"] = ones(hd)
        t[p + "self_attn.k_norm.weight"] = ones(hd)
        t[p + "mlp.gate_proj.weight"] = w(inter, hidden)
        t[p + "mlp.up_proj.weight"] = w(inter, hidden)
        t[p + "mlp.down_proj.weight"] = w(hidden, inter)
        norms = [
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ]
        if moe:
            norms += ["post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"]
            t[p + "router.proj.weight"] = w(E, hidden)
            t[p + "router.scale"] = ones(hidden)
            t[p + "router.per_expert_scale"] = ones(E)
            t[p + "experts.gate_up_proj"] = w(E, 2 * mi, hidden)
            t[p + "experts.down_proj"] = w(E, hidden, mi)
        for n in norms:
            t[p + n + ".weight"] = ones(hidden)
        t[p + "layer_scalar"] = np.array([1.0], np.float32)
    return cfg, t


def write_family(
    path,
    family: str,
    *,
    layers: int = 4,
    hidden: int = 64,
    seed: int = 0,
    window: int = 8,
    vocab_size: int = 384,
    gdn_key_dim: int = 16,
    moe: bool = True,
) -> Path:
    """A random `family` model (see FAMILIES) in its HF layout, tokenizer included.
    `window` is gemma3_text's sliding window (short, so conversations run past it);
    `gdn_key_dim` the hybrids' GDN key head dimension (the native kernel takes multiples of 32);
    `moe` gemma4_text's MoE block (the other families' MoE is fixed by the family)."""
    from fixtures import _trained_tokenizer_json, write_tokenizer
    from safetensors.numpy import save_file

    if family not in FAMILIES:
        raise ValueError(family)
    path = Path(path)
    if path.exists():
        shutil.rmtree(path)
    vocab = write_tokenizer(path, vocab_size)
    eos = json.loads(_trained_tokenizer_json(vocab_size))["model"]["vocab"]["<|im_end|>"]
    rng = np.random.default_rng(seed)
    if family == "gemma3_text":
        cfg, t = _gemma3(vocab, eos, rng, layers=layers, hidden=hidden, window=window)
    elif family == "qwen3_moe":
        cfg, t = _qwen3_moe(vocab, eos, rng, layers=layers, hidden=hidden)
    elif family == "gemma4_text":
        cfg, t = _gemma4(vocab, eos, rng, layers=layers, hidden=hidden, window=window, moe=moe)
    else:
        cfg, t = _qwen_hybrid(
            family,
            vocab,
            eos,
            rng,
            layers=layers,
            hidden=hidden,
            moe=family in ("qwen3_5_moe", "qwen3_next"),
            dk=gdn_key_dim,
        )
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def text_view(target_dir, out_dir) -> Path:
    """A folder holding the text config and the embedding of a target (the inputs a drafter
    fixture writer reads: config.json's hidden_size / num_hidden_layers / vocab_size and
    model.embed_tokens.weight / lm_head.weight), for targets whose checkpoint nests them."""
    from safetensors.numpy import load_file, save_file

    target_dir, out_dir = Path(target_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((target_dir / "config.json").read_text())
    text = dict(cfg.get("text_config", cfg))
    text.pop("model_type", None)
    text["model_type"] = cfg["model_type"]
    (out_dir / "config.json").write_text(json.dumps(text, indent=1))
    t = load_file(str(target_dir / "model.safetensors"))
    emb = next(v for k, v in t.items() if k.endswith("embed_tokens.weight"))
    view = {"model.embed_tokens.weight": emb}
    if "lm_head.weight" in t:
        view["lm_head.weight"] = t["lm_head.weight"]
    save_file(view, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
