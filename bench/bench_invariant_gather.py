"""Microbenchmark of the width-invariant MoE expert product (kernels/invariant_gather.py) against
MLX's own mx.gather_mm / mx.gather_qmm, as mlx-lm's SwitchGLU calls them, at decode and verify
widths.

  python bench/bench_invariant_gather.py [--reps 30] [--quick] [--out FILE.md]

Shapes: Qwen3-30B-A3B-like experts (128 experts, hidden 2048, expert width 768, top-8) and
Qwen3-Next-80B-like ones (512 experts, hidden 2048, width 512, top-10): the gate / up layout (one x
per token for its k experts), both of SwitchGLU's gate and up projections (one launch on the
kernel path, two gather calls in MLX) and the down layout (one x per pair); dense in bf16 and MLX affine
4-bit at group 64. The tokens' experts are random and distinct per token; from 64 pairs on the
pairs are sorted by expert first, as SwitchGLU does. Prints per shape and width the median ms of
both (interleaved calls), ours / MLX, and ours at T tokens over ours at 1 (a verify row's cost over
a plain step's). On a GPU ours is the CUDA (or Metal) kernel; on the CPU ours is the `rowwise`
fallback (each pair through MLX's op alone: what a GPU runs with MLX_DSPARK_KERNELS=reference), so
the script runs anywhere but its figures mean something on a GPU. Ratios from one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import _package  # noqa: F401

SHAPES = [  # (label, experts, hidden, width, top-k)
    ("30B-A3B", 128, 2048, 768, 8),
    ("Next-80B", 512, 2048, 512, 10),
]
TOKENS = (1, 2, 4, 8, 16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="one shape, tokens 1 and 8, bf16 only")
    ap.add_argument("--out")
    args = ap.parse_args()

    import mlx.core as mx
    from mlx_lm.models.switch_layers import SwitchLinear

    from mlx_dspark import benchmark as bm
    from mlx_dspark.kernels import invariant_gather as ig

    gpu = mx.default_device() != mx.cpu
    path = ig.gather_path() if gpu else "rowwise"
    dtype = mx.bfloat16 if gpu else mx.float32  # MLX's CPU gather_mm takes float32 only
    shapes = SHAPES[:1] if args.quick else SHAPES
    tokens = (1, 8) if args.quick else TOKENS
    lines = [
        f"## Invariant MoE expert product vs MLX's gather ops, {bm.device_stamp()}, path {path}",
        f"`bench/bench_invariant_gather.py --reps {args.reps}{' --quick' if args.quick else ''}` at "
        f"{time.strftime('%Y-%m-%d %H:%M')}; median ms of {args.reps} interleaved calls",
        "",
        "| shape | layout | weights | tokens | pairs | ours ms | MLX ms | ours / MLX | ours(T) / ours(1) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for line in lines:
        print(line, flush=True)

    def timed(fn) -> float:
        mx.eval(fn())
        t0 = time.perf_counter()
        mx.eval(fn())
        return time.perf_counter() - t0

    for label, E, hidden, width, k in shapes:
        if not gpu:  # the CPU only checks that the script runs: an eighth of the experts
            E, label = E // 8, f"{label} (E/8)"
        for layout, K, N in (("gate/up", hidden, width), ("gate+up pair", hidden, width), ("down", width, hidden)):
            dense = SwitchLinear(K, N, E, bias=False)
            dense.weight = dense.weight.astype(dtype)
            twin = SwitchLinear(K, N, E, bias=False)  # the pair's second weight (gate beside up)
            twin.weight = twin.weight.astype(dtype)
            layers = [("bf16" if gpu else "f32", dense, twin)]
            if not args.quick:
                qs = [lay.to_quantized(group_size=64, bits=4) for lay in (dense, twin)]
                for q in qs:
                    q.scales, q.biases = q.scales.astype(dtype), q.biases.astype(dtype)
                layers.append(("4-bit g64", *qs))
            for wname, layer, second in layers:
                one = None
                for T in tokens:
                    scores = mx.random.uniform(shape=(T, E), key=mx.random.key(T))
                    idx = mx.argsort(scores, axis=-1)[:, :k].astype(mx.uint32)
                    shape = (T, k, 1, K) if layout == "down" else (T, 1, 1, K)
                    x = mx.random.normal(shape, key=mx.random.key(100 + T)).astype(dtype)
                    sort = T * k >= 64
                    if sort:  # SwitchGLU's sorted call: one x row per pair, pairs by expert
                        flat = idx.flatten()
                        order = mx.argsort(flat)
                        rows = x.reshape(-1, 1, K)
                        x, idx = rows[order if layout == "down" else order // k], flat[order]
                    mx.eval(x, idx)

                    def ours():
                        if path == "rowwise":
                            if layout == "gate+up pair":
                                return ig._rowwise(layer, x, idx), ig._rowwise(second, x, idx)
                            return ig._rowwise(layer, x, idx)
                        if layout == "gate+up pair":  # what SwitchGLU runs on the kernel path: one launch
                            with ig.pair(layer, second):
                                return ig.call(layer, x, idx), ig.call(second, x, idx)
                        return ig.call(layer, x, idx)

                    def theirs():
                        if layout == "gate+up pair":
                            return layer(x, idx, sorted_indices=sort), second(x, idx, sorted_indices=sort)
                        return layer(x, idx, sorted_indices=sort)

                    a, b = [], []
                    for _ in range(args.reps):
                        a.append(timed(ours))
                        b.append(timed(theirs))
                    ma, mb = statistics.median(a) * 1e3, statistics.median(b) * 1e3
                    one = ma if T == 1 else one
                    line = (
                        f"| {label} | {layout} | {wname} | {T} | {T * k} | {ma:.3f} | {mb:.3f} | {ma / mb:.2f} | "
                        f"{ma / one:.2f} |"
                    )
                    print(line, flush=True)
                    lines.append(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
