"""Which ops keep a row's arithmetic when the row moves inside a fixed-width block, on this device,
and which path each precision of a target gets at load, per decode width W.

  python bench/diag_invariance.py [--model M] [--widths 8,16,32] [--precisions bf16,8,4] [--out FILE.md]

Op check: a row computed at position 0 of an M = W call equals the same row at position i of an
M = W call with other rows around it (bitwise). The fixed-width path relies on exactly this.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import _package  # noqa: F401


def op_rows(fn, x, W: int) -> bool:
    import mlx.core as mx

    full = fn(x[:W])
    mx.eval(full)
    for i in range(W):
        moved = mx.concatenate([x[i : i + 1], x[W : W + W - 1]], axis=0)  # row i first, other rows after
        if not mx.array_equal(fn(moved)[0], full[i]).item():
            return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--widths", default="8,16,32")
    ap.add_argument("--precisions", default="bf16,8,4")
    ap.add_argument("--out")
    args = ap.parse_args()

    import mlx.core as mx
    import mlx.nn as nn

    import mlx_dspark as md
    from mlx_dspark import benchmark as bm

    widths = [int(w) for w in args.widths.split(",")]
    lines = [
        f"## width-invariance diagnostics, {bm.device_stamp()}",
        f"`{' '.join(sys.argv)}` at {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        "### a row moved inside a fixed-M call (bitwise)",
    ]
    key = mx.random.key(3)
    x = mx.random.normal((64, 768), key=key).astype(mx.bfloat16)
    w = (mx.random.normal((1536, 768), key=mx.random.key(4)) * 0.05).astype(mx.bfloat16)
    head = (mx.random.normal((49152, 768), key=mx.random.key(5)) * 0.05).astype(mx.bfloat16)
    ops = {
        "dense 768x1536": lambda a: a @ w.T,
        "lm_head 768x49152": lambda a: a @ head.T,
        "rms_norm": lambda a: mx.fast.rms_norm(a, mx.ones((768,), dtype=a.dtype), 1e-5),
    }
    for bits in (8, 4):
        for g in (32, 64, 128):
            wq, s, b = mx.quantize(w, group_size=g, bits=bits)
            ops[f"quantized_matmul {bits}-bit g{g}"] = lambda a, wq=wq, s=s, b=b, g=g, bits=bits: mx.quantized_matmul(
                a, wq, s, b, transpose=True, group_size=g, bits=bits
            )
    for name, fn in ops.items():
        res = [f"M={W}: {'same' if op_rows(fn, x, W) else 'DIFFERS'}" for W in widths]
        lines.append(f"    {name:<28} " + ", ".join(res))
        print(lines[-1], flush=True)

    model = args.model
    if model is None:
        from mlx_dspark.models.demo import demo_model_path

        model = str(demo_model_path())
    lines += ["", "### the path a target gets at load (MLX_DSPARK_DECODE_WIDTH=W)"]
    for p in [p for p in args.precisions.split(",") if p]:
        quantize = int(p) if p in ("8", "4") else None
        verdicts = []
        for W in widths:
            os.environ["MLX_DSPARK_DECODE_WIDTH"] = str(W)
            t0 = time.perf_counter()
            target, _ = md.load_target(model, dtype="bfloat16", quantize=quantize)
            verdicts.append(f"W={W}: {target.invariance} ({time.perf_counter() - t0:.1f} s)")
        lines.append(f"    {p:<5} " + ", ".join(verdicts))
        print(lines[-1], flush=True)
    os.environ.pop("MLX_DSPARK_DECODE_WIDTH", None)
    del nn
    lines.append("")
    bm.emit("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
