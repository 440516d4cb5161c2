"""What width invariance costs: baseline decode against mlx-lm, and the verify cost curve.

  python bench/bench_invariance_cost.py [--model M] [--precision bf16|8|4|f32] [--tokens 192]
         [--trials 3] [--out FILE.md]

1. Baseline decode tok/s with the path the target chose at load (models/invariance.py: the
   invariant kernels where the native forward is not invariant) against mlx_lm's generate_step on
   the same model, and the other paths (native, fixed width) too, interleaved, ratios from one
   run; goal >= 0.97x. Also against what `mlx_lm.generate` runs (stream_generate: generate_step
   plus a detokenizer per token, as our decode has one).
2. Verify cost: one forward of w = 1..16 tokens over a warm ~200-token cache (then trimmed), per
   path, as ms and ratios to the native forward (MLX's own kernels).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import _package  # the installed mlx_dspark, else python/; the precision loader

_COMPILE_SETTING = os.environ.get("MLX_DSPARK_COMPILE", "auto")
EAGER = "kernels-eager"  # the kernel path built op by op at every step (MLX_DSPARK_COMPILE=off)


def use_path(target, side: str) -> None:
    from mlx_dspark.models import invariance

    os.environ["MLX_DSPARK_COMPILE"] = "off" if side == EAGER else _COMPILE_SETTING
    invariance.set_path(target, "kernels" if side == EAGER else side)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--precision", default="bf16", choices=_package.PRECISIONS)
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()

    import mlx.core as mx

    import mlx_dspark as md
    from mlx_dspark import benchmark as bm

    target, tok, model = _package.load_precision(args.model, args.precision)
    from mlx_dspark.models import invariance

    chosen = invariance.path_of(target)
    lines = [
        f"## cost of width invariance: {Path(model).name} {args.precision}, {bm.device_stamp()}",
        f"`{' '.join(sys.argv)}` at {time.strftime('%Y-%m-%d %H:%M')}; invariance={target.invariance} "
        f"(decode path: {chosen})",
        "",
    ]
    paths = [chosen] + [p for p in invariance.PATHS if p != chosen]
    if target.compiled_decode is not None:  # the kernel path's compiled graphs against it built op by op
        paths.append(EAGER)
        lines[1] += f"; compiled decode steps (models/compiled_decode.py), and `{EAGER}` without them"

    lines.append(f"### baseline decode, {args.tokens} tokens, best of {args.trials} (interleaved)")
    for name, prompt in [("chat", bm.CHAT_PROMPT), ("code", bm.CODE_PROMPT), ("copy", bm.COPY_PROMPT)]:
        ids = md.encode_prompt(tok, prompt)
        res: dict = {}
        sides = ["mlx_lm", "mlx_lm.generate"] + paths
        for _ in range(args.trials + 1):  # the first round warms up
            for side in sides:
                if side == "mlx_lm":
                    m = bm.mlx_lm_decode(target, ids, args.tokens)
                elif side == "mlx_lm.generate":
                    m = bm.mlx_lm_generate_decode(target, ids, args.tokens)
                else:
                    use_path(target, side)
                    m = bm.ours(target, tok, ids, args.tokens, "baseline")
                res.setdefault(side, []).append(m)
        use_path(target, chosen)
        best = {k: max(v[1:], key=lambda m: m.decode_tps) for k, v in res.items()}
        ref, gen = best["mlx_lm"], best["mlx_lm.generate"]
        parts = [f"mlx_lm {ref.decode_tps:.1f} tok/s (mlx_lm.generate {gen.decode_tps:.1f})"]
        for side in paths:
            r = best[side].decode_tps / ref.decode_tps
            rg = best[side].decode_tps / gen.decode_tps
            same = "same tokens" if best[side].tokens == ref.tokens else "tokens differ"
            tag = " (chosen; goal >= 0.97)" if side == chosen else ""
            parts.append(f"{side} {best[side].decode_tps:.1f} = x{r:.3f} (x{rg:.3f} generate){tag}, {same}")
        line = f"    {name}: " + "; ".join(parts)
        lines.append(line)
        print(line, flush=True)

    lines += [
        "",
        f"### verify cost, one forward of w tokens over a 200-token cache (median of {args.reps}, paths interleaved)",
        "    w  "
        + "".join(f"{p + ' ms':>12}" for p in paths)
        + "".join(f"{p + '/native':>16}" for p in paths if p != "native")
        + "".join(f"{p + '/native(1)':>18}" for p in paths),
    ]
    vocab = target.vocab_size
    prefix = mx.array([[(13 * i + 5) % vocab for i in range(200)]], dtype=mx.int32)
    block = mx.array([[(7 * i + 3) % vocab for i in range(16)]], dtype=mx.int32)
    caches = {}
    for p in paths:  # one warm cache per path; every timed forward is trimmed off again
        use_path(target, p)
        caches[p] = target.make_cache()
        mx.eval(target.forward(prefix, caches[p], last_only=True).logits)

    def once(p: str, w: int) -> float:
        t0 = time.perf_counter()
        mx.eval(target.forward(block[:, :w], caches[p]).logits)
        dt = time.perf_counter() - t0
        target.trim(caches[p], w)
        return dt

    times = {}
    for w in range(1, 17):
        samples: dict = {p: [] for p in paths}
        for r in range(args.reps + 2):  # the paths take turns, so a load change hits them alike
            for p in paths:
                use_path(target, p)
                dt = once(p, w)
                if r >= 2:  # two warm-ups per path and width
                    samples[p].append(dt)
        for p in paths:
            times[(p, w)] = statistics.median(samples[p]) * 1e3
    use_path(target, chosen)
    for w in range(1, 17):
        nat = times[("native", w)]
        row = f"   {w:2d}  " + "".join(f"{times[(p, w)]:12.3f}" for p in paths)
        row += "".join(f"{times[(p, w)] / nat:16.3f}" for p in paths if p != "native")
        row += "".join(f"{times[(p, w)] / times[('native', 1)]:18.3f}" for p in paths)
        lines.append(row)
    lines.append("")
    bm.emit("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
