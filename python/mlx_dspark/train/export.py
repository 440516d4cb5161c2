"""Compact export of a distilled drafter, for shipping (e.g. in this repo, <= 30 MB).

The embed_tokens / lm_head tensors of a DeepSpec checkpoint are frozen copies of the target's
matrices (2 x V x H: most of a small drafter). The export leaves them out and marks the config
with `"embeddings_from_target": true`; our loader (models/checkpoints.py, models/drafters.py)
then binds the target's own embedding and output head, as it does for z-lab checkpoints.
Everything else is the checkpoint's bf16 tensors, unchanged; the draft vocabulary ranking
(draft_vocab.json, models/draft_vocab.py) is copied along.

`--bits 8` (or 4) also stores the matrices quantized, MLX affine with group 64, as mlx-lm does:
X.weight (packed) + X.scales + X.biases and a "quantization" block in config.json. Only 2-D
weights whose rows split into whole groups are quantized (the layers and fc; not a Markov head of
rank 48, the norms or the confidence head). Loaders dequantize them when they read the folder
(models/checkpoints.py::read_weights), then quantize again at load to the bits asked for.

    python -m mlx_dspark.train.export FULL_DIR OUT_DIR [--bits 8]
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import mlx.core as mx

from ..errors import UserError

DROP = ("embed_tokens.weight", "lm_head.weight")
GROUP_SIZE = 64


def quantize_for_storage(weights: dict, bits: int, group_size: int = GROUP_SIZE) -> dict:
    """The 2-D floating `*.weight` tensors whose rows split into whole groups, quantized (MLX
    affine): X.weight (uint32) + X.scales + X.biases; every other tensor unchanged."""
    out = {}
    for k, v in weights.items():
        if (
            k.endswith(".weight")
            and v.ndim == 2
            and v.shape[-1] % group_size == 0
            and mx.issubdtype(v.dtype, mx.floating)
        ):
            w, scales, biases = mx.quantize(v, group_size=group_size, bits=bits)
            base = k[: -len(".weight")]
            out[k], out[base + ".scales"], out[base + ".biases"] = w, scales, biases
        else:
            out[k] = v
    return out


def export_compact(src: Path, dest: Path, bits: int = 16) -> Path:
    """`src` (a distill output) without its embed/lm_head copies, in bf16, into `dest`; with
    `bits` 8 or 4, its matrices stored quantized as well."""
    from ..models.checkpoints import read_weights

    if bits not in (4, 8, 16):
        raise UserError(f"--bits must be 4, 8 or 16, got {bits}")
    src, dest = Path(src), Path(dest)
    try:
        cfg = json.loads((src / "config.json").read_text())
        weights = read_weights(src)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise UserError(f"cannot export {src}: {e}") from None
    if not weights:
        raise UserError(f"cannot export {src}: it has no *.safetensors weights")
    if "DFlashDraftModel" not in (cfg.get("architectures") or []):  # z-lab's layout never has them
        cfg["embeddings_from_target"] = True
    cfg.pop("quantization", None)
    kept = {
        k: v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in weights.items()
        if k not in DROP
    }
    if bits != 16:
        kept = quantize_for_storage(kept, bits)
        cfg["quantization"] = {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest / ".writing"
    tmp.mkdir(exist_ok=True)
    mx.save_safetensors(str(tmp / "model.safetensors"), kept, metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    os.replace(tmp / "model.safetensors", dest / "model.safetensors")
    os.replace(tmp / "config.json", dest / "config.json")
    tmp.rmdir()
    from ..models.draft_vocab import FILE

    if (src / FILE).is_file():
        shutil.copyfile(src / FILE, dest / FILE)
    return dest


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m mlx_dspark.train.export", description="compact export of a distilled drafter"
    )
    ap.add_argument("src", metavar="FULL_DIR")
    ap.add_argument("dest", metavar="OUT_DIR")
    ap.add_argument(
        "--bits",
        type=int,
        choices=(4, 8, 16),
        default=16,
        help="store the matrices quantized (MLX affine, group 64); default 16: bf16",
    )
    args = ap.parse_args(argv)
    try:
        out = export_compact(Path(args.src), Path(args.dest), bits=args.bits)
    except UserError as e:
        print(f"export: error: {e}", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file()) / 1e6
    print(f"{out}: {size:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
