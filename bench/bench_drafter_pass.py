"""The drafter's products on the CPU: MLX's matmul (BLAS sgemm) against the native row kernel
(kernels/native_products.py), in one process, interleaved.

  python bench/bench_drafter_pass.py [--model M] [--drafter D] [--tokens 96] [--out FILE]
  (with and without OpenBLAS: LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0)

1. Products: the drafter's own dense weights (every backbone linear, in its order) over 7 rows,
   each product once per call, MLX's op against the native kernel; and the draft vocabulary's head.
2. Drafter pass: one DSpark round's draft (DrafterProposer.propose, forced to its end) at a fixed
   context, native products off / on alternately.
3. Decode: `generate(mode="dspark")` with native products off / on against plain greedy on the
   chat, code and maths prompts of `mlx-dspark benchmark`: tok/s and tokens per round, every run
   checked against plain decoding in tokens and text.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import _package  # noqa: F401  (the installed mlx_dspark, else python/)
import mlx.core as mx
import mlx.nn as nn
from bench_kernels import time_sync

from mlx_dspark import benchmark as bm
from mlx_dspark.api import generate
from mlx_dspark.blas import active_blas
from mlx_dspark.decode.drafting import DrafterProposer
from mlx_dspark.kernels import native_products
from mlx_dspark.models.drafters import resolve_drafter


class Switch:
    """Native products on or off: off makes the routing see an unavailable kernel."""

    def __init__(self):
        self._available = native_products.available

    def __call__(self, on: bool) -> None:
        native_products.available = self._available if on else (lambda: False)


def products(drafter, reps: int) -> list[str]:
    weights = [
        m.weight for _, m in drafter.model.named_modules() if isinstance(m, nn.Linear) and m.weight.shape[0] < 8192
    ]
    xs = [mx.random.normal((7, w.shape[1])).astype(w.dtype) for w in weights]
    mx.eval(xs)

    def mlx_op():
        return [x @ w.T for x, w in zip(xs, weights)]

    def native():
        with native_products.native_products():
            return [native_products.dense(x, w) for x, w in zip(xs, weights)]

    a, b = time_sync(mlx_op, reps) * 1e3, time_sync(native, reps) * 1e3
    return [
        f"| {len(weights)} dense linears (backbone, fc, confidence head), 7 rows | {a:.2f} | {b:.2f} | {a / b:.2f}x |"
    ]


def pass_ms(target, drafter, ids: list[int], switch: Switch, reps: int) -> dict:
    fwd = target.forward(mx.array([ids]), target.make_cache(), taps=drafter.taps)
    mx.eval(fwd.hidden)
    rows = fwd.hidden[0]
    props = {}
    for on in (False, True):
        switch(on)
        p = DrafterProposer(drafter, lookup_drafts=False)
        p.begin(target, ids[:-1], rows[:-1])
        props[on] = (p, list(ids))
    times: dict = {False: [], True: []}
    for i in range(2 * reps + 4):
        on = bool(i % 2)
        switch(on)
        p, hist = props[on]
        t = time.perf_counter()
        toks = p.propose(hist, drafter.block_drafts, None).read()
        if i >= 4:
            times[on].append(time.perf_counter() - t)
        p.observe(1, 0, rows[-1:])  # the same context row each time: a fixed-size context
        hist.append(toks[0])
    switch(True)
    return {on: statistics.median(ts) * 1e3 for on, ts in times.items()}


def decode(target, tok, drafter, switch: Switch, tokens: int) -> list[str]:
    lines = []
    for domain in ("chat", "code", "math"):
        for prompt in bm.PROMPT_SETS[domain]:
            base = generate(target, tok, prompt, mode="baseline", max_new_tokens=tokens)
            runs = {}
            for on in (False, True, False, True):
                switch(on)
                r = generate(target, tok, prompt, mode="dspark", drafter=drafter, max_new_tokens=tokens)
                same = r.tokens == base.tokens and r.text == base.text
                best = runs.get(on)
                if best is None or r.decode_tps > best[0]:
                    runs[on] = (r.decode_tps, r.mean_accept_len, same and (best is None or best[2]))
            switch(True)
            off, on_ = runs[False], runs[True]
            lines.append(
                f"| {domain} | {prompt[:36]} | {base.decode_tps:.1f} | {off[0]:.1f} | {off[1]:.2f} | {on_[0]:.1f} "
                f"| {on_[1]:.2f} | {on_[0] / off[0]:.2f}x | {'yes' if off[2] and on_[2] else 'NO'} |"
            )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="default: the demo model")
    ap.add_argument("--drafter", help="default: the registered DSpark drafter")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--out", help="append the report to this file")
    args = ap.parse_args()
    if not native_products.available():
        print("the native kernel does not run here (not the CPU, or no extension built)", file=sys.stderr)
        return 2
    model, target, tok = bm.load_bench_target(args.model, dtype="float32")
    drafter = resolve_drafter(target, mode="dspark", drafter=args.drafter)
    switch = Switch()
    blas = active_blas()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out = [
        f"## bench_drafter_pass: {os.path.basename(str(model))}, {bm.device_stamp()}; drafter {drafter.source}, "
        f"block {drafter.block_drafts}",
        f"`{' '.join(['bench/bench_drafter_pass.py', *sys.argv[1:]])}` at {when}; {platform.machine()}, "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; BLAS {blas['name']} ({blas['path']})",
        "",
        "| product | MLX ms | native ms | native speed |",
        "|---|---:|---:|---:|",
        *products(drafter, args.reps),
    ]
    ids = tok.encode(bm.PROMPT_SETS["code"][0])
    ms = pass_ms(target, drafter, ids, switch, args.reps)
    out += [
        f"| one drafter pass (propose, {drafter.block_drafts} drafts) | {ms[False]:.2f} | {ms[True]:.2f} "
        f"| {ms[False] / ms[True]:.2f}x |",
        "",
    ]
    if not args.no_decode:
        out += [
            f'Decode, `mode="dspark"` (its lookup drafts too), {args.tokens} new tokens, greedy, best of 2 per '
            "side, the sides alternating:",
            "",
            "| domain | prompt | baseline tok/s | MLX products tok/s | accept | native tok/s | accept | native/MLX "
            "| same as baseline |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|",
            *decode(target, tok, drafter, switch, args.tokens),
            "",
        ]
    text = "\n".join(out)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
