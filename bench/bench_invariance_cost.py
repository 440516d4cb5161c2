"""What width invariance costs: baseline decode against mlx-lm, and the verify cost curve.

  python bench/bench_invariance_cost.py [--model M] [--precision bf16|8|4|f32] [--tokens 192]
         [--trials 3] [--out FILE.md]

1. Baseline decode tok/s with the path the target chose at load (fixed width + invariant
   attention where the native forward is not invariant) against mlx_lm's generate_step on the
   same model, and the native forward's baseline too (ratios from one run; goal >= 0.97x).
2. Verify cost: one forward of w = 1..16 tokens over a warm ~200-token cache (then trimmed),
   the invariant path against the native one (MLX's own kernels), as ms and ratios.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import _package  # noqa: F401


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "8", "4", "f32"])
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()

    import mlx.core as mx

    import mlx_dspark as md
    from mlx_dspark import benchmark as bm

    dtype = "float32" if args.precision == "f32" else "bfloat16"
    quantize = int(args.precision) if args.precision in ("8", "4") else None
    model = args.model
    if model is None:
        from mlx_dspark.models.demo import demo_model_path

        model = str(demo_model_path())
    target, tok = md.load_target(model, dtype=dtype, quantize=quantize)
    chosen = target.decode_width
    lines = [
        f"## cost of width invariance: {Path(model).name} {args.precision}, {bm.device_stamp()}",
        f"`{' '.join(sys.argv)}` at {time.strftime('%Y-%m-%d %H:%M')}; invariance={target.invariance}, "
        f"decode width={chosen or 'native'}",
        "",
    ]

    lines.append(f"### baseline decode, {args.tokens} tokens, best of {args.trials}")
    for name, prompt in [("chat", bm.CHAT_PROMPT), ("code", bm.CODE_PROMPT), ("copy", bm.COPY_PROMPT)]:
        ids = md.encode_prompt(tok, prompt)
        res = {}
        for side, width in (("mlx_lm", None), ("ours", chosen), ("ours-native", 0)):
            if side == "ours-native" and not chosen:
                continue
            if width is not None:
                target.decode_width = width
            run = (
                (lambda: bm.mlx_lm_decode(target, ids, args.tokens))
                if side == "mlx_lm"
                else (lambda: bm.ours(target, tok, ids, args.tokens, "baseline"))
            )
            run()  # warm-up
            res[side] = max((run() for _ in range(args.trials)), key=lambda m: m.decode_tps)
        target.decode_width = chosen
        r = res["ours"].decode_tps / res["mlx_lm"].decode_tps
        line = (
            f"    {name}: mlx_lm {res['mlx_lm'].decode_tps:.1f} tok/s, ours {res['ours'].decode_tps:.1f} "
            f"(x{r:.3f} mlx_lm, goal >= 0.97)"
        )
        if "ours-native" in res:
            line += (
                f", ours on the native forward {res['ours-native'].decode_tps:.1f} "
                f"(x{res['ours-native'].decode_tps / res['mlx_lm'].decode_tps:.3f})"
            )
        line += (
            "; same tokens as mlx_lm" if res["ours"].tokens == res["mlx_lm"].tokens else "; tokens differ from mlx_lm"
        )
        lines.append(line)
        print(line, flush=True)

    lines += [
        "",
        f"### verify cost, one forward of w tokens over a 200-token cache (mean of {args.reps})",
        "    w   native ms  invariant ms  inv/native  native/native(1)  inv/native(1)",
    ]
    vocab = target.vocab_size
    prefix = mx.array([[(13 * i + 5) % vocab for i in range(200)]], dtype=mx.int32)
    block = mx.array([[(7 * i + 3) % vocab for i in range(16)]], dtype=mx.int32)
    times = {}
    for width in [0, chosen] if chosen else [0]:
        target.decode_width = width
        cache = target.make_cache()
        mx.eval(target.forward(prefix, cache, last_only=True).logits)
        for w in range(1, 17):
            for _ in range(3):
                mx.eval(target.forward(block[:, :w], cache).logits)
                target.trim(cache, w)
            t0 = time.perf_counter()
            for _ in range(args.reps):
                mx.eval(target.forward(block[:, :w], cache).logits)
                target.trim(cache, w)
            times[(width, w)] = (time.perf_counter() - t0) / args.reps * 1e3
    target.decode_width = chosen
    for w in range(1, 17):
        nat = times[(0, w)]
        inv = times.get((chosen, w), nat) if chosen else nat
        lines.append(
            f"   {w:2d}  {nat:9.3f}  {inv:12.3f}  {inv / nat:10.3f}  {nat / times[(0, 1)]:16.3f}  "
            f"{inv / times[(0, 1)]:13.3f}"
        )
    lines.append("")
    bm.emit("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
