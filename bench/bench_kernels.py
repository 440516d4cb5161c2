"""Kernel microbenchmarks: ratios from one run, printed and saved as markdown.

    python bench/bench_kernels.py                    # default device (CPU here)
    python bench/bench_kernels.py --out bench/results/kernels-cpu.md
    (on the H200, MLX's CUDA backend: the same command, --out .../kernels-cuda.md)

Measures, against the pure-MLX references:
  * greedy verify-accept (V = 151936, w = 8, B = 1): the native path of this backend (CPU
    primitive; CUDA instance, one launch and two), plus mx.argmax alone for scale;
  * sampling accept (same shape, float32 p, with q and one-hot);
  * wide-GEMM prefill: a Qwen3-4B-shaped stack of 4-bit layers at 2048 tokens (CUDA; a small
    stack on CPU), stock quantized matmuls against dequantize-once dense GEMMs.
Two timings per kernel: `sync` = one call then mx.eval (what the verify loop sees, launch and
host sync included) and `pipelined` = N independent calls evaluated together (per-call device
time, launch gaps included). Bandwidth: the logits are read once (B*w*V*itemsize bytes); the
fraction is of the H200's measured 4.3 TB/s copy bandwidth.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import _package  # noqa: E402,F401  (the installed mlx_dspark, else python/)
import mlx.core as mx
import mlx.nn as nn

from mlx_dspark import kernels  # noqa: E402
from mlx_dspark.kernels import gpu, wide_gemm  # noqa: E402
from mlx_dspark.kernels import native as _native  # noqa: E402
from mlx_dspark.kernels.reference import greedy_accept_reference, sampling_accept_reference  # noqa: E402

H200_BW = 4.3e12
LINES: list[str] = []


def emit(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def time_sync(fn, reps: int) -> float:
    """Median seconds of fn() + mx.eval over `reps` calls (after warm-up)."""
    for _ in range(3):
        mx.eval(fn())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def time_pipelined(fn, n: int, rounds: int = 5) -> float:
    """Seconds per call when n calls are evaluated together (median over rounds)."""
    mx.eval([fn() for _ in range(2)])
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(n)])
        ts.append((time.perf_counter() - t0) / n)
    return statistics.median(ts)


def time_eval_only(fn, n: int, rounds: int = 5) -> float:
    """Seconds per call of mx.eval over n calls whose graphs were built before the timer (device
    time, launch gaps and MLX's per-kernel encoding; no Python)."""
    mx.eval([fn() for _ in range(2)])
    ts = []
    for _ in range(rounds):
        outs = [fn() for _ in range(n)]
        t0 = time.perf_counter()
        mx.eval(outs)
        ts.append((time.perf_counter() - t0) / n)
    return statistics.median(ts)


def fmt_us(s: float) -> str:
    return f"{s * 1e6:9.1f}"


# ------------------------------------------------------------------------- verify-accept
def bench_greedy(backend: str, reps: int, n_pipe: int, B=1, w=8, V=151936):
    emit(f"## Greedy verify-accept (B={B}, w={w}, V={V})\n")
    emit(
        "| dtype | path | sync µs | pipelined µs | eval-only µs | vs ref (sync) | vs ref (pipelined) "
        "| vs ref (eval-only) | GB/s (eval-only) | % of 4.3 TB/s |"
    )
    emit("|---|---|---|---|---|---|---|---|---|---|")
    for dtype in (mx.bfloat16, mx.float32):
        lg = mx.random.normal((B, w, V)).astype(dtype)
        tgt = greedy_accept_reference(lg, mx.zeros((B, w - 1), mx.int32))[0]
        d = mx.concatenate([tgt[:, :4], (tgt[:, 4 : w - 1] + 1) % V], axis=1).astype(mx.int32)
        mx.eval(lg, d)
        nbytes = lg.size * lg.itemsize
        paths = {"reference": lambda: greedy_accept_reference(lg, d), "mx.argmax only": lambda: mx.argmax(lg, -1)}
        if backend == "cuda":
            paths["cuda one launch"] = lambda: gpu.greedy_accept(lg, d, lang="cuda", fused=True)
            paths["cuda two launches"] = lambda: gpu.greedy_accept(lg, d, lang="cuda", fused=False)
        elif backend == "cpu" and _native.ext(warn=False) is not None:
            ext = _native.ext(warn=False)
            paths["native primitive"] = lambda: ext.greedy_accept(lg, d, stream=mx.cpu)
        paths["kernels.greedy_accept"] = lambda: kernels.greedy_accept(lg, d)
        ref = greedy_accept_reference(lg, d)
        for name, fn in paths.items():  # every path must agree before it is timed
            if name not in ("mx.argmax only",):
                out = fn()
                assert all(mx.array_equal(a, b).item() for a, b in zip(out, ref)), name
        res = {
            name: (time_sync(fn, reps), time_pipelined(fn, n_pipe), time_eval_only(fn, n_pipe))
            for name, fn in paths.items()
        }
        r_sync, r_pipe, r_eval = res["reference"]
        for name, (ts, tp, te) in res.items():
            bw = nbytes / te / 1e9
            frac = f"{100 * nbytes / te / H200_BW:.1f}%" if backend == "cuda" else "-"
            emit(
                f"| {dtype} | {name} | {fmt_us(ts)} | {fmt_us(tp)} | {fmt_us(te)} | {r_sync / ts:.2f}x "
                f"| {r_pipe / tp:.2f}x | {r_eval / te:.2f}x | {bw:.0f} | {frac} |"
            )
    emit()


def bench_sampling(backend: str, reps: int, n_pipe: int, B=1, w=8, V=151936):
    emit(f"## Sampling accept (B={B}, w={w}, V={V}, float32)\n")
    emit(
        "| q | path | sync µs | pipelined µs | eval-only µs | vs ref (sync) | vs ref (pipelined) | vs ref (eval-only) |"
    )
    emit("|---|---|---|---|---|---|---|---|")
    k = w - 1
    p = mx.softmax(mx.random.normal((B, w, V)) * 3, axis=-1)
    q = mx.softmax(mx.random.normal((B, k, V)) * 3, axis=-1)
    d = mx.random.categorical(mx.log(q)).astype(mx.int32)
    u = mx.random.uniform(shape=(B, k))
    ub = mx.random.uniform(shape=(B,))
    mx.eval(p, q, d, u, ub)
    for qq, label in ((q, "q"), (None, "one-hot")):
        paths = {
            "reference": lambda: sampling_accept_reference(p, qq, d, u, ub),
            "kernels.sampling_accept": lambda: kernels.sampling_accept(p, qq, d, u, ub),
        }
        ref = paths["reference"]()
        out = paths["kernels.sampling_accept"]()
        assert all(mx.array_equal(a, b).item() for a, b in zip(out, ref))
        res = {
            name: (time_sync(fn, reps), time_pipelined(fn, n_pipe), time_eval_only(fn, n_pipe))
            for name, fn in paths.items()
        }
        r_sync, r_pipe, r_eval = res["reference"]
        for name, (ts, tp, te) in res.items():
            emit(
                f"| {label} | {name} | {fmt_us(ts)} | {fmt_us(tp)} | {fmt_us(te)} | {r_sync / ts:.2f}x "
                f"| {r_pipe / tp:.2f}x | {r_eval / te:.2f}x |"
            )
    emit()


# --------------------------------------------------------------------------- wide GEMM
class Block(nn.Module):
    """One Qwen3-style decoder layer (GQA attention with q/k norms and RoPE, SwiGLU MLP)."""

    def __init__(self, H, I, nh, nkv, hd):
        super().__init__()
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(H, nh * hd, bias=False)
        self.k_proj = nn.Linear(H, nkv * hd, bias=False)
        self.v_proj = nn.Linear(H, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)
        self.n1, self.n2 = nn.RMSNorm(H), nn.RMSNorm(H)
        self.qn, self.kn = nn.RMSNorm(hd), nn.RMSNorm(hd)

    def __call__(self, x):
        B, T, _ = x.shape
        h = self.n1(x)
        q = self.qn(self.q_proj(h).reshape(B, T, self.nh, self.hd)).transpose(0, 2, 1, 3)
        k = self.kn(self.k_proj(h).reshape(B, T, self.nkv, self.hd)).transpose(0, 2, 1, 3)
        v = self.v_proj(h).reshape(B, T, self.nkv, self.hd).transpose(0, 2, 1, 3)
        q = mx.fast.rope(q, self.hd, traditional=False, base=1e6, scale=1.0, offset=0)
        k = mx.fast.rope(k, self.hd, traditional=False, base=1e6, scale=1.0, offset=0)
        a = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.hd**-0.5, mask="causal")
        x = x + self.o_proj(a.transpose(0, 2, 1, 3).reshape(B, T, -1))
        h = self.n2(x)
        return x + self.down_proj(nn.silu(self.gate_proj(h)) * self.up_proj(h))


