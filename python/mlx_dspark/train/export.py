"""Compact export of a distilled drafter, for shipping (e.g. in this repo, <= 30 MB).

The embed_tokens / lm_head tensors of a DeepSpec checkpoint are frozen copies of the target's
matrices (2 x V x H: most of a small drafter). The export leaves them out and marks the config
with `"embeddings_from_target": true`; our loader (models/checkpoints.py, models/drafters.py)
then binds the target's own embedding and output head, as it does for z-lab checkpoints.
Everything else is the checkpoint's bf16 tensors, unchanged; the draft vocabulary ranking
(draft_vocab.json, models/draft_vocab.py) is copied along.

    python -m mlx_dspark.train.export FULL_DIR OUT_DIR
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


def export_compact(src: Path, dest: Path) -> Path:
    src, dest = Path(src), Path(dest)
    try:
        cfg = json.loads((src / "config.json").read_text())
        weights = {}
        for f in sorted(src.glob("*.safetensors")):
            weights.update(mx.load(str(f)))
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise UserError(f"cannot export {src}: {e}") from None
    if not weights:
        raise UserError(f"cannot export {src}: it has no *.safetensors weights")
    cfg["embeddings_from_target"] = True
    kept = {k: v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in weights.items() if k not in DROP}
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
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m mlx_dspark.train.export FULL_DIR OUT_DIR", file=sys.stderr)
        return 2
    out = export_compact(Path(args[0]), Path(args[1]))
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file()) / 1e6
    print(f"{out}: {size:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
