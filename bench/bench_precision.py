"""Precision on CPU: decode speed and the verify cost curve of SmolLM2-135M (the demo GGUF).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python bench/bench_precision.py --out bench/results/precision-cpu

For float32, bfloat16, MLX 8-bit and MLX 4-bit (all loaded through load_target, the product's
GGUF path, and run through Target.forward):
  * decode: a ~200-token prompt is prefilled, then N greedy width-1 steps (forward + argmax,
    synced per token, as the verify loop runs them) -> tok/s;
  * verify curve: with the cache warm at ~200 tokens, the time of one width-w forward
    (w = 1..16, 32; logits for all w rows), trimmed back after each call. Median and min of
    `--reps` calls after a warm-up; ratio = t(w) / t(1).
Speculation pays where t(w) grows slowly with w (DESIGN.md, "Numbers to know").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import _package  # noqa: E402,F401  (the installed mlx_dspark, else python/)
import mlx.core as mx

from mlx_dspark.blas import loaded_blas  # noqa: E402
from mlx_dspark.models.demo import demo_model_path  # noqa: E402
from mlx_dspark.models.loading import load_target  # noqa: E402

PRECISIONS = {
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    "mlx-8bit": dict(dtype="float32", quantize=8),
    "mlx-4bit": dict(dtype="float32", quantize=4),
}
WIDTHS = list(range(1, 17)) + [32]
PROMPT = (
    "Speculative decoding drafts several tokens and the target verifies them in one forward pass. "
    "Whether it pays depends on how the cost of a forward grows with its width. "
) * 12


def prefill(target, ids: list[int]):
    cache = target.make_cache()
    out = target.forward(mx.array([ids]), cache, last_only=True)
    mx.eval(out.logits)
    return cache, out.logits


def decode_tps(target, ids: list[int], n: int) -> dict:
    cache, logits = prefill(target, ids)
    tok = int(mx.argmax(logits[0, -1]).item())
    steps = []
    for _ in range(n):
        t = time.perf_counter()
        logits = target.forward(mx.array([[tok]]), cache).logits
        tok = int(mx.argmax(logits[0, -1]).item())
        steps.append(time.perf_counter() - t)
    return {
        "tokens": n,
        "tok_s": n / sum(steps),
        "median_step_ms": 1e3 * statistics.median(steps),
        "min_step_ms": 1e3 * min(steps),
    }


def verify_curve(target, ids: list[int], reps: int) -> dict:
    cache, _ = prefill(target, ids)
    base = target.cache_len(cache)
    vocab = target.vocab_size
    out = {}
    for w in WIDTHS:
        block = mx.array([[(7919 * (i + 1) + 13 * w) % vocab for i in range(w)]])
        times = []
        for r in range(reps + 1):
            t = time.perf_counter()
            mx.eval(target.forward(block, cache).logits)
            dt = time.perf_counter() - t
            target.trim(cache, w)
            if r:  # the first call of each width warms up (kernel compilation)
                times.append(dt)
        assert target.cache_len(cache) == base
        out[w] = {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times)}
    return out


def machine() -> dict:
    from mlx_dspark.benchmark import cpu_name

    cpu = cpu_name()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "blas": loaded_blas() or "MLX's bundled reference BLAS",
        "loadavg_start": os.getloadavg(),
    }


def report(res: dict) -> str:
    L = ["# Precision on CPU: SmolLM2-135M-Instruct (demo GGUF, Q4_1 source)", "", f"Command: `{res['command']}`", ""]
    m = res["machine"]
    L += [
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['platform']}; Python {m['python']}, MLX {m['mlx']} "
        f"({m['device']}); BLAS: {m['blas']}.",
        f"Load average at start {tuple(round(x, 2) for x in m['loadavg_start'])}, at end "
        f"{tuple(round(x, 2) for x in res['loadavg_end'])} (the machine is shared: medians are what a user sees, "
        "minimums the least disturbed).",
        "",
        f"Prompt {res['prompt_tokens']} tokens; decode {res['decode_tokens']} greedy steps; "
        f"verify reps {res['reps']} per width after one warm-up.",
        "",
        "## Decode (width 1)",
        "",
        "| precision | tok/s | median step ms | min step ms |",
        "|---|---:|---:|---:|",
    ]
    for p, r in res["results"].items():
        d = r["decode"]
        L.append(f"| {p} | {d['tok_s']:.2f} | {d['median_step_ms']:.1f} | {d['min_step_ms']:.1f} |")
    L += [
        "",
        "## Verify cost curve (cache warm at the prompt length)",
        "",
        "Median ms of one width-w forward (ratio to width 1 in parentheses).",
        "",
        "| w | " + " | ".join(res["results"]) + " |",
        "|---:|" + "---:|" * len(res["results"]),
    ]
    for w in WIDTHS:
        cells = []
        for r in res["results"].values():
            c, one = r["verify"][w], r["verify"][1]["median_ms"]
            cells.append(f"{c['median_ms']:.1f} ({c['median_ms'] / one:.2f}x)")
        L.append(f"| {w} | " + " | ".join(cells) + " |")
    L += [
        "",
        "Minimum ms (least disturbed calls):",
        "",
        "| w | " + " | ".join(res["results"]) + " |",
        "|---:|" + "---:|" * len(res["results"]),
    ]
    for w in WIDTHS:
        L.append(f"| {w} | " + " | ".join(f"{r['verify'][w]['min_ms']:.1f}" for r in res["results"].values()) + " |")
    return "\n".join(L) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a .gguf file or model folder (default: the demo GGUF)")
    ap.add_argument("--precisions", default=",".join(PRECISIONS), help="comma list of " + ", ".join(PRECISIONS))
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--out", help="write OUT.json and OUT.md")
    args = ap.parse_args()
    if mx.default_device() == mx.cpu and not loaded_blas():
        print(
            "note: OpenBLAS is not preloaded; float32 runs on MLX's reference BLAS (see the docstring)", file=sys.stderr
        )
    model = args.model or str(demo_model_path())
    res = {
        "command": " ".join(["python"] + sys.argv),
        "machine": machine(),
        "model": model,
        "reps": args.reps,
        "decode_tokens": args.decode_tokens,
        "results": {},
    }
    for name in args.precisions.split(","):
        t = time.perf_counter()
        target, tok = load_target(model, **PRECISIONS[name])
        ids = tok.encode(PROMPT)[: args.prompt_tokens]
        res["prompt_tokens"] = len(ids)
        load_s = time.perf_counter() - t
        dec = decode_tps(target, ids, args.decode_tokens)
        print(f"{name}: load {load_s:.1f} s, decode {dec['tok_s']:.2f} tok/s", flush=True)
        curve = verify_curve(target, ids, args.reps)
        print(f"{name}: verify " + ", ".join(f"w{w} {c['median_ms']:.0f}ms" for w, c in curve.items()), flush=True)
        res["results"][name] = {"load_s": load_s, "decode": dec, "verify": curve}
        del target
    res["loadavg_end"] = os.getloadavg()
    md = report(res)
    print(md)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(res, indent=1))
        out.with_suffix(".md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