class Stack(nn.Module):
    def __init__(self, layers, dtype, **shape):
        super().__init__()
        self.layers = []
        for i in range(layers):
            blk = Block(**shape)
            blk.set_dtype(dtype)
            nn.quantize(blk, group_size=64, bits=4)
            mx.eval(blk.parameters())
            self.layers.append(blk)

    def __call__(self, x):
        for blk in self.layers:
            x = blk(x)
        return x


def bench_wide_gemm(backend: str, reps: int, layers: int, T: int, dtype, shape: dict, label: str):
    emit(f"## Wide-GEMM prefill: {label}, {layers} layers, 4-bit (group 64), {T} tokens, {dtype}\n")
    mx.random.seed(0)
    model = Stack(layers, dtype, **shape)
    x = (mx.random.normal((1, T, shape["H"])) * 0.5).astype(dtype)
    mx.eval(x)
    target = type("T", (), {"model": model})()
    pol = wide_gemm.policy()
    cfg = {"enabled": True, "min_rows": min(T, pol["min_rows"]), "compute": pol["compute"], "why": "bench"}

    def stock():
        return model(x)

    def dense():
        with kernels.prefill_context(target, T, cfg=cfg):
            return model(x)

    a, b = stock().astype(mx.float32), dense().astype(mx.float32)
    rel = (mx.abs(a - b).max() / mx.abs(a).max()).item()
    frac = mx.mean((a != b).astype(mx.float32)).item()
    ts, td = time_sync(stock, reps), time_sync(dense, reps)
    nparams = sum(v.size for _, v in nn.utils.tree_flatten(model.parameters()) if v.dtype == mx.uint32) * 8
    flops = 2 * nparams * T
    emit("| path | ms / prefill | GFLOP/s (linear layers) | vs stock |")
    emit("|---|---|---|---|")
    emit(f"| stock quantized matmul | {ts * 1e3:.2f} | {flops / ts / 1e9:.0f} | 1.00x |")
    emit(
        f"| dequantize-once + dense GEMM ({cfg['compute']}) | {td * 1e3:.2f} | {flops / td / 1e9:.0f} | {ts / td:.2f}x |"  # noqa: E501
    )
    emit(
        f"\nOutput difference (dense vs stock, after {layers} layers): max |diff| / max |out| = {rel:.2e}; "
        f"{100 * frac:.1f}% of elements differ. Policy here: {pol}\n"
    )


