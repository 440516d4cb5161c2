"""The device time of a batched step's per-row ops, against one launch over every row (issue 18).

  python bench/diag_row_ops.py [--keys 300] [--reps 20]

A batched decode step (models/compiled_decode.py `rows`) runs, per layer and per row, one
attention launch (the invariant op's offset form) and two cache writes (mx.slice_update). On a GPU
these queue on one stream, so their latencies add. This times, on the demo's shapes (9 query
heads, 3 KV heads, head dim 64, KV buffers of 1024 positions, `--keys` of them filled), 30 layers'
worth of: B attention launches of one row each; one launch of B rows (the same kernel with a
batch of B; one offset for all, so a timing stand-in only); and 2B slice updates a layer (each
copies its buffer here, its input staying referenced; in the compiled step MLX may write in place).
B = 1's "a launch a row" is the floor. Time: every call enqueued, one eval at the end, best of
`--reps` (MLX's launches and the device's work together, as in a step).
"""

from __future__ import annotations

import argparse
import time

import _package  # noqa: F401
import mlx.core as mx


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=300)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rows", default="1,4,8")
    args = ap.parse_args()
    from mlx_dspark.kernels.invariant import invariant_attention_gpu

    L, H, KV, D, CAP = 30, 9, 3, 64, 1024
    dt = mx.bfloat16
    scale = D**-0.5
    off = mx.array(args.keys, dtype=mx.int32)

    def best(fn):
        fn()  # compile / warm
        ts = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return min(ts) * 1e3

    print(f"device: {mx.default_device()}; 30 layers' worth of calls, ms (best of {args.reps}, one eval each)")
    for B in [int(x) for x in args.rows.split(",")]:
        qs = [mx.random.normal((1, H, 1, D)).astype(dt) for _ in range(B)]
        ks = [mx.random.normal((1, KV, CAP, D)).astype(dt) for _ in range(B)]
        vs = [mx.random.normal((1, KV, CAP, D)).astype(dt) for _ in range(B)]
        qb, kb, vb = mx.concatenate(qs), mx.concatenate(ks), mx.concatenate(vs)
        new = [mx.random.normal((1, KV, 1, D)).astype(dt) for _ in range(B)]
        mx.eval(qs, ks, vs, qb, kb, vb, new)

        def per_row():
            mx.eval(
                [invariant_attention_gpu(q, k, v, scale, offset=off) for _ in range(L) for q, k, v in zip(qs, ks, vs)]
            )

        def one_launch():
            mx.eval([invariant_attention_gpu(qb, kb, vb, scale, offset=off) for _ in range(L)])

        def writes():
            start = off.reshape(1)
            mx.eval([mx.slice_update(c, n, start, axes=(2,)) for _ in range(L) for c, n in zip(ks + vs, new + new)])

        print(
            f"B = {B}: attention, a launch a row {best(per_row):.3f}; one launch of {B} rows {best(one_launch):.3f}; "
            f"{2 * B} cache writes a layer {best(writes):.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
