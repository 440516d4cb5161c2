"""PrismML Bonsai-style packs of a tiny random qwen3_5 hybrid, written to disk as the packs are:

  write_ternary(path)  mlx-lm's `prism_hadamard_qwen35` (schema 1, the text-only namespace):
                       2-bit affine weights (group 128) with a signed blockwise Hadamard rotation
                       folded into the input axis of the packed modules listed in the config's
                       manifest (`modules`), their sign vectors stored next to them
  write_one_bit(path)  the 1-bit pack: a qwen3_5 checkpoint whose config quantizes to 1 bit
                       (mlx-vlm's Python-hosted 1-bit kernels run it; mlx-dspark refuses it)

Both start from tests/family_fixtures.py's qwen3_5 layout (tokenizer included) at hidden 512
(the smallest Hadamard block mlx-lm takes), the packed widths being multiples of 128.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# packed modules (path relative to the text model) and their Hadamard blocks (0: no rotation)
PACKED = (
    ("linear_attn.in_proj_qkv", 512),
    ("linear_attn.in_proj_z", 512),
    ("mlp.gate_proj", 512),
    ("mlp.up_proj", 0),
    ("mlp.down_proj", 0),
)


def _base(path, seed):
    from family_fixtures import write_family

    return write_family(path, "qwen3_5", hidden=512, seed=seed)


def write_ternary(path, *, seed: int = 0, layers: int = 4) -> Path:
    import mlx.core as mx
    from safetensors.numpy import load_file, save_file

    path = _base(path, seed)
    cfg = json.loads((path / "config.json").read_text())
    t = load_file(str(path / "model.safetensors"))
    rng = np.random.default_rng(seed + 100)
    modules = []
    for i in range(layers):
        for rel, block in PACKED:
            p = f"model.language_model.layers.{i}.{rel}"
            if p + ".weight" not in t:
                continue  # attention layers have no linear_attn
            w = t.pop(p + ".weight")
            wq, scales, biases = mx.quantize(mx.array(w), group_size=128, bits=2)
            t[p + ".weight"] = np.array(wq)
            t[p + ".scales"] = np.array(scales.astype(mx.float16))
            t[p + ".biases"] = np.array(biases.astype(mx.float16))
            if block:
                t[p + ".signs"] = rng.choice([-1.0, 1.0], size=w.shape[1]).astype(np.float32)
            modules.append({"path": f"model.layers.{i}.{rel}", "embedding": False, "dtype": "float16", "block": block})
    # the text-only namespace is keyed like qwen3_5.TextModel
    t = {k.replace("model.language_model.", "model."): v for k, v in t.items()}
    cfg.update(
        model_type="prism_hadamard_qwen35",
        schema_version=1,
        tensor_namespace="mlx-lm-text",
        gdn_activation_layout="grouped",
        quantization={"bits": 2, "group_size": 128, "mode": "affine"},
        modules=modules,
    )
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(t, str(path / "model.safetensors"), metadata={"format": "mlx"})
    return path


def write_one_bit(path, *, seed: int = 0) -> Path:
    path = _base(path, seed)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization"] = {"bits": 1, "group_size": 128}
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path
