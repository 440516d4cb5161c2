"""Hybrid rollback: replaying the accepted prefix against re-running it through the GDN layers.

    PYTHONPATH=python python bench/bench_hybrid_replay.py            # the H200: CUDA, bf16, 24 layers
    python bench/bench_hybrid_replay.py --out bench/results/hybrid-replay-cpu.md   # CPU: float32, 2 layers

The GDN layers of a Qwen3.5-9B-like hybrid (mlx-lm qwen3_5 GatedDeltaNet, hidden 4096, 16 key
heads x 128, 32 value heads x 128, conv kernel 4; random weights; --layers of them, 24 by default
on a GPU, as a 32-layer 3:1 hybrid has), each with its own cache after a --prefix-token prompt.
A verify round of width w is recorded into every layer's ReplayArraysCache, then every layer's
state at accept point m is rebuilt two ways, all layers in one evaluation:
  * replay   ReplayArraysCache.rewind (models/hybrid.py), what the rollback runs: a conv-state
             slice plus the recurrence over the m recorded positions from the state before the
             round; on CUDA that is the native kernel (kernels/gdn_replay.py, one launch a layer),
             on the CPU mlx-lm's gated_delta_update;
  * re-run   restore each cache from before the round and feed the m accepted positions through
             the layer again (input projections, conv, recurrence; only the state is evaluated,
             so the output projection is skipped).
On CUDA a third column times the replay as it was before the kernel (mlx-lm's ops recurrence
over the m positions). Times are wall clock from the first rebuild call to the end of the
evaluation, median of --reps after warm-ups. The summary line reads the smallest re-run / replay
ratio against the >= 5x bar (the bar is for the H200 at these shapes). Random weights, no
network; mlx and mlx-lm only.
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

HIDDEN = 4096


def make_layer(dtype):
    from mlx_lm.models.qwen3_5 import GatedDeltaNet, TextModelArgs

    from mlx_dspark.models import hybrid

    args = TextModelArgs(
        model_type="qwen3_5_text",
        hidden_size=HIDDEN,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
    )
    m = GatedDeltaNet(args)
    m.set_dtype(dtype)
    m.eval()

    class Layer:
        is_linear = True
        linear_attn = m

    assert hybrid.install_recording([Layer()]) is None
    mx.eval(m.parameters())
    return m


def median_time(fn, reps: int, warm: int = 2) -> float:
    for _ in range(warm):
        fn()
    return statistics.median(fn() for _ in range(reps))


def main(argv=None) -> int:
    gpu = mx.default_device() == mx.gpu
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16" if gpu else "float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--layers", type=int, default=24 if gpu else 2, help="GDN layers rolled back per round")
    ap.add_argument("--width", type=int, default=8, help="verify width w (anchor + drafts)")
    ap.add_argument("--prefix", type=int, default=64, help="tokens in the cache before the round")
    ap.add_argument("--reps", type=int, default=15 if gpu else 3)
    ap.add_argument("--bar", type=float, default=5.0)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    from mlx_lm.models.gated_delta import gated_delta_update

    from mlx_dspark.models import hybrid
    from mlx_dspark.models.hybrid import ReplayArraysCache

    t_start = time.perf_counter()
    dtype = getattr(mx, a.dtype)
    m = make_layer(dtype)
    mx.random.seed(0)
    x_prefix = [mx.random.normal((1, a.prefix, HIDDEN)).astype(dtype) for _ in range(a.layers)]
    x_round = [mx.random.normal((1, a.width, HIDDEN)).astype(dtype) for _ in range(a.layers)]
    before = []
    for i in range(a.layers):
        c = ReplayArraysCache(2)
        mx.eval(m(x_prefix[i], None, c))
        c.round = None
        before.append((c[0], c[1]))
    path = hybrid.kernel_lang(m, mx.zeros((1, 1, 16, 128)), mx.zeros((1, 1, 32, 128))) or "mlx-lm gated_delta_update"

    def recorded() -> list:
        caches = []
        for i in range(a.layers):
            c = ReplayArraysCache(2)
            c[0], c[1] = before[i]
            caches.append((c, m(x_round[i], None, c)))
        mx.eval([(c[0], c[1], y) for c, y in caches])
        return [c for c, _ in caches]

    rows = []
    for keep in sorted({1, a.width // 2, a.width - 1}):
        out = {}

        def replay():
            cs = recorded()
            t = time.perf_counter()
            for c in cs:
                c.rewind(a.width - keep)
            mx.eval([(c[0], c[1]) for c in cs])
            out["replay"] = cs[0][1]
            return time.perf_counter() - t

        def rerun():
            cs = recorded()
            t = time.perf_counter()
            for i, c in enumerate(cs):
                c[0], c[1] = before[i]
                m(x_round[i][:, :keep], None, c)
            mx.eval([(c[0], c[1]) for c in cs])
            out["rerun"] = cs[0][1]
            return time.perf_counter() - t

        def mlx_lm_replay():  # the replay before the kernel: mlx-lm's ops recurrence over m positions
            cs = recorded()
            t = time.perf_counter()
            for c in cs:
                r = c.round
                c[0] = mx.contiguous(r.conv_input[:, keep : keep + 3, :])
                c[1] = hybrid.replay_state(
                    gated_delta_update, m, r.q[:, :keep], r.k[:, :keep], r.v[:, :keep], r.a[:, :keep],
                    r.b[:, :keep], r.state_before,
                )  # fmt: skip
            mx.eval([(c[0], c[1]) for c in cs])
            return time.perf_counter() - t

        t_replay = median_time(replay, a.reps)
        t_rerun = median_time(rerun, a.reps)
        t_old = median_time(mlx_lm_replay, a.reps) if gpu else None
        diff = float(mx.abs(out["replay"] - out["rerun"]).max().item())
        rows.append((keep, t_replay, t_rerun, t_old, diff))
    elapsed = time.perf_counter() - t_start
    worst = min(tu / tr for _, tr, tu, _, _ in rows)
    dev = str(mx.default_device())
    lines = [
        f"# Hybrid rollback: replay vs re-run ({a.layers} GDN layers, Qwen3.5-9B-like shapes)",
        "",
        f"Command: `python bench/bench_hybrid_replay.py --dtype {a.dtype} --layers {a.layers} --width {a.width}"
        f" --prefix {a.prefix} --reps {a.reps}`  ",
        f"Machine: {platform.machine()} {platform.system()}, MLX {mx.__version__}, device {dev}, {a.dtype}; "
        f"replay runs: {path}",
        "",
        "| accepted m of w | replay (ms) | re-run (ms) | re-run / replay | mlx-lm replay (ms) | max abs state diff |",
        "|---|---|---|---|---|---|",
    ]
    for keep, tr, tu, to, diff in rows:
        old = f"{to * 1e3:.3f}" if to else "-"
        lines.append(f"| {keep} of {a.width} | {tr * 1e3:.3f} | {tu * 1e3:.3f} | {tu / tr:.2f}x | {old} | {diff:.2e} |")
    verdict = "meets" if worst >= a.bar else "MISSES"
    lines += [
        "",
        f"Summary: replay is {worst:.2f}x faster than re-running the accepted tokens at worst "
        f"(m = {min(rows, key=lambda r: r[2] / r[1])[0]} of {a.width}); {verdict} the >= {a.bar:g}x bar. "
        f"({elapsed:.0f} s)",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
