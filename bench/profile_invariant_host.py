"""Where a decode step's host time goes on the invariant kernel path, against the native forward.

  python bench/profile_invariant_host.py [--model M] [--precision bf16|8|4|f32] [--steps 40] [--out F.md]

On a GPU a small model's decode is host-bound: the step's time is the time to build its graph
(Python + MLX's op construction) plus the launches. This prints, from one run:
1. per step: graph build (the forward call, nothing evaluated) and build + eval, per path;
2. per linear call, build only: MLX's own product, the routed layer (compat -> call() -> plan ->
   kernel), the bare kernel launch, and the routing without the launch;
3. cProfile of the kernel path's graph build (top functions by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import _package  # the installed mlx_dspark, else python/; the precision loader


def _steps(target, cache, tok, n):
    import mlx.core as mx

    build = total = 0.0
    for _ in range(n):
        t0 = time.perf_counter()
        out = target.forward(tok, cache)
        t1 = time.perf_counter()
        nxt = mx.argmax(out.logits[:, -1, :], axis=-1)
        mx.eval(nxt)
        t2 = time.perf_counter()
        build += t1 - t0
        total += t2 - t0
        tok = nxt[None] if nxt.ndim == 1 else nxt
        tok = tok.reshape(1, 1)
    return build / n * 1e3, total / n * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--precision", default="bf16", choices=_package.PRECISIONS)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out")
    args = ap.parse_args()

    import mlx.core as mx
    import mlx.nn as nn

    import mlx_dspark as md
    from mlx_dspark import benchmark as bm
    from mlx_dspark.kernels import invariant, invariant_linear
    from mlx_dspark.models import invariance

    target, tokenizer, model = _package.load_precision(args.model, args.precision)
    dtype = "float32" if args.precision == "f32" else "bfloat16"
    chosen = invariance.path_of(target)
    lines = [
        f"## host time per decode step: {Path(model).name} {args.precision}, {bm.device_stamp()}",
        f"`{' '.join(sys.argv)}` at {time.strftime('%Y-%m-%d %H:%M')}; chosen path {chosen}",
        "",
        "### 1. per step (ms): graph build only, and build + eval (argmax synced each step)",
    ]
    ids = mx.array(md.encode_prompt(tokenizer, bm.CHAT_PROMPT))[None]
    for path in ("native", "kernels", "native", "kernels"):
        invariance.set_path(target, path)
        cache = target.make_cache()
        out = target.forward(ids, cache, last_only=True)
        mx.eval(out.logits)
        tok = mx.argmax(out.logits[:, -1, :], axis=-1).reshape(1, 1)
        _steps(target, cache, tok, 5)  # warm (JIT)
        b, t = _steps(target, cache, tok, args.steps)
        lines.append(f"    {path:8s} build {b:7.3f}  build+eval {t:7.3f}")
    invariance.set_path(target, "kernels")

    # 2. per linear call
    layer = next(m for _, m in target.model.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear)))
    x = mx.random.normal((1, layer.weight.shape[1] * (32 // layer.bits if hasattr(layer, "bits") else 1)))
    x = x.astype(mx.bfloat16 if dtype == "bfloat16" else mx.float32)
    mx.eval(x)

    def timed(fn):
        outs = []
        t0 = time.perf_counter()
        for _ in range(args.calls):
            outs.append(fn())
        t1 = time.perf_counter()
        mx.eval(outs)
        t2 = time.perf_counter()
        return (t1 - t0) / args.calls * 1e6, (t2 - t1) / args.calls * 1e6

    plan = invariant_linear._plan(layer, False)
    rows = []
    rows.append(("MLX's own layer(x)", timed(lambda: layer(x))))

    def routed():
        with invariant.active():
            return layer(x)

    rows.append(("routed layer(x) (active per call)", timed(routed)))
    with invariant.active():
        rows.append(("routed layer(x) (inside one active)", timed(lambda: layer(x))))
    rows.append(("plan(x) (kernel launch)", timed(lambda: plan(x))))
    real_launch = invariant_linear._launch
    invariant_linear._launch = lambda kern, inputs, template, lead, Ns, dts: [inputs[0]] * len(Ns)
    try:
        with invariant.active():
            rows.append(("routing without the launch", timed(lambda: layer(x))))
    finally:
        invariant_linear._launch = real_launch
    lines += ["", f"### 2. per linear call (us), {type(layer).__name__} {tuple(layer.weight.shape)}, M = 1"]
    for name, (b, e) in rows:
        lines.append(f"    {name:40s} build {b:7.2f}  eval {e:7.2f}")

    # 3. cProfile of the kernel path's graph build
    cache = target.make_cache()
    out = target.forward(ids, cache, last_only=True)
    mx.eval(out.logits)
    tok = mx.argmax(out.logits[:, -1, :], axis=-1).reshape(1, 1)
    prof = cProfile.Profile()
    for _ in range(20):
        prof.enable()
        o = target.forward(tok, cache)
        prof.disable()
        tok = mx.argmax(o.logits[:, -1, :], axis=-1).reshape(1, 1)
        mx.eval(tok)
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    lines += ["", "### 3. cProfile, kernel path graph build, 20 steps (tottime)", ""]
    lines += ["    " + ln for ln in s.getvalue().splitlines() if ln.strip()][:45]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
