"""Resolving and loading targets: a local folder, an HF repo id, or a .gguf file."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..errors import UserError, option
from .precision import DTYPES, cast_model, cast_scales_f32, default_dtype
from .target import Target


def resolve_model_path(model: str) -> Path:
    """A local folder as is; otherwise an HF repo id, downloaded like mlx-lm does."""
    if not model or not str(model).strip():
        raise UserError(f"{option('model')} is empty: pass a local model folder, a .gguf file or an HF repo id")
    p = Path(model).expanduser()
    if p.exists():
        if p.is_dir() and not (p / "config.json").exists():
            raise UserError(
                f"{p} is not a model folder: it has no config.json "
                "(expected an mlx-lm / Hugging Face layout: config.json + *.safetensors + tokenizer files)"
            )
        return p
    looks_local = model.startswith((".", "/", "~")) or model.count("/") != 1
    if looks_local:
        raise UserError(
            f"model path {model!r} does not exist (pass a local folder, a .gguf file, or an HF repo id like org/name)"
        )
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                model,
                allow_patterns=["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"],
            )
        )
    except Exception as e:  # network, auth, missing repo
        raise UserError(
            f"could not fetch {model!r} from the Hugging Face hub ({type(e).__name__}: {e}); "
            "pass a local folder or .gguf file with --model"
        ) from None


def trained_window_of(model: str | None, *, dtype: str | None = None, quantize: int | None = None) -> int | None:
    """The window `model` was trained for (its config's max_position_embeddings), or None when it
    does not say. A .gguf file is converted (cached) as `load_target` would."""
    from . import rope
    from .demo import model_or_demo

    model = model_or_demo(model)
    if str(model).lower().endswith(".gguf"):
        from .gguf import convert_gguf_cached

        path = convert_gguf_cached(Path(model).expanduser(), dtype=dtype or default_dtype(), quantize=quantize)
    else:
        path = resolve_model_path(model)
    return rope.trained_window(rope.read_config(path))


def load_target(
    model: str | None = None,
    *,
    dtype: str | None = None,
    quantize: int | None = None,
    kv_bits: int | None = None,
    probe: bool = True,
    taps=(),
    context_window: int | None = None,
    rope_scaling: str = "none",
) -> tuple[Target, object]:
    """Load a target and its tokenizer. Returns (target, tokenizer). `model=None`: the demo model.

    `context_window` past the model's trained window with `rope_scaling` yarn, linear or auto
    rescales its RoPE (models/rope.py); `target.rope_scaling` is the block applied, or None."""
    from .demo import model_or_demo

    model = model_or_demo(model)
    if kv_bits not in (None, 0, 2, 3, 4, 6, 8):
        raise UserError(f"{option('kv-bits')} must be one of 2, 3, 4, 6, 8, got {kv_bits}")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"{option('dtype')} must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if quantize not in (None, 0, 4, 8):
        raise UserError(f"{option('quantize')} must be 4 or 8, got {quantize}")
    source = str(model)
    if str(model).lower().endswith(".gguf"):
        from .gguf import convert_gguf_cached

        path = convert_gguf_cached(Path(model).expanduser(), dtype=dtype or default_dtype(), quantize=quantize)
        dtype = None  # the converted folder already has the requested precision
        quantize = None
    else:
        path = resolve_model_path(model)

    from mlx_lm.utils import load as mlx_load

    from .checkpoints import check_safetensors

    check_safetensors(path)
    from . import vlm
    from .packs import refuse_unsupported_pack

    refuse_unsupported_pack(path, source)  # the 1-bit Bonsai pack: a pointer to plain mlx-vlm

    from . import rope

    scaling = rope.plan(rope.read_config(path), context_window, rope_scaling)
    skipped = None
    try:
        if vlm.wants_vlm(path):  # a multimodal Gemma checkpoint: through mlx-vlm (models/vlm.py)
            if scaling is not None:
                raise UserError(f"{option('rope-scaling')} is not supported on multimodal checkpoints: pass none")
            net, tokenizer, config = vlm.load(path)
        elif scaling is not None:
            override = rope.model_config(rope.read_config(path), scaling)
            net, tokenizer, config = mlx_load(str(path), model_config=override, return_config=True)
            not_taken = rope.not_applied(net, scaling, source)
            if not_taken and rope_scaling != "auto":
                raise UserError(not_taken)
            if not_taken:  # auto: the model as trained, and `serve` says why
                skipped = not_taken
                scaling = None
                net, tokenizer, config = mlx_load(str(path), return_config=True)
        else:
            net, tokenizer, config = mlx_load(str(path), return_config=True)
    except UserError:
        raise
    except (ValueError, FileNotFoundError, KeyError, json.JSONDecodeError) as e:
        raise UserError(f"could not load {source}: {e}") from None
    if dtype is not None:
        cast_model(net, DTYPES[dtype])
    if quantize:
        nn.quantize(net, group_size=64, bits=int(quantize))
        if mx.default_device() == mx.cpu:
            cast_scales_f32(net)
    target = Target(net, tokenizer, config, name=Path(str(path)).name, kv_bits=kv_bits or None, source=source)
    target.rope_scaling = scaling
    target.rope_scaling_skipped = skipped  # why auto left the RoPE as trained, or None
    if probe:
        target.probe(taps)
    return target, tokenizer
