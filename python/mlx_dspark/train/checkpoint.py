"""What `distill` writes: the drafter's config and weights, the resumable training state, the
compact export for shipping.

Checkpoint = DeepSpec's layout (deepspec/modeling/dspark/*/config.py, build_draft_config):
`config.json` built from the target's (text) config with DeepSpec's keys added, and
`model.safetensors` with top-level tensor names (`fc.weight`, `layers.N...`, `markov_head...`,
`confidence_head...`, `embed_tokens.weight`, `lm_head.weight`: frozen copies of the target's),
bf16 like the released checkpoints. Architecture
`Qwen3DSparkModel` for every target; with `--kind dflash --layout deepspec` the Markov and
confidence heads are off (DeepSpec's DFlash packaging). models/checkpoints.py loads it 1:1
(`--drafter DIR`).

`--kind dflash` (layout zlab, the default) writes z-lab's layout instead: architectures
`DFlashDraftModel` (+ its `auto_map`), `block_size` and `num_target_layers` at the top level,
`dflash_config {mask_token_id, target_layer_ids}`, and only the backbone's tensors (fc,
hidden_norm, layers.N.*, norm): no embed / lm_head, which z-lab binds to the target's. Slot 0
is the anchor only; slots 1..B-1 are the B-1 drafts.

Compact export (`--export DIR`): the same without the embed_tokens / lm_head copies, which are
the target's own matrices; `config.json` says so with `"embeddings_from_target": true` and the
loader binds the target's (as z-lab checkpoints are bound). Small enough to commit.

Training state (`DIR/train_state/`): float32 trainable weights, the optimizer state and the
data/RNG position, written atomically; `--resume` continues from it.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import UserError
from ..models.checkpoints import DrafterSpec
from ..models.drafter_backbone import BackboneConfig

STATE_DIR = "train_state"
# Target-config fields that describe the target's own depth/attention layout, not the drafter's.
_DROP = (
    "layer_types",
    "sliding_window",
    "rope_scaling",
    "rope_theta",
    "quantization",
    "quantization_config",
    "auto_map",
    "num_kv_shared_layers",
    "text_config",
)


def default_taps(num_layers: int, n: int = 5) -> list[int]:
    """n taps spread over the target's layers, never its last one (as DeepSpec's configs pick them):
    z-lab's formula (evenly from 1 to L-3) where it gives n distinct layers, else evenly over 0..L-2."""
    if num_layers < 2:
        raise UserError(f"the target has {num_layers} layer(s); a drafter needs at least 2 to tap")
    n = max(1, min(n, num_layers - 1))
    if num_layers - 3 >= n:
        taps = [int(round(1 + i * (num_layers - 4) / max(n - 1, 1))) for i in range(n)]
        if len(set(taps)) == n:
            return taps
    last = num_layers - 2
    return sorted({int(round(i * last / max(n - 1, 1))) for i in range(n)})


def check_taps(taps, num_layers: int) -> list[int]:
    taps = [int(t) for t in taps]
    if not taps:
        raise UserError("--taps is empty")
    for t in taps:
        if t == num_layers - 1:
            raise UserError(
                f"tap layer {t} is the target's final layer: its output is not a DSpark/DFlash feature "
                f"(taps must be in 0..{num_layers - 2})"
            )
        if not 0 <= t < num_layers - 1:
            raise UserError(
                f"tap layer {t} is out of range for a target with {num_layers} layers "
                f"(taps must be in 0..{num_layers - 2})"
            )
    if len(set(taps)) != len(taps):
        raise UserError(f"--taps has repeated layers: {taps}")
    return taps


