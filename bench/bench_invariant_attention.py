"""Microbenchmark of the width-invariant attention op (kernels/invariant.py) on the default device:
the path the device takes (CUDA / Metal instance; on the CPU each row alone through MLX's own
attention) against the pure-MLX chunked reference and MLX's own (not invariant)
scaled_dot_product_attention, at SmolLM2's shape (9 heads, 3 KV heads, D 64) and a Qwen3-4B-like
one (32 / 8, D 128), 16 queries, over caches of 256..4096 keys.

  python bench/bench_invariant_attention.py [--dtype bfloat16] [--reps 200] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import sys
import time

import _package  # noqa: F401


def timed(fn, reps: int) -> float:
    import mlx.core as mx

    for _ in range(5):
        mx.eval(fn())
    t0 = time.perf_counter()
    outs = [fn() for _ in range(reps)]
    mx.eval(outs)
    return (time.perf_counter() - t0) / reps * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out")
    args = ap.parse_args()

    import mlx.core as mx

    from mlx_dspark import benchmark as bm
    from mlx_dspark.kernels import invariant as inv

    dt = getattr(mx, args.dtype)
    path = inv.attention_path()
    lines = [
        f"## invariant attention, {args.dtype}, {bm.device_stamp()}, path {path}",
        f"`{' '.join(sys.argv)}` at {time.strftime('%Y-%m-%d %H:%M')}; µs per call (mean of {args.reps}, "
        "calls queued back to back)",
        "",
        "    shape (H/Hkv/D, Lq, Lk)   native µs  reference µs  mlx sdpa µs  ref/native  sdpa/native",
    ]
    for H, Hkv, D in ((9, 3, 64), (32, 8, 128)):
        for Lk in (256, 1024, 4096):
            Lq = 16
            k1, k2, k3 = mx.random.split(mx.random.key(Lk), 3)
            q = mx.random.normal((1, H, Lq, D), key=k1).astype(dt)
            k = mx.random.normal((1, Hkv, Lk, D), key=k2).astype(dt)
            v = mx.random.normal((1, Hkv, Lk, D), key=k3).astype(dt)
            s = D**-0.5
            ref = timed(lambda: inv.invariant_attention_reference(q, k, v, s), max(args.reps // 10, 5))
            sdpa = timed(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=s, mask="causal"), args.reps)
            nat = timed(lambda: inv.invariant_attention(q, k, v, s), args.reps)  # the path this device takes
            lines.append(
                f"    {H}/{Hkv}/{D}, {Lq}, {Lk:5d}          {nat:9.1f}  {ref:12.1f}  {sdpa:11.1f}  "
                f"{ref / nat:10.2f}  {sdpa / nat:11.2f}"
            )
            print(lines[-1], flush=True)
    lines += [
        "",
        "Is each op width-invariant in the pattern the fixed-width path produces (a plain step at",
        "position p = row 0 of a 16-query block whose keys end at p + 16; a verify row i = row i of",
        "a block whose keys end at p - i + 16)? Bitwise, 16 rows, 9/3/64, keys ~600:",
    ]
    for name, fn in (
        ("invariant op", inv.invariant_attention),
        ("mlx sdpa", lambda q, k, v, s: mx.fast.scaled_dot_product_attention(q, k, v, scale=s, mask="causal")),
    ):
        lines.append(f"    {name}: {'invariant' if fixed_width_invariant(fn, dt) else 'NOT invariant'}")
    lines.append("")
    bm.emit("\n".join(lines), args.out)
    return 0


def fixed_width_invariant(fn, dt) -> bool:
    import mlx.core as mx

    W, L = 16, 600
    k1, k2, k3 = mx.random.split(mx.random.key(1), 3)
    q = mx.random.normal((1, 9, L + W, 64), key=k1).astype(dt)
    k = mx.random.normal((1, 3, L + W, 64), key=k2).astype(dt)
    v = mx.random.normal((1, 3, L + W, 64), key=k3).astype(dt)
    s = 0.125
    p = L - W  # the verify block starts here: rows p .. p + 15
    block = fn(q[:, :, p : p + W], k[:, :, : p + W], v[:, :, : p + W], s)
    for i in range(W):
        step = fn(q[:, :, p + i : p + i + W], k[:, :, : p + i + W], v[:, :, : p + i + W], s)
        if not mx.array_equal(step[:, :, 0], block[:, :, i]).item():
            return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())
