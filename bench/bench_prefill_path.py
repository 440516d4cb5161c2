"""A prompt's prefill through MLX's matmuls (native) against the invariant kernels, on this machine.

  MLX_DSPARK_OPENBLAS=0 python bench/bench_prefill_path.py [--model M] [--lengths 32,256,1024]
                                                           [--reps 2] [--out FILE.md]

Why: on MLX's bundled reference BLAS a prefill (a GEMM over the prompt's rows) costs more per token
than decoding the prompt one token at a time, while the invariant kernels (csrc/, the CPU's decode
path there) take any width at their own speed. The load times both on 32 tokens and prefills
through the kernels where they win (models/invariance.py `_kernels_prefill_faster`; the verdict
reads "kernels+prefill"). This times the product's own prefill (`target.forward(..., last_only=True)`
on a fresh cache) both ways at each length (best of --reps after a warm-up), says which way the load
chose, and checks that a generation gives the same tokens and text in baseline and lookup mode with
the load's choice. Run it with and without OpenBLAS (the CLI preloads it; a bare python does not).
"""

from __future__ import annotations

import argparse
import os
import time

import _package  # noqa: F401  (the installed mlx_dspark, else python/)
import mlx.core as mx

from mlx_dspark.benchmark import cpu_name, emit, load_bench_target  # noqa: E402


def prefill_s(target, n: int, through_kernels: bool, reps: int) -> float:
    ids = mx.array([[(13 * i + 5) % max(target.vocab_size, 2) for i in range(n)]], dtype=mx.int32)
    chosen = target.kernel_prefill
    target.kernel_prefill = through_kernels
    try:
        best = float("inf")
        for r in range(reps + 1):  # the first one warms up
            t0 = time.perf_counter()
            mx.eval(target.forward(ids, target.make_cache(), last_only=True).logits)
            if r:
                best = min(best, time.perf_counter() - t0)
    finally:
        target.kernel_prefill = chosen
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--lengths", default="32,256,1024")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args()
    from mlx_dspark.api import generate
    from mlx_dspark.blas import active_blas

    t0 = time.perf_counter()
    model, target, tok = load_bench_target(a.model, "float32")
    load_s = time.perf_counter() - t0
    emit(
        f"\n### bench_prefill_path.py: {os.path.basename(str(model))} (float32), {cpu_name()}, "
        f"BLAS {active_blas()['name']}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n"
        f"load {load_s:.1f} s; the load's verdict: **{target.invariance}** (prefill through the kernels: "
        f"{'yes' if target.kernel_prefill else 'no'})\n",
        a.out,
    )
    if not target.invariant_kernels:
        emit("the kernels path is not this target's decode path here: nothing to compare\n", a.out)
        return 0
    emit("| prompt tokens | native s | kernels s | native / kernels |\n|---|---|---|---|", a.out)
    for n in (int(x) for x in a.lengths.split(",")):
        nat, ker = prefill_s(target, n, False, a.reps), prefill_s(target, n, True, a.reps)
        emit(f"| {n} | {nat:.3f} | {ker:.3f} | {nat / ker:.2f}x |", a.out)
    prompt = "Summarize the rules of chess for a beginner, then list three opening principles. " * 6
    base = generate(target, tok, prompt, mode="baseline", max_new_tokens=32)
    look = generate(target, tok, prompt, mode="lookup", max_new_tokens=32)
    same = look.tokens == base.tokens and look.text == base.text
    emit(
        f"\ngenerate ({base.prompt_tokens} prompt tokens, the load's choice): prefill {base.prefill_s:.2f} s; "
        f"lookup equals baseline in tokens and text: {'yes' if same else 'NO'}\n",
        a.out,
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