def pick_mask_token(tokenizer, vocab_size: int) -> int:
    """A token that never appears in chat text: the highest-id added/special token that is not
    BOS/EOS/PAD and not used by the chat template; else the last id of the vocabulary."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    avoid = {getattr(hf, n, None) for n in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id")}
    avoid |= set(getattr(tokenizer, "eos_token_ids", None) or [])
    try:
        probe = tokenizer.apply_chat_template(
            [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a"},
            ],
            tokenize=True,
        )
        avoid |= set(int(t) for t in probe)
    except Exception:
        pass
    try:
        added = sorted(int(i) for i in getattr(hf, "added_tokens_decoder", {}) or {})
    except Exception:
        added = []
    for i in reversed(added):
        if i not in avoid and 0 <= i < vocab_size:
            return i
    return vocab_size - 1


def text_config(config: dict) -> dict:
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def drafter_config(
    target,
    *,
    kind: str,
    layers: int,
    block_size: int,
    taps,
    mask_token_id: int,
    markov_rank: int,
    intermediate_size: int | None,
    num_anchors: int,
    layout: str = "deepspec",
) -> dict:
    """The drafter's HF config.json: a copy of the target's text config, DeepSpec's keys on top
    (layout "zlab": z-lab DFlash's keys instead)."""
    tc = copy.deepcopy(text_config(target.config))
    for k in _DROP:
        tc.pop(k, None)
    H = target.hidden_size
    heads = int(tc.get("num_attention_heads") or max(H // 64, 1))
    theta = text_config(target.config).get("rope_theta") or 10000.0
    dspark = kind == "dspark"
    tc.update(
        {
            "architectures": ["Qwen3DSparkModel"],
            "model_type": "qwen3",
            "hidden_size": H,
            "num_target_layers": target.num_layers,
            "num_hidden_layers": layers,
            "layer_types": ["full_attention"] * layers,
            "block_size": block_size,
            "mask_token_id": mask_token_id,
            "target_layer_ids": list(taps),
            "num_anchors": num_anchors,
            "tie_word_embeddings": False,
            "vocab_size": target.vocab_size,
            "num_attention_heads": heads,
            "num_key_value_heads": int(tc.get("num_key_value_heads") or heads),
            "head_dim": int(tc.get("head_dim") or H // heads),
            "intermediate_size": int(intermediate_size or tc.get("intermediate_size") or 4 * H),
            "rms_norm_eps": float(tc.get("rms_norm_eps") or 1e-6),
            "attention_bias": False,
            "rope_parameters": {"rope_theta": float(theta), "rope_type": "default"},
            "hidden_act": "silu",
            "dtype": "bfloat16",
            "enable_confidence_head": dspark,
            "markov_rank": markov_rank if dspark else 0,
        }
    )
    tc.pop("torch_dtype", None)
    if layout == "zlab":
        for k in ("mask_token_id", "target_layer_ids", "num_anchors", "enable_confidence_head", "markov_rank"):
            tc.pop(k)
        tc.update(
            {
                "architectures": ["DFlashDraftModel"],
                "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
                "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(taps)},
            }
        )
        return tc
    if dspark:
        tc["confidence_head_with_markov"] = markov_rank > 0
        if markov_rank > 0:
            tc["markov_head_type"] = "vanilla"
    return tc


def is_zlab(cfg: dict) -> bool:
    """A config in z-lab DFlash's layout (drafter_config(layout="zlab"))."""
    return "DFlashDraftModel" in (cfg.get("architectures") or [])


def spec_from_config(cfg: dict, path: Path) -> DrafterSpec:
    """The DrafterSpec our loader would build from this config (fresh weights, no files yet)."""
    H, heads, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    taps = tuple(cfg["dflash_config"]["target_layer_ids"] if is_zlab(cfg) else cfg["target_layer_ids"])
    b = BackboneConfig(
        style="qwen3",
        hidden_size=H,
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg["num_key_value_heads"],
        head_dim=hd,
        intermediate_size=cfg["intermediate_size"],
        context_dim=len(taps) * H,
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=cfg["rope_parameters"]["rope_theta"],
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 32768),
    )
    rank = int(cfg.get("markov_rank") or 0)
    conf = bool(cfg.get("enable_confidence_head"))
    packaging = "deepspec-dspark" if rank > 0 or conf else "deepspec-dflash"
    if is_zlab(cfg):
        packaging, dcfg = "zlab-dflash", cfg["dflash_config"]
        taps, mask = tuple(dcfg["target_layer_ids"]), dcfg["mask_token_id"]
    else:
        mask = cfg["mask_token_id"]
    cap = cfg.get("final_logit_softcapping")
    return DrafterSpec(
        packaging,
        "qwen3",
        path,
        str(path),
        cfg,
        b,
        cfg["vocab_size"],
        cfg["block_size"],
        mask,
        taps,
        markov_rank=rank,
        confidence=conf,
        confidence_with_markov=bool(cfg.get("confidence_head_with_markov")) and conf and rank > 0,
        softcap=float(cap) if cap else None,
        num_target_layers=cfg["num_target_layers"],
    )


# ------------------------------------------------------------------------------ weights
def target_matrices(target, dtype=mx.float32) -> tuple[mx.array, mx.array]:
    """(input embedding [V, H], output head [V, H]) of the target, dequantized, in `dtype`."""

    def dense(m) -> mx.array:
        if hasattr(m, "scales"):
            return mx.dequantize(
                m.weight,
                m.scales,
                getattr(m, "biases", None),
                m.group_size,
                m.bits,
                **({"mode": m.mode} if getattr(m, "mode", "affine") != "affine" else {}),
            )
        return m.weight

    emb = dense(target.embed_tokens).astype(dtype)
    m = target.model
    tied = getattr(getattr(m, "args", None), "tie_word_embeddings", False)
    head_mod = getattr(m, "lm_head", None)
    if head_mod is None:
        lm = getattr(m, "language_model", None)
        head_mod = getattr(lm, "lm_head", None) if lm is not None else None
    head = emb if (head_mod is None or tied) else dense(head_mod).astype(dtype)
    return emb, head


def init_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """HF-style init (normal, std = initializer_range) for matrices, ones for norms, zero biases."""
    mx.random.seed(seed)
    new = []
    for name, p in tree_flatten(model.parameters()):
        if name.startswith(("embed_tokens", "lm_head")):
            continue
        if p.ndim == 1:
            new.append((name, mx.zeros_like(p) if name.endswith("bias") else mx.ones_like(p)))
        else:
            new.append((name, mx.random.normal(p.shape, dtype=mx.float32) * std))
    model.update(tree_unflatten(new))


def save_drafter(model: nn.Module, cfg: dict, out: Path, *, compact: bool = False, meta: dict | None = None) -> Path:
    """Write config.json + model.safetensors (bf16) into `out` (each file replaced atomically; other
    files in `out` are left alone). `compact` leaves out the embed_tokens / lm_head copies (bound
    to the target's at load). A z-lab layout config is always written without them (z-lab binds the
    target's; its config needs no flag for it)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(cfg)
    if meta:
        cfg["mlx_dspark_distill"] = meta
    if is_zlab(cfg):
        compact = True
    elif compact:
        cfg["embeddings_from_target"] = True
    weights = {
        k: v.astype(mx.bfloat16)
        for k, v in tree_flatten(model.parameters())
        if not (compact and k.startswith(("embed_tokens.", "lm_head.")))
    }
    tmp = out / ".writing"
    tmp.mkdir(exist_ok=True)
    tmp_w, tmp_c = tmp / "model.safetensors", tmp / "config.json"
    mx.save_safetensors(str(tmp_w), weights, metadata={"format": "pt"})
    tmp_c.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    os.replace(tmp_w, out / "model.safetensors")
    os.replace(tmp_c, out / "config.json")
    tmp.rmdir()
    return out


def save_state(model: nn.Module, optimizer, out: Path, state: dict) -> None:
    d = Path(out) / STATE_DIR
    tmp = d.parent / (STATE_DIR + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "trainable.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    opt = {k: v for k, v in tree_flatten(optimizer.state) if isinstance(v, mx.array)}
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), opt)
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    if d.exists():
        shutil.rmtree(d)
    os.replace(tmp, d)


def load_state(model: nn.Module, optimizer, out: Path) -> dict:
    d = Path(out) / STATE_DIR
    try:
        state = json.loads((d / "state.json").read_text())
        model.load_weights(list(mx.load(str(d / "trainable.safetensors")).items()), strict=False)
        opt = mx.load(str(d / "optimizer.safetensors"))
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise UserError(f"cannot resume from {d}: {e}") from None
    optimizer.state = tree_unflatten(list(opt.items()))
    return state


def has_state(out: Path) -> bool:
    return (Path(out) / STATE_DIR / "state.json").is_file()


def size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in Path(path).glob("*") if f.is_file()) / 1e6


__all__ = [
    "default_taps",
    "check_taps",
    "pick_mask_token",
    "drafter_config",
    "spec_from_config",
    "is_zlab",
    "target_matrices",
    "init_weights",
    "save_drafter",
    "save_state",
    "load_state",
    "has_state",
    "size_mb",
]
