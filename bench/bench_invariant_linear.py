"""Microbenchmark of the width-invariant linear op (kernels/invariant_linear.py) against MLX's own
product (x @ W.T, or mx.quantized_matmul) at decode and verify widths.

  python bench/bench_invariant_linear.py [--reps 50] [--quick] [--out FILE.md]
  python bench/bench_invariant_linear.py --cpu-kernels [--reps 15] [--out FILE.md]
  python bench/bench_invariant_linear.py --cpu-verify [--reps 5] [--out FILE.md]
  python bench/bench_invariant_linear.py --gpu-kernels [--reps 30] [--quick] [--out FILE.md]

Shapes: the demo SmolLM2-135M projections and lm_head, and Qwen3-4B-like ones; dense in the
default float dtype (bf16 on a GPU, float32 on the CPU) and MLX affine 4- and 8-bit at group 64
(GPU only: on the CPU the quantized product is MLX's own, already row-invariant). Prints, per
shape and width M, both times and ours / MLX (below 1: ours is faster), and ours at M against
MLX at M = 1 (what a verify row costs over a plain step). Ratios from one run.

--cpu-kernels (float32, on the CPU): the C++ primitive's two kernels, `rows` (the first one: one x
row at a time against four weight rows) and `tiled` (register tiles, the default), against MLX's
own x @ W.T, on the demo model's shapes at M = 1, 2, 4, 8, 16, 17, 32. The three sides are
interleaved call by call and each figure is the median of --reps calls (the machine is shared).
Each call reads its weight from one of several copies totalling over 64 MB, in turn, so that it
comes from memory as in a forward (the whole model does not fit the cache) and not from L3.

--cpu-verify (float32, on the CPU): the demo target's whole forward of w = 1..16 tokens over a
200-token cache on the invariant-kernel path, with the CPU linears on the `rows` kernel and on
the `tiled` one (interleaved, medians), and MLX's own forward (path native) beside them.

--gpu-kernels (GPU): the linear bodies side by side (MLX_DSPARK_IL_KERNEL's choices: v1, v2c1,
v2c2, v2c4, and v2 with the C it picks) and MLX's own layer, on SmolLM2-135M's shapes at
M = 1, 2, 4, 8, 16, bf16 dense and 8- / 4-bit affine at group 64. Each figure: the median over
--reps of the wall time of one evaluation of BATCH calls, per call (us), the sides interleaved;
each call reads its own copy of the weight (copies totalling ROTATE_GPU_BYTES, past the H200's
50 MB L2: from HBM, as in a forward). Every v2 output is checked bitwise against v1's (column
"=v1"). A small shape's figure is mostly the launch's host cost (a decode forward's too).
"""

from __future__ import annotations

import argparse
import time

import _package  # noqa: F401

SHAPES = [  # (label, K, N)
    ("135M q/o 576x576", 576, 576),
    ("135M gate/up 576x1536", 576, 1536),
    ("135M down 1536x576", 1536, 576),
    ("135M lm_head 576x49152", 576, 49152),
    ("4B gate/up 2560x9728", 2560, 9728),
    ("4B down 9728x2560", 9728, 2560),
]
WIDTHS = (1, 2, 4, 8, 16)
CPU_SHAPES = [  # (label, K, N): SmolLM2-135M
    ("q/o 576x576", 576, 576),
    ("k/v 576x192", 576, 192),
    ("gate/up 576x1536", 576, 1536),
    ("down 1536x576", 1536, 576),
    ("lm_head 576x49152", 576, 49152),
]
CPU_WIDTHS = (1, 2, 4, 8, 16, 17, 32)
ROTATE_BYTES = 64 << 20
GPU_SHAPES = [(label, K, (N,)) for label, K, N in CPU_SHAPES] + [  # (label, K, Ns): SmolLM2-135M
    ("q+k+v one launch", 576, (576, 192, 192)),
    ("gate+up one launch", 576, (1536, 1536)),
]
GPU_SIDES = ("v1", "v2c1", "v2c2", "v2c4", "v2")
ROTATE_GPU_BYTES = 160 << 20
MAX_COPIES = 2048
BATCH = 16


