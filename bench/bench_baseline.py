"""Baseline against mlx-lm, and lookup against baseline, on one model (ratios from one run).

  python bench/bench_baseline.py [--model M] [--dtype float32] [--max-new-tokens 128] [--out FILE.md]

On Linux CPU run it with OpenBLAS preloaded (the CLI does this by itself; a script does not):
  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python bench/bench_baseline.py

Goals: baseline >= 0.98x mlx-lm; lookup well above baseline on the copy prompt and never more
than a few percent below it on the others. Token identity with baseline is reported per prompt.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import _package  # noqa: E402,F401  (the installed mlx_dspark, else python/)

from mlx_dspark import benchmark as bm  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="default: the demo model (SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out", help="append a markdown record here")
    args = ap.parse_args()
    model, target, tok = bm.load_bench_target(args.model, args.dtype)
    lines = [
        f"## {Path(model).name} ({args.dtype or 'default dtype'}), {bm.device_stamp()}",
        f"`{' '.join(sys.argv)}` at {time.strftime('%Y-%m-%d %H:%M')}, {args.max_new_tokens} new tokens, "
        f"best of {args.trials}",
        "",
    ]
    for name, prompt in [("chat", bm.CHAT_PROMPT), ("code", bm.CODE_PROMPT), ("copy", bm.COPY_PROMPT)]:
        res = bm.compare(
            target, tok, prompt, args.max_new_tokens, ["mlx_lm", "baseline", "lookup"], repeats=args.trials
        )
        lines.append(f"### {name} prompt")
        lines += ["    " + ln for ln in bm.report(res, "baseline")]
        ratio = res["baseline"].decode_tps / res["mlx_lm"].decode_tps
        lines.append(
            f"    baseline / mlx_lm = {ratio:.3f} (goal >= 0.98); "
            f"lookup / baseline = {res['lookup'].decode_tps / res['baseline'].decode_tps:.3f}"
        )
        lines.append("")
    text = "\n".join(lines)
    bm.emit(text, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
