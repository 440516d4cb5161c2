"""Context extension: RoPE scaling for a served window longer than the model was trained for.

A model trained for N positions (config `max_position_embeddings`) writes noise when its prompt
is far past N: the demo SmolLM2-135M (N = 8,192) given Claude Code's 20k-token default prompt
never ends its turn (bench/results/claude-code-cpu.md). `serve --context-window W` with W > N
can rescale the model's rotary positions so that W fits the rotations it was trained on:

  yarn    YaRN (NTK-by-parts interpolation with attention temperature), factor W / N, over the
          trained N: high-frequency dimensions untouched, low ones interpolated
  linear  position interpolation: every position divided by W / N
  none    the positions as trained (past N the model is out of its depth)

The block goes into the checkpoint's config as `rope_scaling` before mlx-lm builds the model, so
mlx-lm's own RoPE classes (mlx_lm/models/rope_utils.py) run it, and the loaded model is checked
to have taken it (some families build their RoPE without reading `rope_scaling`): it is refused,
never dropped unsaid. The scaled model is the target: every decoding mode verifies against it,
so speculative output stays identical to plain decoding of the same scaled model. It changes the
model's arithmetic at every position (short prompts too), which is why it is said at start.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError, option

KINDS = ("auto", "yarn", "linear", "none")


def text_config(config: dict) -> dict:
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def trained_window(config: dict) -> int | None:
    return int(text_config(config).get("max_position_embeddings") or 0) or None


def own_scaling(config: dict) -> str | None:
    """The RoPE scaling the checkpoint already has (its type), or None."""
    block = text_config(config).get("rope_scaling")
    if not isinstance(block, dict):
        return None
    kind = block.get("rope_type") or block.get("type") or "default"
    return None if kind == "default" else str(kind)


def plan(config: dict, window: int | None, kind: str = "none") -> dict | None:
    """The `rope_scaling` block that serves `window` tokens with `kind` (KINDS), or None when the
    model runs as trained (kind none, no window, or a window within the trained one).

    auto is yarn when the window is past the trained one and the model has no scaling of its own,
    else none. An explicit yarn / linear on a model that already scales its RoPE is refused (they
    do not stack)."""
    if kind not in KINDS:
        raise UserError(f"{option('rope-scaling')} must be one of {', '.join(KINDS)}, got {kind!r}")
    trained = trained_window(config)
    if kind == "none" or window is None or trained is None or window <= trained:
        return None
    has = own_scaling(config)
    if has is not None:
        if kind == "auto":
            return None
        raise UserError(
            f"this model already scales its RoPE ({has}, trained window {trained}): {option('rope-scaling')} "
            f"{kind} does not stack on it; pass {option('rope-scaling')} none"
        )
    factor = window / trained
    if kind in ("auto", "yarn"):
        return {"rope_type": "yarn", "type": "yarn", "factor": factor, "original_max_position_embeddings": trained}
    return {"rope_type": "linear", "type": "linear", "factor": factor}


def model_config(config: dict, block: dict) -> dict:
    """The mlx-lm `model_config` override that puts `block` into the config (nested text
    configs of multimodal checkpoints included)."""
    if isinstance(config.get("text_config"), dict):
        return {"text_config": {**config["text_config"], "rope_scaling": block}}
    return {"rope_scaling": block}


def read_config(path: Path) -> dict:
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def describe(block: dict | None) -> str:
    if not block:
        return "none"
    return f"{block['rope_type']} x{block['factor']:g}"


def not_applied(model, block: dict, source: str) -> str | None:
    """None when every RoPE module of `model` took `block` (a YarnRoPE for yarn, an nn.RoPE with
    scale 1/factor for linear), else why not: some families build their RoPE without reading
    rope_scaling."""
    import mlx.nn as nn
    from mlx_lm.models.rope_utils import YarnRoPE

    ropes = [m for _, m in model.named_modules() if isinstance(m, (nn.RoPE, YarnRoPE))]
    if block["rope_type"] == "yarn":
        ok = bool(ropes) and all(isinstance(m, YarnRoPE) for m in ropes)
    else:
        want = 1.0 / block["factor"]
        ok = bool(ropes) and all(isinstance(m, nn.RoPE) and abs(m.scale - want) < 1e-9 for m in ropes)
    if ok:
        return None
    return (
        f"{option('rope-scaling')} {block['rope_type']}: {source}'s attention did not take it (mlx-lm builds this "
        f"family's RoPE without reading rope_scaling); pass {option('rope-scaling')} none, or a smaller "
        f"{option('context-window')}"
    )
