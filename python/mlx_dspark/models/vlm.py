"""Gemma 3 / Gemma 4 targets through mlx-vlm (the `[gemma]` extra: `pip install 'mlx-dspark[gemma]'`).

A multimodal Gemma checkpoint (config.json with `model_type` gemma3 or gemma4 and a
`vision_config`) loads through mlx-vlm's own loader and model code (`mlx_vlm.utils.load_model`),
the route mlx-vlm users take; the tokenizer is mlx-lm's TokenizerWrapper over the same folder
(the processor, which images need, is not loaded: speculation is over text). `VLMText` puts
mlx-vlm's language model behind the interface a Target reads (mlx-lm's): `__call__(tokens,
cache)` returns logits, `layers`, `language_model.model` (embed_tokens, the final-normed hidden
states), and `make_cache()`.

Caches. mlx-vlm builds its own KVCache / RotatingKVCache classes; `make_cache()` returns
mlx-lm's classes of the same kinds and sizes instead (the same update arithmetic: mlx-vlm's are
copies of mlx-lm's, with extra bookkeeping for its server), so the sliding-window rollback of
models/sliding.py applies unchanged. Tests check that decoding through them is token-identical
to mlx-vlm's own greedy generation with its own caches.

Which route a Gemma checkpoint takes: mlx-vlm when it is installed (or MLX_DSPARK_GEMMA_LOADER=
mlx-vlm, an error naming the extra if it is not), mlx-lm when MLX_DSPARK_GEMMA_LOADER=mlx-lm or
mlx-vlm is missing (mlx-lm's gemma3 / gemma4 modules read the same checkpoints, text only).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.nn as nn

from ..errors import UserError

VLM_TYPES = ("gemma3", "gemma4")
EXTRA_HINT = "install the Gemma extra: pip install 'mlx-dspark[gemma]' (it brings mlx-vlm)"


def read_config(path: Path) -> dict:
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def vlm_available() -> bool:
    from importlib.util import find_spec

    return find_spec("mlx_vlm") is not None


def wants_vlm(path: Path) -> bool:
    """Whether this folder loads through mlx-vlm: a multimodal Gemma checkpoint, mlx-vlm installed
    (or forced with MLX_DSPARK_GEMMA_LOADER=mlx-vlm), unless MLX_DSPARK_GEMMA_LOADER=mlx-lm."""
    cfg = read_config(path)
    if cfg.get("model_type") not in VLM_TYPES or not isinstance(cfg.get("vision_config"), dict):
        return False
    choice = os.environ.get("MLX_DSPARK_GEMMA_LOADER", "auto")
    if choice not in ("auto", "mlx-vlm", "mlx-lm"):
        raise UserError(f"MLX_DSPARK_GEMMA_LOADER must be auto, mlx-vlm or mlx-lm, got {choice!r}")
    if choice == "mlx-lm":
        return False
    if choice == "mlx-vlm" and not vlm_available():
        raise UserError(f"MLX_DSPARK_GEMMA_LOADER=mlx-vlm but mlx-vlm is not installed; {EXTRA_HINT}")
    return vlm_available()


class VLMText(nn.Module):
    """mlx-vlm's multimodal Gemma as a text model with mlx-lm's interface (see the module doc)."""

    def __init__(self, vlm_model: nn.Module):
        super().__init__()
        self.language_model = vlm_model.language_model
        self.model_type = getattr(getattr(vlm_model, "config", None), "model_type", "gemma")

    @property
    def layers(self):
        return self.language_model.layers

    def __call__(self, inputs, cache=None, **kwargs):
        return self.language_model(inputs, cache=cache, **kwargs).logits

    def make_cache(self) -> list:
        from mlx_lm.models.cache import KVCache, RotatingKVCache

        out = []
        for c in self.language_model.make_cache():
            kind = type(c).__name__
            if kind == "KVCache":
                out.append(KVCache())
            elif kind == "RotatingKVCache":
                out.append(RotatingKVCache(max_size=c.max_size, keep=c.keep))
            else:
                raise UserError(
                    f"mlx-vlm's {self.model_type} uses a {kind} cache, which mlx-dspark cannot roll back; "
                    "set MLX_DSPARK_GEMMA_LOADER=mlx-lm to load it through mlx-lm"
                )
        return out


def load(path: Path) -> tuple[VLMText, object, dict]:
    """(model, tokenizer, config) of a multimodal Gemma folder, through mlx-vlm."""
    from .. import compat

    try:
        compat.vlm_rope_utils()  # mlx-vlm's modules import it; either layout (compat.py)
        from mlx_vlm.utils import load_model
    except ImportError as e:
        raise UserError(f"could not import mlx-vlm ({e}); {EXTRA_HINT}") from None
    compat.apply_vlm_video_processor_shim()  # only where the installed versions need it
    from mlx_lm.utils import load_tokenizer

    config = read_config(path)
    try:
        vlm_model = load_model(Path(path))
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise UserError(f"mlx-vlm could not load {path}: {e}") from None
    eos = config.get("eos_token_id", config.get("text_config", {}).get("eos_token_id"))
    tokenizer = load_tokenizer(Path(path), eos_token_ids=[eos] if isinstance(eos, int) else eos)
    return VLMText(vlm_model), tokenizer, config
