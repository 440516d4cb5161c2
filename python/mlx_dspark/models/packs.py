"""Weight packs mlx-dspark refuses at load, with what to use instead.

PrismML's Bonsai comes as a ternary 2-bit pack (mlx-lm's `prism_hadamard_qwen35`: 2-bit affine
weights with a Hadamard rotation folded in) and a 1-bit pack. The 2-bit one is a qwen3_5 hybrid
and runs every mode through the hybrid path (models/hybrid.py). The 1-bit one (a config that
quantizes to 1 bit, run by mlx-vlm's Python-hosted 1-bit kernels) is refused: its matmul
re-reads the whole weight stream once per verified token, so a verify of w tokens costs about
w plain steps and speculation measured a net loss there (0.71-0.77x of baseline upstream).
Plain generation with mlx-vlm is the right tool for it.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError


def _bits(config: dict) -> set:
    out = set()
    for key in ("quantization", "quantization_config"):
        q = config.get(key)
        if isinstance(q, dict):
            out.add(q.get("bits"))
            out.update(v.get("bits") for v in q.values() if isinstance(v, dict))  # per-module overrides
    text = config.get("text_config")
    if isinstance(text, dict) and text is not config:
        out |= _bits(text)
    return out - {None}


def one_bit_refusal(config: dict, source: str) -> str | None:
    """The one-line refusal for a 1-bit pack (None for anything else)."""
    if 1 not in _bits(config):
        return None
    return (
        f"{source} is a 1-bit pack, which mlx-dspark does not run: its 1-bit matmul re-reads all weights for "
        "every verified token, so speculative decoding is a net loss there; generate with plain mlx-vlm >= 0.6.5 "
        f"instead (python -m mlx_vlm.generate --model {source} --prompt ...), or use the ternary 2-bit pack"
    )


def refuse_unsupported_pack(path: Path, source: str) -> None:
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return  # the loader reports an unreadable config
    why = one_bit_refusal(config, source)
    if why:
        raise UserError(why)