def cpu_kernels(reps: int) -> list[str]:
    """The CPU table (see the module docstring): per shape and M, median ms of rows / tiled /
    MLX, tiled over rows, tiled over MLX, and tiled(M) over tiled(1)."""
    import os
    import statistics

    import mlx.core as mx

    from mlx_dspark import benchmark as bm
    from mlx_dspark.kernels import native

    ext = native.ext(warn=True)
    mx.set_default_device(mx.cpu)
    sides = {
        "rows": lambda x, w: ext.invariant_linear(x, w, None, kernel="rows"),
        "tiled": lambda x, w: ext.invariant_linear(x, w, None),
        "mlx": lambda x, w: x @ w.T,
    }
    blas = os.environ.get("LD_PRELOAD", "") or "MLX's bundled BLAS"
    lines = [
        f"## CPU invariant linear kernels vs MLX, {bm.device_stamp()}, tiles {ext.invariant_linear_isa()}, float32",
        f"`bench/bench_invariant_linear.py --cpu-kernels --reps {reps}` at {time.strftime('%Y-%m-%d %H:%M')}, "
        f"BLAS {blas}, load average {' '.join(f'{v:.2f}' for v in os.getloadavg())} at the start; "
        f"median ms of {reps} calls, the three sides interleaved, weights from memory (rotated copies)",
        "",
        "    shape               M  rows ms  tiled ms   MLX ms  tiled/rows  tiled/MLX  tiled(M)/tiled(1)"
        "  rows(M)/rows(1)",
    ]
    for label, K, N in CPU_SHAPES:
        copies = max(1, -(-ROTATE_BYTES // (N * K * 4)))
        ws = [mx.random.normal((N, K), key=mx.random.key(K * 7 + N + i)) * 0.05 for i in range(copies)]
        xs = mx.random.normal((max(CPU_WIDTHS), K), key=mx.random.key(1))
        mx.eval(ws, xs)
        first = {}
        for M in CPU_WIDTHS:
            x = xs[:M]
            times = {k: [] for k in sides}
            for k, fn in sides.items():  # warm
                mx.eval(fn(x, ws[0]))
            for i in range(reps):
                for k, fn in sides.items():
                    w = ws[(i * len(sides) + list(sides).index(k)) % copies]
                    t0 = time.perf_counter()
                    mx.eval(fn(x, w))
                    times[k].append((time.perf_counter() - t0) * 1e3)
            med = {k: statistics.median(v) for k, v in times.items()}
            first = med if M == 1 else first
            lines.append(
                f"    {label:18s} {M:3d} {med['rows']:8.3f} {med['tiled']:9.3f} {med['mlx']:8.3f} "
                f"{med['tiled'] / med['rows']:11.3f} {med['tiled'] / med['mlx']:10.3f} "
                f"{med['tiled'] / first['tiled']:18.2f} {med['rows'] / first['rows']:16.2f}"
            )
            print(lines[-1], flush=True)
        del ws
    lines.append("")
    return lines


def cpu_verify(reps: int) -> list[str]:
    """The --cpu-verify table (module docstring): ms per forward and ratios to the width-1 one."""
    import functools
    import os
    import statistics
    import types

    import mlx.core as mx

    import mlx_dspark as md
    from mlx_dspark import benchmark as bm
    from mlx_dspark.kernels import invariant_linear as il
    from mlx_dspark.kernels import native
    from mlx_dspark.models import invariance
    from mlx_dspark.models.demo import demo_model_path

    mx.set_default_device(mx.cpu)
    target, _ = md.load_target(str(demo_model_path()), dtype="float32")
    ext = native.ext(warn=True)
    exts = {  # what kernels/invariant_linear.py's native plans call, per kernel
        "rows": types.SimpleNamespace(invariant_linear=functools.partial(ext.invariant_linear, kernel="rows")),
        "tiled": ext,
    }
    real_ext = native.ext

    def use(side):
        invariance.set_path(target, "native" if side == "native" else "kernels")
        native.ext = real_ext if side == "native" else (lambda warn=True, e=exts[side]: e)
        il.reset()

    vocab = target.vocab_size
    prefix = mx.array([[(13 * i + 5) % vocab for i in range(200)]], dtype=mx.int32)
    block = mx.array([[(7 * i + 3) % vocab for i in range(16)]], dtype=mx.int32)
    sides = ["rows", "tiled", "native"]
    caches = {}
    try:
        for side in sides:
            use(side)
            caches[side] = target.make_cache()
            mx.eval(target.forward(prefix, caches[side], last_only=True).logits)
        times = {}
        for w in range(1, 17):
            for rep in range(reps + 1):  # the first round warms up
                for side in sides:
                    use(side)
                    t0 = time.perf_counter()
                    mx.eval(target.forward(block[:, :w], caches[side]).logits)
                    dt = (time.perf_counter() - t0) * 1e3
                    target.trim(caches[side], w)
                    if rep:
                        times.setdefault((side, w), []).append(dt)
    finally:
        native.ext = real_ext
        il.reset()
        invariance.set_path(target, "kernels")
    med = {k: statistics.median(v) for k, v in times.items()}
    lines = [
        f"## CPU verify forward, rows vs tiled kernel, demo SmolLM2-135M float32, {bm.device_stamp()}",
        f"`bench/bench_invariant_linear.py --cpu-verify --reps {reps}` at {time.strftime('%Y-%m-%d %H:%M')}, "
        f"BLAS {os.environ.get('LD_PRELOAD', '') or 'bundled'}, load average "
        f"{' '.join(f'{v:.2f}' for v in os.getloadavg())} at the end; median ms of {reps} forwards of w tokens "
        "over a 200-token cache (trimmed back), the sides interleaved",
        "",
        "     w   rows ms  tiled ms  native ms  tiled/rows  rows(w)/rows(1)  tiled(w)/tiled(1)  native(w)/native(1)",
    ]
    for w in range(1, 17):
        r, t, n = med[("rows", w)], med[("tiled", w)], med[("native", w)]
        lines.append(
            f"    {w:2d} {r:9.2f} {t:9.2f} {n:10.2f} {t / r:11.3f} {r / med[('rows', 1)]:16.2f} "
            f"{t / med[('tiled', 1)]:18.2f} {n / med[('native', 1)]:20.2f}"
        )
        print(lines[-1], flush=True)
    lines.append("")
    return lines


def _gpu_layers(kind: str, K: int, Ns: tuple, dtype, copies: int) -> list:
    """`copies` lists of layers K -> N for N in Ns (views of one allocation per N): nn.Linear, or
    QuantizedLinear for kind qBgG."""
    import mlx.core as mx
    import mlx.nn as nn

    out = [[] for _ in range(copies)]
    for N in Ns:
        w = (mx.random.normal((copies * N, K), key=mx.random.key(K * 7 + N)) * 0.05).astype(dtype)
        if kind != "bf16":
            bits, group = int(kind[1]), int(kind.split("g")[1])
            wq, sc, bi = mx.quantize(w, group_size=group, bits=bits)
            sc, bi = sc.astype(dtype), bi.astype(dtype)
            mx.eval(wq, sc, bi)
        else:
            mx.eval(w)
        for i in range(copies):
            rows = slice(i * N, (i + 1) * N)
            if kind == "bf16":
                layer = nn.Linear(K, N, bias=False)
                layer.update({"weight": w[rows]})
            else:
                layer = nn.QuantizedLinear(K, N, bias=False, group_size=group, bits=bits)
                layer.update({"weight": wq[rows], "scales": sc[rows], "biases": bi[rows]})
            out[i].append(layer)
    return out


def gpu_kernels(reps: int, quick: bool) -> list[str]:
    """The --gpu-kernels table (module docstring): us per call of each body and of MLX's layer."""
    import statistics

    import mlx.core as mx

    from mlx_dspark import benchmark as bm
    from mlx_dspark.kernels import invariant_linear as il

    dtype = mx.bfloat16
    kinds = ("bf16", "q8g64", "q4g64")
    widths = (1, 8) if quick else WIDTHS
    lines = [
        f"## invariant linear bodies vs MLX, {bm.device_stamp()}, path {il.linear_path()}, {dtype}",
        f"`bench/bench_invariant_linear.py --gpu-kernels --reps {reps}{' --quick' if quick else ''}` at "
        f"{time.strftime('%Y-%m-%d %H:%M')}; us per call: median over {reps} evaluations of {BATCH} calls, "
        f"sides interleaved, weights rotated over >= {ROTATE_GPU_BYTES >> 20} MB of copies; C: what v2 picks; "
        "best: the fastest v2cC; =v1: every v2 output bitwise v1's; the one-launch rows: the sibling "
        "group's launch against MLX's separate layers",
        "",
        "    kind  shape               M      v1   v2c1   v2c2   v2c4     v2  C    MLX  best/v1  v2/v1"
        "  v1/MLX  v2/MLX  =v1",
    ]
    nan = float("nan")
    for kind in kinds:
        for label, K, Ns in GPU_SHAPES:
            per = sum(Ns) * K * (2 if kind == "bf16" else int(kind[1]) / 8)
            copies = max(1, min(MAX_COPIES, -(-ROTATE_GPU_BYTES // int(per))))
            groups = _gpu_layers(kind, K, Ns, dtype, copies)
            one = len(Ns) == 1
            sides = {k: [il.layer_plan(g[0] if one else g, k) for g in groups] for k in GPU_SIDES}
            sides = {k: v for k, v in sides.items() if v[0] is not None}
            sides["MLX"] = [(g[0] if one else lambda x, g=g: [lay(x) for lay in g]) for g in groups]
            xs = mx.random.normal((max(widths), K), key=mx.random.key(1)).astype(dtype)
            mx.eval(xs)
            C = il.v2_cols(Ns)
            for M in widths:
                x = xs[:M]
                v2s = [k for k in sides if k.startswith("v2")]
                same = "-"
                if v2s:
                    ref = sides["v1"][0](x)
                    ref = [ref] if one else ref
                    ok = True
                    for k in v2s:
                        got = sides[k][0](x)
                        ok &= all(mx.array_equal(a, b).item() for a, b in zip([got] if one else got, ref))
                    same = "yes" if ok else "NO"
                times = {k: [] for k in sides}
                turn = 0
                for rep in range(reps + 2):  # two untimed rounds: JIT, first touches
                    order = list(sides)[rep % len(sides) :] + list(sides)[: rep % len(sides)]
                    for k in order:
                        fns = sides[k]
                        t0 = time.perf_counter()
                        outs = [fns[(turn + j) % copies](x) for j in range(BATCH)]
                        mx.eval(outs)
                        dt = (time.perf_counter() - t0) / BATCH * 1e6
                        turn += BATCH
                        if rep >= 2:
                            times[k].append(dt)
                med = {k: statistics.median(v) for k, v in times.items()}
                f = lambda k: f"{med[k]:6.1f}" if k in med else "     -"  # noqa: E731
                best = min((med[k] for k in med if k.startswith("v2c")), default=nan)
                v1, v2, ml = med.get("v1", nan), med.get("v2", nan), med["MLX"]
                lines.append(
                    f"    {kind:5s} {label:18s} {M:2d}  {f('v1')} {f('v2c1')} {f('v2c2')} {f('v2c4')} {f('v2')} "
                    f"{C:2d} {f('MLX')} {best / v1:8.3f} {v2 / v1:6.3f} {v1 / ml:7.3f} {v2 / ml:7.3f}  {same}"
                )
                print(lines[-1], flush=True)
            del groups, sides
    lines.append("")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="the 135M shapes only, widths 1 and 8")
    ap.add_argument("--out")
    ap.add_argument("--cpu-kernels", action="store_true", help="the CPU primitive's kernels (module docstring)")
    ap.add_argument("--cpu-verify", action="store_true", help="the demo forward on each CPU kernel (docstring)")
    ap.add_argument("--gpu-kernels", action="store_true", help="v1 / v2cC / v2 / MLX per shape and M (docstring)")
    args = ap.parse_args()
    if args.gpu_kernels:
        from mlx_dspark import benchmark as bm

        bm.emit("\n".join(gpu_kernels(args.reps, args.quick)), args.out)
        return 0
    if args.cpu_kernels or args.cpu_verify:
        from mlx_dspark import benchmark as bm

        bm.emit("\n".join(cpu_kernels(args.reps) if args.cpu_kernels else cpu_verify(args.reps)), args.out)
        return 0

    import mlx.core as mx
    import mlx.nn as nn

    from mlx_dspark import benchmark as bm
    from mlx_dspark.kernels import invariant_linear as il

    gpu = mx.default_device() != mx.cpu
    dtype = mx.bfloat16 if gpu else mx.float32
    kinds = ["dense"] + (["q4g64", "q8g64"] if gpu and il.linear_path() in ("cuda", "metal") else [])
    shapes = SHAPES[:4] if args.quick else SHAPES
    widths = (1, 8) if args.quick else WIDTHS

    def timed(fn):
        for _ in range(5):
            mx.eval(fn())
        t0 = time.perf_counter()
        for _ in range(args.reps):
            mx.eval(fn())
        return (time.perf_counter() - t0) / args.reps * 1e3

    lines = [
        f"## invariant linear vs MLX, {bm.device_stamp()}, path {il.linear_path()}, {dtype}",
        f"`bench/bench_invariant_linear.py --reps {args.reps}{' --quick' if args.quick else ''}` at "
        f"{time.strftime('%Y-%m-%d %H:%M')}; mean ms of {args.reps} calls (each evaluated)",
        "",
        "    shape                      kind    M   MLX ms   ours ms  ours/MLX  ours(M)/MLX(1)",
    ]
    ratios = []
    for label, K, N in shapes:
        for kind in kinds:
            key = mx.random.key(K * 7 + N)
            w = (mx.random.normal((N, K), key=key) * 0.05).astype(dtype)
            xs = mx.random.normal((max(widths), K), key=mx.random.key(1)).astype(dtype)
            if kind == "dense":
                layer = nn.Linear(K, N, bias=False)
                layer.update({"weight": w})
            else:
                layer = nn.QuantizedLinear(K, N, bias=False, group_size=64, bits=int(kind[1]))
                wq, s, b = mx.quantize(w, group_size=64, bits=int(kind[1]))
                layer.update({"weight": wq, "scales": s.astype(dtype), "biases": b.astype(dtype)})
            mlx_fn = layer  # MLX's own product (the routing is off outside a target's decode forward)
            ours_fn = lambda x, layer=layer: il.call(layer, x)  # noqa: E731  (the decode forward's path)
            mx.eval(w, xs)
            base1 = None
            for M in widths:
                x = xs[:M]
                t_mlx = timed(lambda: mlx_fn(x))
                t_ours = timed(lambda: ours_fn(x))
                base1 = t_mlx if M == 1 else base1
                ratios.append(t_ours / t_mlx)
                lines.append(
                    f"    {label:26s} {kind:6s} {M:3d} {t_mlx:8.3f} {t_ours:9.3f} {t_ours / t_mlx:9.3f} "
                    f"{t_ours / base1:15.3f}"
                )
                print(lines[-1], flush=True)
    geo = 1.0
    for r in ratios:
        geo *= r
    geo **= 1 / len(ratios)
    lines += ["", f"geometric mean ours/MLX over every row above: {geo:.3f}", ""]
    bm.emit("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
