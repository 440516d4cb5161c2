"""Tiny random multimodal Gemma checkpoints for mlx-vlm, written in the layout mlx-vlm's own
converter writes (the mlx-community layout): config.json with text_config + vision_config,
model.safetensors with language_model.* / vision_tower.* / multi_modal_projector.* tensors as
mlx-vlm names them, and the tokenizer of fixtures.py.

  gemma3  mlx-vlm's gemma3 (SigLIP tower), sliding-window layers every other layer
  gemma4  mlx-vlm's gemma4 (its own vision tower, tied head, logit softcap), sliding / full

The weights are mlx-vlm's own random initialisation under a fixed seed; the text part has a
short sliding window so a conversation runs past it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

KINDS = ("gemma3", "gemma4")


def _configs(kind: str, vocab: int, *, layers: int, hidden: int, window: int, eos: int) -> tuple[dict, dict, dict]:
    if kind == "gemma3":
        text = {
            "model_type": "gemma3_text",
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "intermediate_size": 128,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "rms_norm_eps": 1e-6,
            "vocab_size": vocab,
            "sliding_window": window,
            "sliding_window_pattern": 2,
            "rope_global_base_freq": 1e6,
            "rope_local_base_freq": 1e4,
            "max_position_embeddings": 4096,
            "mm_tokens_per_image": 4,
        }
        vision = {
            "model_type": "siglip_vision_model",
            "num_hidden_layers": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "patch_size": 14,
            "image_size": 56,
        }
        top = {"vocab_size": vocab, "image_token_index": vocab - 1, "mm_tokens_per_image": 4}
    else:
        text = {
            "model_type": "gemma4_text",
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "intermediate_size": 128,
            "num_attention_heads": 2,
            "head_dim": 32,
            "global_head_dim": 32,
            "num_key_value_heads": 1,
            "num_global_key_value_heads": 1,
            "num_kv_shared_layers": 0,
            "hidden_size_per_layer_input": 0,
            "vocab_size": vocab,
            "vocab_size_per_layer_input": vocab,
            "sliding_window": window,
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            "use_double_wide_mlp": False,
            "enable_moe_block": False,
            "final_logit_softcapping": 30.0,
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096,
            "rope_parameters": {
                "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
            },
        }
        vision = {
            "model_type": "gemma4_vision",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "global_head_dim": 16,
            "patch_size": 4,
            "position_embedding_size": 64,
            "pooling_kernel_size": 2,
            "default_output_length": 4,
        }
        top = {
            "vocab_size": vocab,
            "hidden_size": hidden,
            "image_token_id": vocab - 1,
            "audio_token_id": vocab - 2,
            "boi_token_id": vocab - 3,
            "eoi_token_id": vocab - 4,
            "boa_token_id": vocab - 5,
            "eoa_token_id": vocab - 6,
            "vision_soft_tokens_per_image": 4,
        }
    text["eos_token_id"] = eos
    return text, vision, top


def write_vlm_gemma(path, kind: str = "gemma3", *, layers: int = 4, hidden: int = 64, window: int = 8, seed: int = 0):
    """A random multimodal `kind` checkpoint (see KINDS) at `path`."""
    import mlx.core as mx
    from fixtures import _trained_tokenizer_json, write_tokenizer
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args

    if kind not in KINDS:
        raise ValueError(kind)
    path = Path(path)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    vocab = write_tokenizer(path, 384)
    eos = json.loads(_trained_tokenizer_json(384))["model"]["vocab"]["<|im_end|>"]
    text, vision, top = _configs(kind, vocab, layers=layers, hidden=hidden, window=window, eos=eos)
    cfg = {"architectures": [f"{kind.capitalize()}ForConditionalGeneration"], "model_type": kind}
    cfg.update(top, text_config=text, vision_config=vision, eos_token_id=eos, torch_dtype="float32")
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    arch, _ = get_model_and_args(cfg)
    mc = arch.ModelConfig.from_dict(cfg)
    mc.text_config = arch.TextConfig.from_dict(text)
    mc.vision_config = arch.VisionConfig.from_dict(vision)
    mx.random.seed(seed)
    model = arch.Model(mc)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path
