"""Hybrid rollback: replaying the accepted prefix against re-running it through the GDN layer.

    python bench/bench_hybrid_replay.py                       # default device (CPU here)
    python bench/bench_hybrid_replay.py --out bench/results/hybrid-replay-cpu.md
    (on the H200, MLX's CUDA backend: the same command, --dtype bfloat16, --out .../hybrid-replay-cuda.md)

One Gated DeltaNet layer of mlx-lm's qwen3_5 at Qwen3.5-9B-like shapes (hidden 4096, 16 key
heads x 128, 32 value heads x 128, conv kernel 4; random weights), a verify round of width w
recorded into a ReplayArraysCache, then the state at accept point m rebuilt two ways:
  * replay   ReplayArraysCache.rewind (models/hybrid.py): a conv-state slice plus mlx-lm's
             gated_delta_update over the m recorded positions from the state before the round;
  * re-run   restore the cache from before the round and feed the m accepted positions through
             the layer again (input projections, conv, recurrence; the state only is evaluated).
Timings are per layer, `sync` (one rebuild then mx.eval), median of --reps after a warm-up; the
ratio is re-run / replay. On a GPU a third column times kernels/gdn_replay.py's native kernel
(same recorded inputs; not yet what the rollback runs, see that module). The >= 5x bar of the
hybrid-rollback issue is for the H200 at these shapes.
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


def layer(dtype):
    from mlx_lm.models.qwen3_5 import GatedDeltaNet, TextModelArgs

    from mlx_dspark.models import hybrid

    args = TextModelArgs(
        model_type="qwen3_5_text",
        hidden_size=4096,
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--width", type=int, default=8, help="verify width w (anchor + drafts)")
    ap.add_argument("--prefix", type=int, default=256, help="tokens in the cache before the round")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    from mlx_dspark.kernels import gdn_replay
    from mlx_dspark.models.hybrid import ReplayArraysCache

    native = gdn_replay.replay_path() != "reference"

    dtype = getattr(mx, a.dtype)
    m = layer(dtype)
    H = 4096
    x_prefix = mx.random.normal((1, a.prefix, H)).astype(dtype)
    x_round = mx.random.normal((1, a.width, H)).astype(dtype)
    base = ReplayArraysCache(2)
    mx.eval(m(x_prefix, None, base))
    before = (base[0], base[1])
    rows = []
    for keep in sorted({1, a.width // 2, a.width - 1}):

        def replay():
            c = ReplayArraysCache(2)
            c[0], c[1] = before
            mx.eval(m(x_round, None, c))
            t = time.perf_counter()
            c.rewind(a.width - keep)
            mx.eval(c[0], c[1])
            return time.perf_counter() - t

        def rerun():
            c = ReplayArraysCache(2)
            c[0], c[1] = before
            mx.eval(m(x_round, None, c))
            t = time.perf_counter()
            c[0], c[1] = before
            m(x_round[:, :keep], None, c)
            mx.eval(c[0], c[1])  # the state only: MLX skips the output projection
            return time.perf_counter() - t

        def kernel():
            from mlx_lm.models.gated_delta import compute_g

            c = ReplayArraysCache(2)
            c[0], c[1] = before
            mx.eval(m(x_round, None, c))
            r = c.round
            t = time.perf_counter()
            g = compute_g(m.A_log, r.a[:, :keep], m.dt_bias)
            s = gdn_replay.gdn_replay(r.k[:, :keep], r.v[:, :keep], g, mx.sigmoid(r.b[:, :keep]), r.state_before)
            mx.eval(mx.contiguous(r.conv_input[:, keep : keep + 3, :]), s)
            return time.perf_counter() - t

        t_replay = statistics.median([replay() for _ in range(a.reps + 1)][1:])
        t_rerun = statistics.median([rerun() for _ in range(a.reps + 1)][1:])
        t_kernel = statistics.median([kernel() for _ in range(a.reps + 1)][1:]) if native else None
        rows.append((keep, t_replay, t_rerun, t_kernel))
    dev = str(mx.default_device())
    lines = [
        "# Hybrid rollback: replay vs re-run (one GDN layer, Qwen3.5-9B-like shapes)",
        "",
        f"Command: `python bench/bench_hybrid_replay.py --dtype {a.dtype} --width {a.width} --prefix {a.prefix}`  ",
        f"Machine: {platform.machine()} {platform.system()}, MLX {mx.__version__}, device {dev}, {a.dtype}",
        "",
        "| accepted m of w | replay (ms) | re-run (ms) | re-run / replay | kernel (ms) | re-run / kernel |",
        "|---|---|---|---|---|---|",
    ]
    for keep, tr, tu, tk in rows:
        k = f"{tk * 1e3:.3f} | {tu / tk:.2f}x" if tk else "- | - (no GPU kernel here)"
        lines.append(f"| {keep} of {a.width} | {tr * 1e3:.3f} | {tu * 1e3:.3f} | {tu / tr:.2f}x | {k} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
