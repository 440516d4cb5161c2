"""Is a forward deterministic on this device? The same computation on equal inputs must give the
same bits twice: the width-invariance self-check, the rollback proof and the GPU property tests
all compare two runs bitwise, so a nondeterministic op reads there as "not invariant".

  python bench/diag_determinism.py [--reps 4] [--out FILE.md]

Per precision of the tests' llama fixture (hidden 128, 3 layers, vocab 512: tests/fixtures.py),
each run compared bitwise with the first:
  prefill   the target's prefill (MLX's own kernels) of one prefix on a fresh cache: logits, KV
  qmm/mm    the first layer's q_proj alone on a fixed [M, K] input, MLX's own op
  step      one width-1 decode step on the kernel path after that prefill (--steps)
for the hybrid qwen3_5 and qwen3_next fixtures in float32: how far the recording forward (the
native GDN kernel on a GPU) is from mlx-lm's and from the CPU's, and the layer's parts alone
(hybrid_rows); and MLX's quantized_matmul (bits 4/8, groups 64/128, K from one group to 4096)
and gather_qmm alone (--only).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import _package  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

PRECISIONS = [("bfloat16", None, None)] + [("bfloat16", b, g) for b in (4, 8) for g in (64, 128)]
PREFIXES = (23, 32, 100, 299)


def _same(a, b) -> bool:
    import mlx.core as mx

    return all(x.shape == y.shape and mx.array_equal(x, y).item() for x, y in zip(a, b))


def _load(path, dtype, bits, group):
    import mlx.nn as nn

    import mlx_dspark as md

    target, _ = md.load_target(path, dtype=dtype, probe=False)
    if bits:
        nn.quantize(target.model, group_size=group, bits=bits)
    return target


def llama_rows(path, reps: int, steps: bool) -> Iterator[tuple]:
    import mlx.core as mx

    from mlx_dspark.models import invariance

    for dtype, bits, group in PRECISIONS:
        name = dtype + (f" q{bits}g{group}" if bits else "")
        target = _load(path, dtype, bits, group)
        for n in PREFIXES:
            prefix = mx.array([[(31 * i + 7) % target.vocab_size for i in range(n)]], dtype=mx.int32)

            def prefill():
                cache = target.make_cache()
                logits = target.forward(prefix, cache, last_only=True).logits
                kv = [c.state[0][..., : c.offset, :] for c in cache]
                mx.eval(logits, kv)
                return cache, [logits] + kv

            first = prefill()[1]
            ok = sum(_same(first, prefill()[1]) for _ in range(reps - 1))
            yield (name, f"prefill {n}", ok, reps - 1)
            q = target.model.model.layers[0].self_attn.q_proj
            x = mx.random.normal((n, q.weight.shape[-1] * (32 // bits if bits else 1)), key=mx.random.key(n))
            x = x.astype(mx.bfloat16)
            y0 = q(x)
            mx.eval(y0)
            ok = sum(mx.array_equal(y0, q(x)).item() for _ in range(reps - 1))
            yield (name, f"{'qmm' if bits else 'mm'} M={n}", ok, reps - 1)
        if steps:
            invariance._enable_kernels(target)
            prefix = mx.array([[(31 * i + 7) % target.vocab_size for i in range(23)]], dtype=mx.int32)
            outs = []
            for _ in range(reps):
                cache = target.make_cache()
                target.forward(prefix, cache, last_only=True)
                outs.append(target.forward(mx.array([[5]]), cache).logits)
                mx.eval(outs[-1])
            ok = sum(mx.array_equal(outs[0], o).item() for o in outs[1:])
            yield (name, "kernel step after prefill 23", ok, reps - 1)
            invariance._disable(target)


def _diff(a, b) -> str:
    import mlx.core as mx

    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return f"{float(mx.abs(a - b).max().item()):.3g}"


def hybrid_rows(tmp: Path, reps: int) -> Iterator[tuple]:
    """Per hybrid fixture in float32: mlx-lm's forward against itself, and the recording forward
    (the native GDN kernel on a GPU) against it and against the CPU's forward of the same weights
    (prove_replay's first check); then the GDN layer's two parts alone on random inputs (the
    causal conv and the recurrence), each path against the CPU; and MLX's float32 matmul here
    against the CPU's (is it float32, or TF32?)."""
    import mlx.core as mx
    from family_fixtures import write_family
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.models.gated_delta import compute_g, gated_delta_update

    import mlx_dspark as md
    from mlx_dspark.kernels import gdn_replay
    from mlx_dspark.models import hybrid

    dev = mx.default_device()
    a = mx.random.normal((64, 256), key=mx.random.key(1))
    b = mx.random.normal((256, 256), key=mx.random.key(2))
    here, cpu = a @ b, mx.matmul(a, b, stream=mx.cpu)
    rel = float((mx.abs(here - cpu).max() / mx.abs(cpu).max()).item())
    yield ("float32", f"matmul 64x256x256 here vs CPU: max rel diff {rel:.2g}", None, None)
    for fam in ("qwen3_5", "qwen3_next"):
        path = write_family(tmp / fam, fam, seed=3, gdn_key_dim=32)
        target, _ = md.load_target(str(path), dtype="float32")
        model = target.model
        ids = mx.array([[(29 * i + 7) % target.vocab_size for i in range(12)]], dtype=mx.int32)
        ref = model(ids, cache=make_prompt_cache(model))
        mx.eval(ref)
        ok = sum(mx.array_equal(ref, model(ids, cache=make_prompt_cache(model))).item() for _ in range(reps - 1))
        yield (f"{fam} float32", "mlx-lm forward 12", ok, reps - 1)
        rec = target.make_cache()
        ours = model(ids, cache=rec)
        kernels = sorted({str(getattr(getattr(c, "round", None), "kernel", None)) for c in rec} - {"None"})
        mx.set_default_device(mx.cpu)
        on_cpu = model(ids, cache=make_prompt_cache(model))
        mx.eval(on_cpu)
        mx.set_default_device(dev)
        tol = 1e-4 * (1.0 + float(mx.abs(ref).max().item()))
        yield (
            f"{fam} float32",
            f"logits, max abs diff: recording forward (GDN kernel {kernels or 'none'}) vs mlx-lm {_diff(ours, ref)}, "
            f"vs the CPU {_diff(ours, on_cpu)}; mlx-lm vs the CPU {_diff(ref, on_cpu)}; "
            f"prove_replay's tolerance {tol:.3g}; rollback {target.rollback_kind}",
            None,
            None,
        )
        yield (
            f"{fam} float32",
            f"kernel parts: {hybrid.kernel_parts_differ(rec) or 'each as float32 on the CPU'}",
            None,
            None,
        )
        m = next(x for x in hybrid.gdn_modules(target.layers) if x is not None)
        x = mx.random.normal((1, 15, m.conv_dim), key=mx.random.key(3))
        conv, dw = m.conv1d(x), hybrid.depthwise_conv(m.conv1d, x)
        mx.set_default_device(mx.cpu)
        conv_cpu = m.conv1d(x)
        mx.eval(conv_cpu)
        mx.set_default_device(dev)
        yield (
            f"{fam} float32",
            f"conv, max abs diff: conv1d vs CPU {_diff(conv, conv_cpu)}, depthwise vs CPU {_diff(dw, conv_cpu)}",
            None,
            None,
        )
        k = mx.random.split(mx.random.key(4), 5)
        T, Hk, Hv, Dk, Dv = 7, m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
        q = mx.random.normal((1, T, Hk, Dk), key=k[0]) * Dk**-0.5
        kk = mx.random.normal((1, T, Hk, Dk), key=k[1])
        kk = kk / mx.linalg.norm(kk, axis=-1, keepdims=True)
        v = mx.random.normal((1, T, Hv, Dv), key=k[2])
        aa, bb = mx.random.normal((1, T, Hv), key=k[3]), mx.random.normal((1, T, Hv), key=k[4])
        y_ml, _ = gated_delta_update(q, kk, v, aa, bb, m.A_log, m.dt_bias, None, None)
        g, beta = compute_g(m.A_log, aa, m.dt_bias), mx.sigmoid(bb)
        state = mx.zeros((1, Hv, Dv, Dk), dtype=mx.float32)
        mx.set_default_device(mx.cpu)
        y_cpu, _ = gated_delta_update(q, kk, v, aa, bb, m.A_log, m.dt_bias, None, None)
        mx.eval(y_cpu)
        mx.set_default_device(dev)
        line = f"recurrence T=7, max abs diff: mlx-lm here vs CPU {_diff(y_ml, y_cpu)}"
        if gdn_replay.replay_path() == "cuda":
            y_k, _ = gdn_replay.gdn_recurrence_gpu(q, kk, v, g, beta, state, lang="cuda")
            line += f", the native kernel vs CPU {_diff(y_k, y_cpu)}"
        yield (f"{fam} float32", line, None, None)


def qmm_rows(reps: int) -> Iterator[tuple]:
    """MLX's own quantized_matmul over shapes of real models: same bits every run, and its largest
    error against the dequantized float32 product (relative to that product's largest value)."""
    import mlx.core as mx

    for bits in (4, 8):
        for group in (64, 128):
            for K in sorted({group, 2 * group, 1024, 4096}):
                w = mx.random.normal((512, K), key=mx.random.key(K)).astype(mx.bfloat16)
                wq, s, b = mx.quantize(w, group_size=group, bits=bits)
                wd = mx.dequantize(wq, s, b, group_size=group, bits=bits).astype(mx.float32)
                for M in (1, 23):
                    x = mx.random.normal((M, K), key=mx.random.key(M)).astype(mx.bfloat16)

                    def qmm():
                        y = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=group, bits=bits)
                        mx.eval(y)
                        return y

                    y0 = qmm()
                    ok = sum(mx.array_equal(y0, qmm()).item() for _ in range(reps - 1))
                    ref = x.astype(mx.float32) @ wd.T
                    err = float((mx.abs(y0.astype(mx.float32) - ref).max() / mx.abs(ref).max()).item())
                    yield (f"q{bits}g{group}", f"quantized_matmul K={K} M={M}: rel err {err:.2g}", ok, reps - 1)


