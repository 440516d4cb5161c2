"""Does a prefill depend on how the prompt was split? Bitwise, on the demo model in float32 (CPU).

(a) one cold prefill of N tokens; (b) a prefill chunk of the first W tokens (what an entry keeps),
then the rest (a split anywhere); (c) a warm turn through the real PrefixCache after a first turn
of W tokens. Prints, for (b) and (c) against (a), whether the last logits and the KV are bitwise
equal and where the KV first differs. `--path grid` runs the fallback (MLX_DSPARK_SPLIT_PREFILL=off:
OpenBLAS linears, the routed attention ops, reuse on the chunk grid); `--path split` (default)
the split-invariant prefill (kernels/split_prefill.py).

`--ops` measures the components alone on random inputs at the demo's shapes instead: which
linears, attention ops, norms, RoPE offsets and elementwise ops give a row the same bits whatever
the rows around it. `--speed N` times a cold prefill of N tokens on both paths (interleaved).

  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
    python bench/prefix_split_bitwise.py --n 2300 --w 1900 [--path split|grid] [--attention routed|mlx|numpy]
    python bench/prefix_split_bitwise.py --ops | --speed 4096
"""

from __future__ import annotations

import argparse
import os
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


def _differ(a, b) -> int:
    """Rows (first axis after flattening all but the last) of a and b that differ."""
    a, b = np.asarray(a).reshape(-1, a.shape[-1]), np.asarray(b).reshape(-1, b.shape[-1])
    return int(np.any(a != b, axis=1).sum())


def ops() -> None:
    """Which components give a row the same bits whatever its chunk (random inputs, demo shapes)."""
    from mlx_lm.models.activations import swiglu

    from mlx_dspark.kernels import invariant_linear as il

    rng = np.random.default_rng(0)
    f32 = np.float32
    print(f"blas {blas.active_blas().get('name')}, invariant product path {il.linear_path()}")
    X = rng.standard_normal((2300, 1536)).astype(f32)
    for K, N in [(576, 576), (576, 192), (576, 1536), (1536, 576)]:
        W = mx.array(rng.standard_normal((N, K)).astype(f32))
        x = mx.array(X[:, :K])
        for name, f in [("BLAS matmul", lambda z: z @ W.T), ("invariant product", lambda z: il.dense(z, W))]:
            ref = np.array(f(x))  # 2,300 rows
            bad = []
            for m, off in [(1, 0), (2, 5), (7, 0), (8, 3), (16, 0), (37, 1900), (64, 0), (189, 2048), (2048, 0)]:
                bad += [m] if _differ(np.array(f(x[off : off + m])), ref[off : off + m]) else []
            print(f"  linear {K}->{N}, {name}: rows differ from a 2,300-row call at M = {bad or 'none'}")
    H, Hkv, D, L = 9, 3, 64, 2300
    q, k, v = (mx.array(rng.standard_normal((1, h, L, D)).astype(f32)) for h in (H, Hkv, Hkv))
    sc = D**-0.5
    splits = [(1900, 2300), (0, 1), (5, 37), (1000, 2048), (2047, 2048), (2100, 2121)]
    for name, f in [
        (
            "MLX sdpa",
            lambda a, b: mx.fast.scaled_dot_product_attention(
                q[:, :, a:b], k[:, :, :b], v[:, :, :b], scale=sc, mask="causal"
            ),
        ),
        ("attention_blocks", lambda a, b: cpu_attention.attention_blocks(q[:, :, a:b], k[:, :, :b], v[:, :, :b], sc)),
        ("attention_split", lambda a, b: cpu_attention.attention_split(q[:, :, a:b], k[:, :, :b], v[:, :, :b], sc)),
    ]:
        full = np.array(f(0, L))
        bad = [(a, b) for a, b in splits if _differ(np.array(f(a, b)), full[:, :, a:b])]
        print(f"  attention {name}: chunks [a, b) over keys [0, b) that differ from one call over all: {bad or 'none'}")
    x = mx.array(rng.standard_normal((1, H, L, D)).astype(f32))
    bad = []
    for trad in (False, True):
        full = np.array(mx.fast.rope(x, D, traditional=trad, base=1e5, scale=1.0, offset=0))
        for a, b in splits:
            part = mx.fast.rope(x[:, :, a:b], D, traditional=trad, base=1e5, scale=1.0, offset=a)
            bad += [(trad, a, b)] if _differ(np.array(part), full[:, :, a:b]) else []
    print(f"  mx.fast.rope at offset a vs in one call from 0: differ {bad or 'nowhere'}")
    h = mx.array(X[None, :, :576])
    w = mx.array(rng.standard_normal(576).astype(f32))
    full = np.array(mx.fast.rms_norm(h, w, 1e-5))
    bad = [(a, b) for a, b in splits if _differ(np.array(mx.fast.rms_norm(h[:, a:b], w, 1e-5)), full[:, a:b])]
    print(f"  mx.fast.rms_norm rows: differ {bad or 'nowhere'}")
    for width in (1536, 37):
        g, u = mx.array(X[None, :, :width]), mx.array(X[None, ::-1, :width].copy())
        full = np.array(swiglu(g, u))
        bad = [(a, b) for a, b in splits if _differ(np.array(swiglu(g[:, a:b], u[:, a:b])), full[:, a:b])]
        print(f"  swiglu (width {width}) rows: differ {bad or 'nowhere'}")
    z = rng.standard_normal(1 << 20).astype(f32) * 10
    e = np.exp(z)
    bad = [(a, b) for a, b in [(1, 2), (3, 40), (7, 1000), (13, 4099)] if not np.array_equal(np.exp(z[a:b]), e[a:b])]
    print(f"  numpy exp (float32) at other offsets and lengths: differs {bad or 'nowhere'} (numpy {np.__version__})")


