"""Does a prefill depend on how the prompt was split? Bitwise, on the demo model in float32 (CPU).

(a) one cold prefill of N tokens; (b) a prefill of the first W tokens, then the rest (a split
anywhere, what a warm turn did before the prefill grid); (c) a warm turn through the real
PrefixCache after a first turn of W tokens (reuse on the grid). Prints, for (b) and (c) against
(a), whether the last logits and the KV are bitwise equal and where the KV first differs.

  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
    python bench/prefix_split_bitwise.py --n 2300 --w 1900 [--attention routed|mlx|numpy]
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import numpy as np

import mlx_dspark as md
from mlx_dspark import blas
from mlx_dspark.decode import loop
from mlx_dspark.kernels import cpu_attention
from mlx_dspark.models.demo import demo_model_path
from mlx_dspark.serve.prefix_cache import PrefixCache


def kv(cache, n):
    return [(np.array(c.keys[..., :n, :]), np.array(c.values[..., :n, :])) for c in cache]


def compare(name, la, kva, lb, kvb, dt):
    first = None
    for i, ((ka, va), (kb, vb)) in enumerate(zip(kva, kvb)):
        d = np.nonzero(np.any(ka != kb, axis=(0, 1, 3)) | np.any(va != vb, axis=(0, 1, 3)))[0]
        if len(d) and first is None:
            first = (i, int(d[0]), len(d))
    print(
        f"{name}: {dt:.2f}s; last logits bitwise equal {np.array_equal(la, lb)} (max |diff| "
        f"{float(np.abs(la - lb).max()):.3g}); KV "
        + (
            "equal in every layer"
            if first is None
            else f"first differs in layer {first[0]} at position {first[1]} ({first[2]} positions there)"
        )
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2300)
    ap.add_argument("--w", type=int, default=1900)
    ap.add_argument("--attention", choices=["routed", "mlx", "numpy"], default="routed")
    a = ap.parse_args()
    if a.attention != "routed":
        cpu_attention.MIN_SCORES = 1 << 62 if a.attention == "mlx" else 2
    t, tok = md.load_target(str(demo_model_path()), dtype="float32")
    ids = tok.encode(open(__file__).read() * 20)[: a.n]
    assert len(ids) == a.n
    print(
        f"blas {blas.active_blas().get('name')}, attention {a.attention}, chunk {loop.PREFILL_CHUNK}, N {a.n}, W {a.w}"
    )
    cache = t.make_cache()
    t0 = time.perf_counter()
    la, _ = loop._prefill(t, cache, ids, ())
    la = np.array(la)
    print(f"(a) cold prefill: {time.perf_counter() - t0:.2f}s")
    kva = kv(cache, a.n)
    cache = t.make_cache()
    t0 = time.perf_counter()
    loop.prefill_chunk(t, cache, mx.array(ids[: a.w], dtype=mx.int32)[None], ())  # what an entry keeps
    lb, _ = loop._prefill(t, cache, ids[a.w :], ())
    compare(f"(b) split at {a.w}", la, kva, np.array(lb), kv(cache, a.n), time.perf_counter() - t0)
    pc = PrefixCache(t)
    md.generate(t, tok, None, prompt_ids=ids[: a.w], mode="baseline", max_new_tokens=3, prefix_cache=pc)
    hit = pc.lookup(ids)
    if hit is None:
        print(f"(c) no entry: a first prompt of {a.w} tokens has no whole chunk of {loop.PREFILL_CHUNK}")
        return
    t0 = time.perf_counter()
    lc, _ = loop._prefill(t, hit.cache, ids[hit.reused :], ())
    compare(
        f"(c) prefix-cache hit reusing {hit.reused}",
        la,
        kva,
        np.array(lc),
        kv(hit.cache, a.n),
        time.perf_counter() - t0,
    )


if __name__ == "__main__":
    main()