def gather_rows(reps: int) -> Iterator[tuple]:
    """MLX's gather_qmm as mlx-lm's MoE layers call it (sorted rows), bf16 4-bit group 64."""
    import mlx.core as mx

    for K in (64, 128, 1024):
        E, N, T, k = 8, 256, 40, 2
        w = mx.random.normal((E, N, K), key=mx.random.key(1)).astype(mx.bfloat16)
        wq, s, b = mx.quantize(w, group_size=64, bits=4)
        x = mx.random.normal((T * k, 1, K), key=mx.random.key(2)).astype(mx.bfloat16)
        idx = mx.sort(mx.random.randint(0, E, (T * k,), key=mx.random.key(3)).astype(mx.uint32))

        def run():
            y = mx.gather_qmm(x, wq, s, b, rhs_indices=idx, transpose=True, group_size=64, bits=4, sorted_indices=True)
            mx.eval(y)
            return y

        y0 = run()
        ok = sum(mx.array_equal(y0, run()).item() for _ in range(reps - 1))
        yield ("q4g64 experts", f"gather_qmm sorted, K={K}, {T * k} rows", ok, reps - 1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--steps", action="store_true", help="also the kernel path's step (JIT-compiles per precision)")
    ap.add_argument("--only", default="llama,hybrid,qmm,gather", help="which checks, comma-separated")
    ap.add_argument("--out")
    args = ap.parse_args()

    import mlx.core as mx
    from fixtures import write_model

    mx.set_default_device(mx.gpu if (mx.cuda.is_available() or mx.metal.is_available()) else mx.cpu)
    t0 = time.time()
    out = open(args.out, "a") if args.out else None

    def emit(line: str) -> None:  # row by row: a run cut by a time limit keeps what it measured
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    emit(f"## Determinism on {mx.default_device()} (MLX {mx.__version__}), {args.reps} runs each\n")
    emit("| target | computation | runs equal to the first |\n|---|---|---|")
    only = set(args.only.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        checks = []
        if "llama" in only:
            path = write_model(
                tmp / "llama",
                "llama",
                layers=3,
                hidden=128,
                heads=4,
                kv_heads=2,
                intermediate=256,
                scale=2.0,
                seed=21,
                vocab_size=512,
            )
            checks.append(llama_rows(str(path), args.reps, args.steps))
        checks += [hybrid_rows(tmp, args.reps)] if "hybrid" in only else []
        checks += [qmm_rows(args.reps)] if "qmm" in only else []
        checks += [gather_rows(args.reps)] if "gather" in only else []
        for rows in checks:
            for name, what, ok, of in rows:
                emit(f"| {name} | {what} | {'' if ok is None else f'{ok} of {of}'} |")
    emit(f"\n{time.time() - t0:.0f} s\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
