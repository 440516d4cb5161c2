"""CPU prefill attention: MLX's own causal attention against kernels/cpu_attention.py at a
prefill chunk's shapes (SmolLM2-135M: 9 query heads, 3 KV heads, head dim 64), float32.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        python bench/bench_cpu_attention.py [--lq 2048] [--lk 4096 12288 20480]

Prints wall and CPU seconds of one call of each, their ratio, and the largest difference; with
--split also `attention_split` (the split-invariant prefill's op) against `attention_blocks`.
--skip-mlx leaves MLX's own kernel out (slow at long keys)."""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import numpy as np

from mlx_dspark.kernels import cpu_attention


def timed(f, reps):
    f()
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(reps):
        out = f()
    return (time.perf_counter() - w0) / reps, (time.process_time() - c0) / reps, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lq", type=int, default=2048)
    ap.add_argument("--lk", type=int, nargs="+", default=[4096, 12288, 20480])
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--split", action="store_true", help="also time attention_split against attention_blocks")
    ap.add_argument("--skip-mlx", action="store_true", help="do not time MLX's own kernel")
    a = ap.parse_args()
    mx.set_default_device(mx.cpu)
    rng = np.random.default_rng(0)
    scale = a.head_dim**-0.5
    print(f"Lq {a.lq}, heads {a.heads}/{a.kv_heads}, head dim {a.head_dim}, float32, CPU")
    print("Lk      mlx wall  cpu      ours wall  cpu      speedup (wall)  max |diff|")
    for lk in a.lk:
        q = mx.array(rng.standard_normal((1, a.heads, a.lq, a.head_dim)).astype(np.float32))
        k = mx.array(rng.standard_normal((1, a.kv_heads, lk, a.head_dim)).astype(np.float32))
        v = mx.array(rng.standard_normal((1, a.kv_heads, lk, a.head_dim)).astype(np.float32))
        mx.eval(q, k, v)

        def mlx_call():
            o = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
            mx.eval(o)
            return o

        def ours():
            o = cpu_attention.attention_blocks(q, k, v, scale)
            mx.eval(o)
            return o

        def split():
            o = cpu_attention.attention_split(q, k, v, scale)
            mx.eval(o)
            return o

        ow, oc, got = timed(ours, a.reps)
        if a.skip_mlx:
            mw = mc = float("nan")
            diff = float("nan")
        else:
            mw, mc, ref = timed(mlx_call, a.reps)
            diff = float(mx.max(mx.abs(ref - got)))
        print(f"{lk:<7} {mw:8.2f}  {mc:7.2f}  {ow:9.2f}  {oc:7.2f}  {mw / ow:14.2f}  {diff:.2e}")
        if a.split:
            sw, sc, sgot = timed(split, a.reps)
            sdiff = float(mx.max(mx.abs(sgot - got)))
            print(
                f"        split: wall {sw:.2f} s, cpu {sc:.2f} s; split / blocks (wall) {sw / ow:.2f}; "
                f"max |diff| {sdiff:.2e}"
            )


if __name__ == "__main__":
    main()
