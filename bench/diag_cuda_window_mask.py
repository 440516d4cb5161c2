"""Which attention call crashed distill on MLX CUDA (SIGFPE), each case in its own process.

    python3 bench/diag_cuda_window_mask.py [--gguf gemma-3-270m-q4_k_m.gguf] [--out FILE.md]

Session 19 (bench/results/gemma-dspark.md): training a Gemma 3 270M drafter died with SIGFPE
within 30 steps whenever the training answers ran past the 512-token sliding window, and trained
through without them. Past the window, mlx-lm builds a boolean windowed mask array for the
sliding layers of a cacheless forward (`create_causal_mask(N, window_size=512)`), where shorter
sequences get the "causal" string. This runs the suspects one per subprocess (a SIGFPE kills only
its case) and prints a table: case, exit status (-8 = SIGFPE), seconds.

Cases: `mx.fast.scaled_dot_product_attention` on Gemma 3 270M's attention shape (16 rows, 4 query
heads, 1 KV head, head dim 256, bf16) with the windowed boolean mask at 512 (equal to the window:
no array in mlx-lm, here the control), 513, 600 and 1000 tokens; the same at 600 with mask
"causal", an additive float mask, head dim 64, one row, float32; the gradient of the 600 / 512
windowed and the causal call ("grad-"); and with --gguf, the real target's cacheless tapped
forward over 16 x 600 tokens, as distill's target_inputs runs it. On the CPU every case passes (a
smoke test of this script; 2 x 600 tokens in float32 for the target). On an H100 (session 20)
every case passes too: the crash needs more than one of these calls.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

CASES = {
    # name: (rows, tokens, head_dim, dtype, mask kind)
    "window-512": (16, 512, 256, "bfloat16", "window"),
    "window-513": (16, 513, 256, "bfloat16", "window"),
    "window-600": (16, 600, 256, "bfloat16", "window"),
    "window-1000": (16, 1000, 256, "bfloat16", "window"),
    "causal-600": (16, 600, 256, "bfloat16", "causal"),
    "additive-600": (16, 600, 256, "bfloat16", "additive"),
    "window-600-d64": (16, 600, 64, "bfloat16", "window"),
    "window-600-1row": (1, 600, 256, "bfloat16", "window"),
    "window-600-f32": (16, 600, 256, "float32", "window"),
    # the training step's backward through the same call (distill differentiates the drafter, whose
    # loss reaches the target's cacheless forward only as data; these cases test MLX's VJP alone)
    "grad-window-600": (16, 600, 256, "bfloat16", "window"),
    "grad-window-512": (16, 512, 256, "bfloat16", "window"),
    "grad-causal-600": (16, 600, 256, "bfloat16", "causal"),
}
WINDOW = 512


def run_case(name: str, gguf: str | None) -> None:
    import mlx.core as mx

    if name == "target-600":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
        from mlx_dspark.models.loading import load_target

        gpu = mx.default_device() == mx.gpu
        target, _ = load_target(gguf, dtype="bfloat16" if gpu else "float32")  # bf16 is slow on a CPU
        tok = mx.random.randint(0, target.vocab_size, (16 if gpu else 2, 600)).astype(mx.int32)
        out = target.forward(tok, None, taps=(1, 4, 8, 12, 15))
        mx.eval(out.logits, out.hidden)
        return
    rows, n, d, dtype, kind = CASES[name]
    dt = getattr(mx, dtype)
    q = mx.random.normal((rows, 4, n, d)).astype(dt)
    k = mx.random.normal((rows, 1, n, d)).astype(dt)
    v = mx.random.normal((rows, 1, n, d)).astype(dt)
    i = mx.arange(n)
    allowed = (i[:, None] >= i[None]) & (i[:, None] < i[None] + WINDOW)
    mask = {"window": allowed, "causal": "causal", "additive": mx.where(allowed, 0.0, -1e9).astype(dt)}[kind]
    if name.startswith("grad-"):

        def loss(q, k, v):
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=d**-0.5, mask=mask).astype(mx.float32).sum()

        mx.eval(mx.grad(loss, argnums=(0, 1, 2))(q, k, v))
        return
    mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=d**-0.5, mask=mask))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", help=argparse.SUPPRESS)  # the child process's one case
    ap.add_argument("--gguf", help="also the real Gemma 3 270M target's forward (target-600)")
    ap.add_argument("--out", help="append the table to this file")
    a = ap.parse_args(argv)
    if a.case:
        run_case(a.case, a.gguf)
        return 0
    import mlx.core as mx

    names = list(CASES) + (["target-600"] if a.gguf else [])
    lines = [
        f"## diag_cuda_window_mask: MLX {mx.__version__}, {mx.default_device()}",
        "",
        "| case | exit status | seconds |",
        "|---|---|---|",
    ]
    for name in names:
        t = time.perf_counter()
        cmd = [sys.executable, __file__, "--case", name] + (["--gguf", a.gguf] if a.gguf else [])
        r = subprocess.run(cmd, capture_output=True, text=True)
        status = "ok" if r.returncode == 0 else f"{r.returncode}" + (" (SIGFPE)" if r.returncode == -8 else "")
        lines.append(f"| {name} | {status} | {time.perf_counter() - t:.1f} |")
        if r.returncode not in (0, -8):
            lines.append(f"|  | {r.stderr.strip().splitlines()[-1][:100] if r.stderr.strip() else ''} | |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "a") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
