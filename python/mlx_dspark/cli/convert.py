"""`mlx-dspark convert FILE.gguf --out DIR`: write a GGUF file as a normal mlx-lm model folder."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="convert a GGUF file (llama, gemma3) into an mlx-lm model folder",
        description="Write FILE.gguf as an mlx-lm folder: config.json, model.safetensors and "
        "tokenizer files with the chat template from the GGUF metadata.",
    )
    p.add_argument("file", nargs="?", metavar="FILE.gguf", help="the GGUF file (default: the demo model)")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (must not exist, or be empty)")
    p.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        help="precision of the weights (default: float32 on CPU, bfloat16 on a GPU)",
    )
    p.add_argument(
        "--quantize",
        type=int,
        choices=[4, 8],
        help="MLX affine 4/8-bit: Q4_0/Q4_1/Q8_0 blocks that fit are copied exactly, the rest re-quantized",
    )
    p.add_argument("--json", action="store_true", help="print what was written as one JSON object")


def run(args) -> int:
    from ..errors import UserError
    from ..models.demo import model_or_demo
    from ..models.gguf import SOURCE_FILE, convert_gguf
    from ..models.precision import default_dtype

    src = Path(model_or_demo(args.file)).expanduser()
    if src.suffix.lower() != ".gguf":
        raise UserError(f"{src} is not a .gguf file; convert takes a GGUF file")
    dtype = args.dtype or default_dtype()
    started = time.perf_counter()
    out = convert_gguf(src, Path(args.out), dtype=dtype, quantize=args.quantize)
    info = json.loads((out / SOURCE_FILE).read_text())
    info["out"] = str(out)
    if args.json:
        print(json.dumps(info))
    else:
        q = f", MLX {info['quantize']}-bit" if info.get("quantize") else ""
        print(
            f"wrote {out} ({info['architecture']}, {info['dtype']}{q}) from {src} "
            f"in {time.perf_counter() - started:.1f} s",
            file=sys.stdout,
        )
    return 0
