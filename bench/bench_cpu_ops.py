"""The CPU's fused ops against their pure-MLX references: ratios from one run.

    python bench/bench_cpu_ops.py [--out bench/results/cpu-ops.md]

csrc/draft_ops.cpp (a drafter pass: attention, SiLU-and-multiply, RMS norm, the Markov chain),
csrc/draft_linear.cpp (a drafter pass's products from float16 panels) and
csrc/invariant_attention.cpp (every decode forward's attention) and csrc/target_rope.cpp with the
target's RMS norms (kernels/target_ops.py: every decode forward's 60 RoPEs and 61 norms) on the
demo pair's shapes: the
drafter's 9 / 3 heads of 64, block 7, hidden 1024, draft vocabulary 16185, Markov rank 48; the
target's 9 / 3 heads of 64. Each line: the median of `--reps` synchronised calls (one op, then
mx.eval), the reference's first. The invariant attention is also timed against the path it
replaced (MLX's attention once per query row) at verify widths 1-8, and the panel products
against MLX's matmul and the float32 row kernel they replace in a drafter pass (a whole pass's 35
products in one eval, ~71 MB of float32 weights: more than a CPU's cache, as in a round).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import _package  # noqa: F401  (the installed mlx_dspark, else python/)
import mlx.core as mx
from bench_kernels import time_sync

from mlx_dspark import benchmark as bm
from mlx_dspark.blas import active_blas
from mlx_dspark.kernels import draft_linear, draft_ops, invariant, native, target_ops


def row(name: str, ref: float, got: float, same: str) -> str:
    return f"| {name} | {ref * 1e6:.1f} | {got * 1e6:.1f} | {ref / got:.2f}x | {same} |"


def chain(fn, x, n: int):
    for _ in range(n):
        x = fn(x)
    return x


def draft_lines(ext, reps: int, keys: int) -> list[str]:
    k = mx.random.key(0)
    L, nh, nkv, hd = 7, 9, 3, 64
    q = mx.random.normal((L, nh * hd), key=k)
    w = mx.random.uniform(0.5, 1.5, (hd,), key=mx.random.key(1))
    buf = mx.random.normal((2, 1, nkv, keys + 64, hd), key=mx.random.key(2))
    kk, vv = buf[0][..., :keys, :], buf[1][..., :keys, :]
    rates = (1e5 ** (-mx.arange(0, hd, 2, dtype=mx.float32) / hd)).astype(mx.float32)
    kw = dict(num_heads=nh, position=keys - L, scale=hd**-0.5, eps=1e-5)
    g, u = mx.random.normal((L, 1024), key=mx.random.key(3)), mx.random.normal((L, 1024), key=mx.random.key(4))
    V, Vd, r = 49152, 16185, 48
    U = mx.random.normal((L, Vd), key=mx.random.key(5))
    w1, w2 = mx.random.normal((V, r), key=mx.random.key(6)), mx.random.normal((Vd, r), key=mx.random.key(7))
    ids = mx.sort(mx.random.permutation(V, key=mx.random.key(8))[:Vd]).astype(mx.int32)
    anchor = mx.array(int(ids[3].item()), dtype=mx.int32)
    xn, wn = mx.random.normal((L, 576), key=mx.random.key(9)), mx.random.uniform(0.5, 1.5, (576,), key=k)
    mx.eval(q, w, kk, vv, rates, g, u, U, w1, w2, ids, xn, wn)
    cases = [
        (
            f"draft attention (7 rows over {keys} keys: q-norm, RoPE, attention)",
            lambda: draft_ops.attention_reference(q, w, kk, vv, rates, **kw),
            lambda: ext.draft_attention(q, w, kk, vv, rates, **kw),
            lambda a, b: f"max diff {mx.abs(a - b).max().item():.1e}",
        ),
        (
            "silu(gate) * up (7 x 1024)",
            lambda: draft_ops.silu_mul_reference(g, u),
            lambda: ext.silu_mul(g, u),
            lambda a, b: f"max diff {mx.abs(a - b).max().item():.1e}",
        ),
        (
            "a pass's 17 RMS norms (7 x 576 each, chained, one eval)",
            lambda: chain(lambda y: draft_ops.rms_norm_reference(y, wn, 1e-5), xn, 17),
            lambda: chain(lambda y: ext.rms_norm(y, wn, eps=1e-5), xn, 17),
            lambda a, b: f"max diff {mx.abs(a - b).max().item():.1e}",
        ),
        (
            f"Markov greedy chain (7 slots, {Vd} tokens, rank {r})",
            lambda: draft_ops.markov_greedy_reference(U, w1, w2, ids, anchor),
            lambda: ext.markov_greedy(U, w1, w2, ids, anchor),
            lambda a, b: "same tokens" if a.tolist() == b.tolist() else "OTHER TOKENS",
        ),
    ]
    out = []
    for name, ref, fused, check in cases:
        out.append(row(name, time_sync(ref, reps), time_sync(fused, reps), check(ref(), fused())))
    return out


def target_lines(ext, reps: int, width: int) -> list[str]:
    """A decode forward's RoPEs (queries [1, 9, w, 64] and keys [1, 3, w, 64] in 30 layers) and RMS
    norms (61 of [1, w, 576]) in one eval each: the pure-MLX reference, MLX's op (its CPU fallback:
    what the native op replaces; given a stream, so never routed) and the native op."""
    q = mx.random.normal((30, 1, 9, width, 64), key=mx.random.key(20))
    k = mx.random.normal((30, 1, 3, width, 64), key=mx.random.key(21))
    x = mx.random.normal((61, 1, width, 576), key=mx.random.key(22))
    w = mx.random.uniform(0.5, 1.5, (576,), key=mx.random.key(23))
    mx.eval(q, k, x, w)
    kw = dict(traditional=False, base=100000.0, scale=1.0, offset=300)

    def ropes(fn):
        return lambda: [fn(a[i], 64) for a in (q, k) for i in range(30)]

    def norms(fn):
        return lambda: [fn(x[i]) for i in range(61)]

    cases = [
        (
            f"60 RoPEs, width {width}",
            ropes(lambda a, d: target_ops.rope_reference(a, d, **kw)),
            ropes(lambda a, d: mx.fast.rope(a, d, stream=mx.cpu, **kw)),
            ropes(
                lambda a, d: ext.rope(
                    a, mx.array(300, mx.int32), dims=d, **{k: v for k, v in kw.items() if k != "offset"}
                )
            ),
        ),
        (
            f"61 RMS norms, width {width}",
            norms(lambda a: target_ops.rms_norm_reference(a, w, 1e-5)),
            norms(lambda a: mx.fast.rms_norm(a, w, 1e-5, stream=mx.cpu)),
            norms(lambda a: ext.rms_norm(a, w, eps=1e-5)),
        ),
    ]
    out = []
    for name, ref, mlx, got in cases:
        t_ref, t_mlx, t_got = (time_sync(f, reps) for f in (ref, mlx, got))
        diff = max(mx.abs(a - b).max().item() for a, b in zip(mlx(), got()))
        out.append(
            f"| {name} | {t_ref * 1e6:.1f} | {t_mlx * 1e6:.1f} | {t_got * 1e6:.1f} | {t_ref / t_got:.2f}x | "
            f"{t_mlx / t_got:.2f}x | {diff:.1e} |"
        )
    return out


def attention_lines(ext, reps: int, keys: int) -> list[str]:
    out = []
    for w in (1, 2, 4, 8):
        q = mx.random.normal((1, 9, w, 64), key=mx.random.key(w))
        kv = mx.random.normal((2, 1, 3, keys, 64), key=mx.random.key(10 + w))
        k, v = kv[0], kv[1]
        mx.eval(q, k, v)
        ref = time_sync(lambda: invariant.invariant_attention_reference(q, k, v, 0.125), reps)
        rows = time_sync(lambda: invariant.invariant_attention_rows(q, k, v, 0.125), reps)
        got = time_sync(lambda: ext.invariant_attention(q, k, v, scale=0.125), reps)
        a = ext.invariant_attention(q, k, v, scale=0.125)
        solo = all(
            mx.array_equal(a[:, :, i : i + 1], ext.invariant_attention(q[:, :, i : i + 1], k[:, :, : keys - w + i + 1],
                                                                     v[:, :, : keys - w + i + 1], scale=0.125)).item()
            for i in range(w)
        )  # fmt: skip
        diff = mx.abs(a - invariant.invariant_attention_reference(q, k, v, 0.125)).max().item()
        out.append(
            f"| {w} | {keys} | {ref * 1e6:.1f} | {rows * 1e6:.1f} | {got * 1e6:.1f} | {ref / got:.2f}x "
            f"| {rows / got:.2f}x | {'yes' if solo else 'NO'} | {diff:.1e} |"
        )
    return out


# The demo drafter's products in one pass: (K, N) per layer (q, k, v, o, gate, up, down) x 5 layers
PASS_SHAPES = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)] * 5


def linear_lines(ext, reps: int) -> list[str]:
    out = []
    for m in (1, 7, 9, 16):
        ws = [mx.random.normal((n, k), key=mx.random.key(20 + i)) / 30 for i, (k, n) in enumerate(PASS_SHAPES)]
        panels = [draft_linear.pack(w) for w in ws]
        xs = {k: mx.random.normal((m, k), key=mx.random.key(k)) for k in (576, 1536)}
        mx.eval(ws, list(xs.values()))
        mlx = time_sync(lambda: [xs[k] @ w.T for (k, _), w in zip(PASS_SHAPES, ws)], reps)
        f32 = time_sync(lambda: [ext.invariant_linear(xs[k], w, None) for (k, _), w in zip(PASS_SHAPES, ws)], reps)
        got = time_sync(lambda: [ext.draft_linear(xs[k], p, None, n=n) for (k, n), p in zip(PASS_SHAPES, panels)], reps)
        ref = draft_linear.draft_linear_reference
        diff = max(
            mx.abs(ext.draft_linear(xs[k], p, None, n=n) - ref(xs[k], p, n)).max().item()
            for (k, n), p in zip(PASS_SHAPES[:7], panels)
        )
        out.append(row_linear(f"a pass's 35 products, {m} rows", mlx, f32, got, diff))
    w = mx.random.normal((16185, 576), key=mx.random.key(3)) / 30
    p, x = draft_linear.pack(w), mx.random.normal((7, 576), key=mx.random.key(4))
    mx.eval(w, x)
    mlx = time_sync(lambda: x @ w.T, reps)
    f32 = time_sync(lambda: ext.invariant_linear(x, w, None), reps)
    got = time_sync(lambda: ext.draft_linear(x, p, None, n=16185), reps)
    diff = mx.abs(ext.draft_linear(x, p, None, n=16185) - draft_linear.draft_linear_reference(x, p, 16185)).max().item()
    out.append(row_linear("the draft-vocabulary head (16185 rows), 7 rows", mlx, f32, got, diff))
    return out


def row_linear(name: str, mlx: float, f32: float, got: float, diff: float) -> str:
    return (
        f"| {name} | {mlx * 1e6:.0f} | {f32 * 1e6:.0f} | {got * 1e6:.0f} | {mlx / got:.2f}x | {f32 / got:.2f}x "
        f"| {diff:.1e} |"
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", help="append the report to this file")
    args = ap.parse_args()
    ext = native.ext(warn=False)
    if mx.default_device() != mx.cpu or ext is None or not hasattr(ext, "draft_attention"):
        print("these ops run on the CPU build of the extension", file=sys.stderr)
        return 2
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    blas = active_blas()
    lines = [
        f"## bench_cpu_ops: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"mlx {mx.__version__}, BLAS {blas['name']}, ISA {ext.draft_ops_isa()}",
        f"`python bench/bench_cpu_ops.py {' '.join(sys.argv[1:])}` at {when}; float32, median of {args.reps} "
        "synchronised calls",
        "",
        "| op | reference µs | native µs | speed-up | agreement |",
        "|---|---:|---:|---:|---|",
        *draft_lines(ext, args.reps, 128),
        *draft_lines(ext, args.reps, 1024)[:1],
        "",
        "Decode attention (9 query heads, 3 KV heads, head dim 64): the pure-MLX reference, MLX's attention "
        "once per row (the path it replaces), and the native op; `solo`: each row equals the op on that row "
        "alone, bitwise.",
        "",
        "| width | keys | reference µs | per-row MLX µs | native µs | vs reference | vs per-row | solo | max diff |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---:|",
        *attention_lines(ext, args.reps, 256),
        *attention_lines(ext, args.reps, 2048),
        "",
        f"A drafter pass's products (ISA {ext.draft_linear_isa()}): MLX's matmul and the float32 row kernel "
        "(kernels/invariant_linear.py) on float32 weights, the panel op on the same weights in float16 panels; "
        "max diff: the op against its reference (kernels/draft_linear.py).",
        "",
        "| products | MLX matmul µs | float32 row kernel µs | float16 panels µs | vs MLX | vs row kernel | max diff |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *linear_lines(ext, args.reps),
        "",
        "A target's decode forward on the CPU: its RoPEs and RMS norms, each in one eval (max diff: the native "
        "op against MLX's; the RoPE angles are taken in double precision).",
        "",
        "| ops | reference µs | MLX op µs | native µs | vs reference | vs MLX | max diff |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *target_lines(ext, args.reps, 1),
        *target_lines(ext, args.reps, 3),
        "",
    ]
    bm.emit("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