def speed(n: int) -> None:
    t, tok = md.load_target(str(demo_model_path()), dtype="float32")
    ids = tok.encode(open(__file__).read() * 60)[:n]
    assert len(ids) == n
    for path in ("grid", "split", "grid", "split"):
        os.environ["MLX_DSPARK_SPLIT_PREFILL"] = "off" if path == "grid" else "on"
        cache = t.make_cache()
        t0, c0 = time.perf_counter(), time.process_time()
        loop._prefill(t, cache, ids, ())
        mx.eval([c.state for c in cache])
        print(
            f"cold prefill of {n} tokens, path {path}: wall {time.perf_counter() - t0:.2f}s, "
            f"cpu {time.process_time() - c0:.2f}s (load {os.getloadavg()[0]:.1f})",
            flush=True,
        )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2300)
    ap.add_argument("--w", type=int, default=1900)
    ap.add_argument("--path", choices=["split", "grid"], default="split")
    ap.add_argument("--attention", choices=["routed", "mlx", "numpy"], default="routed")
    ap.add_argument("--ops", action="store_true")
    ap.add_argument("--speed", type=int, default=0)
    a = ap.parse_args()
    if a.ops:
        return ops()
    if a.speed:
        return speed(a.speed)
    if a.path == "grid":
        os.environ["MLX_DSPARK_SPLIT_PREFILL"] = "off"
    if a.attention != "routed":
        cpu_attention.MIN_SCORES = 1 << 62 if a.attention == "mlx" else 2
    t, tok = md.load_target(str(demo_model_path()), dtype="float32")
    ids = tok.encode(open(__file__).read() * 20)[: a.n]
    assert len(ids) == a.n
    print(
        f"blas {blas.active_blas().get('name')}, path {a.path}, attention {a.attention}, chunk {loop.PREFILL_CHUNK}, "
        f"N {a.n}, W {a.w}"
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
        print(f"(c) no entry: a first prompt of {a.w} tokens has no whole chunk of {pc.grid}")
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