def bench_projections(reps: int, dtype, shape: dict, rows_list, label: str):
    """The seven projections of one layer: stock vs dense time per row count, and bit-identity."""
    emit(f"## Wide GEMM per layer ({label} projections, 4-bit group 64, {dtype}): where it pays\n")
    emit("| rows | stock ms | dense ms | dense vs stock | outputs bit-identical | max rel diff |")
    emit("|---|---|---|---|---|---|")
    H, I, nq, nkv = shape["H"], shape["I"], shape["nh"] * shape["hd"], shape["nkv"] * shape["hd"]
    dims = [(H, nq), (H, nkv), (H, nkv), (nq, H), (H, I), (H, I), (I, H)]
    layers = []
    for k, n in dims:
        lin = nn.Linear(k, n, bias=False)
        lin.set_dtype(dtype)
        layers.append(nn.QuantizedLinear.from_linear(lin, group_size=64, bits=4))
    mx.eval([ql.parameters() for ql in layers])
    pol = wide_gemm.policy()
    for rows in rows_list:
        xs = {k: (mx.random.normal((1, rows, k)) * 0.5).astype(dtype) for k in {k for k, _ in dims}}
        mx.eval(list(xs.values()))

        def stock():
            return [ql(xs[k]) for ql, (k, _) in zip(layers, dims)]

        def dense():
            return [wide_gemm.dense_quantized_linear(ql, xs[k], pol["compute"]) for ql, (k, _) in zip(layers, dims)]

        a, b = stock(), dense()
        same = all(mx.array_equal(x, y).item() for x, y in zip(a, b))
        rel = max(
            (mx.abs(x.astype(mx.float32) - y.astype(mx.float32)).max() / mx.abs(x.astype(mx.float32)).max()).item()
            for x, y in zip(a, b)
        )
        ts, td = time_sync(stock, reps), time_sync(dense, reps)
        emit(f"| {rows} | {ts * 1e3:.3f} | {td * 1e3:.3f} | {ts / td:.2f}x | {same} | {rel:.1e} |")
    emit()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the markdown report here")
    ap.add_argument("--reps", type=int, default=0, help="timed calls per measurement (default per backend)")
    ap.add_argument("--layers", type=int, default=0, help="wide-GEMM layers (default: 36 on GPU, 4 on CPU)")
    ap.add_argument("--skip-gemm", action="store_true")
    args = ap.parse_args(argv)
    backend = "cpu" if mx.default_device() == mx.cpu else ("cuda" if mx.cuda.is_available() else "metal")
    reps = args.reps or (50 if backend != "cpu" else 20)
    n_pipe = 100 if backend != "cpu" else 10
    emit(f"# Kernel microbenchmarks ({backend})\n")
    emit(
        f"MLX {mx.__version__}, device {mx.default_device()}, {platform.machine()}, "
        f"python {platform.python_version()}; native: {kernels.native_status()['kernels']}; "
        f"command: `python bench/bench_kernels.py {' '.join(argv or sys.argv[1:])}`\n"
    )
    bench_greedy(backend, reps, n_pipe)
    bench_sampling(backend, reps, n_pipe)
    if not args.skip_gemm:
        if backend == "cpu":
            bench_projections(3, mx.float32, dict(H=576, I=1536, nh=9, nkv=3, hd=64), (16, 128, 512), "SmolLM2-135M")
            bench_wide_gemm(
                backend,
                3,
                args.layers or 4,
                128,
                mx.float32,
                dict(H=576, I=1536, nh=9, nkv=3, hd=64),
                "SmolLM2-135M-shaped",
            )
        else:
            q4b = dict(H=2560, I=9728, nh=32, nkv=8, hd=128)
            bench_projections(20, mx.bfloat16, q4b, (16, 64, 128, 256, 512, 2048), "Qwen3-4B")
            bench_wide_gemm(backend, 5, args.layers or 36, 2048, mx.bfloat16, q4b, "Qwen3-4B-shaped")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
