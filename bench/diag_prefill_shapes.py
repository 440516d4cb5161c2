"""What a prefill chunk of a new shape costs the first time, against the same shape again.

  python bench/diag_prefill_shapes.py [--model M] [--precision bf16|8|4|f32] [--prefix 2048]
                                      [--tails 189,311,64,128] [--out FILE.md]

Why: on the H200 a prefix-cache follow-up turn (2048 cached positions, a 189- or 311-token tail)
spent ~100 ms prefilling the tail, as long as a cold server's whole 2,237-token prompt
(bench/results/batch-h200.md). A fixed cost per new shape would do that: MLX's CUDA attention
builds a cuDNN graph per (query length, key length) and caches it (LRU), and its matmuls pick a
plan per shape. This times, through the product's own prefill (decode/loop.prefill_chunk), a
tail of each width after a prefix of --prefix positions: the first call of the (width, offset)
pair, then the same pair again on a fresh copy of the prefix, then the same width after a prefix
one position longer (a new key length only). Read: first >> again means a per-shape build.
"""

from __future__ import annotations

import argparse
import time

import _package
import mlx.core as mx


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--precision", default="bf16", choices=_package.PRECISIONS)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--tails", default="189,311,64,128")
    ap.add_argument("--out")
    a = ap.parse_args()
    from mlx_dspark.decode.loop import prefill_chunk

    target, _, model = _package.load_precision(a.model, a.precision)
    vocab = target.vocab_size
    ids = mx.array([[(37 * i + 11) % vocab for i in range(a.prefix + 1 + 2 * 1024)]], dtype=mx.int32)

    def prefilled(n: int) -> list:
        cache = target.make_cache()
        prefill_chunk(target, cache, ids[:, :n], ())
        mx.eval([c.state for c in cache])
        return cache

    def tail_ms(n_prefix: int, width: int) -> float:
        cache = prefilled(n_prefix)
        t = time.perf_counter()
        out = prefill_chunk(target, cache, ids[:, n_prefix : n_prefix + width], ())
        mx.eval(out.logits, [c.state for c in cache])
        return (time.perf_counter() - t) * 1e3

    prefilled(a.prefix)  # the prefix's own shape, once, untimed
    lines = [
        f"## prefill chunk cost by shape: {model} {a.precision}, {mx.default_device()}, mlx {mx.__version__}",
        f"`python bench/diag_prefill_shapes.py --precision {a.precision} --prefix {a.prefix} --tails {a.tails}`",
        "",
        "| tail width | first (new width and key length) ms | same shape again ms | key length + 1 ms |",
        "|---|---|---|---|",
    ]
    for w in (int(x) for x in a.tails.split(",")):
        first = tail_ms(a.prefix, w)
        again = tail_ms(a.prefix, w)
        shifted = tail_ms(a.prefix + 1, w)
        lines.append(f"| {w} | {first:.1f} | {again:.1f} | {shifted:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "a") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
