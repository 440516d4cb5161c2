"""MoE experts in the prefill: mlx-lm's QuantizedSwitchLinear (mx.gather_qmm) against the
wide-GEMM path (kernels/wide_gemm.py: dequantize once + mx.gather_mm), same routed rows.

    python bench/bench_moe_wide_gemm.py                 # CPU float32 (preload OpenBLAS to see the BLAS path)
    PYTHONPATH=python python bench/bench_moe_wide_gemm.py --dtype bfloat16   # the H200

Shapes: one expert projection of a Qwen3-30B-A3B-like MoE layer (128 experts, hidden 2048,
expert width 768, top-8) over --tokens prefill tokens, sorted as SwitchGLU sorts them. Prints the
time of each (median of --reps, evaluated), the speed-up, and whether the outputs are bitwise equal
(the GPU policy keeps experts off until this says equal and faster there).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import _package  # noqa: F401
import mlx.core as mx


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, _gather_sort

    from mlx_dspark.kernels import wide_gemm as wg

    dtype = getattr(mx, a.dtype)
    mx.random.seed(0)
    layer = QuantizedSwitchLinear(a.hidden, a.width, a.experts, bias=False, bits=a.bits)
    layer.scales, layer.biases = layer.scales.astype(dtype), layer.biases.astype(dtype)
    compute = "float32" if mx.default_device() == mx.cpu else "model"
    print(
        f"# MoE experts in the prefill: gather_qmm vs dequantize-once gather_mm ({platform.machine()}, "
        f"MLX {mx.__version__}, {mx.default_device()}, {a.dtype}, {a.bits}-bit, {a.experts} experts "
        f"{a.width}x{a.hidden}, top-{a.top_k})"
    )
    print("| tokens | gather_qmm (ms) | dense (ms) | speed-up | bitwise equal | max abs diff |")
    print("|---|---|---|---|---|---|")
    for n in a.tokens:
        x = mx.expand_dims(mx.random.normal((n, a.hidden)).astype(dtype), (-2, -3))
        idx = mx.random.randint(0, a.experts, (n, a.top_k))
        xs, si, _ = _gather_sort(x, idx)
        mx.eval(xs, si)

        def t(fn):
            mx.eval(fn())
            out = []
            for _ in range(a.reps):
                s = time.perf_counter()
                mx.eval(fn())
                out.append(time.perf_counter() - s)
            return statistics.median(out)

        q = lambda: layer(xs, si, sorted_indices=True)  # noqa: E731
        d = lambda: wg.dense_switch_linear(layer, xs, si, True, compute)  # noqa: E731
        tq, td = t(q), t(d)
        ref, got = q(), d()
        diff = float(mx.abs(ref.astype(mx.float32) - got.astype(mx.float32)).max().item())
        eq = bool(mx.array_equal(ref, got).item())
        print(f"| {n} | {tq * 1e3:.2f} | {td * 1e3:.2f} | {tq / td:.2f}x | {eq} | {diff:.2e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
