"""Where a fresh process's first generations lose time: every decode step, timed (issue 20).

  python bench/diag_first_steps.py [--mode auto[,baseline,...]] [--runs 3] [--tokens 192] [--prompt TEXT]

Loads the demo target as the CLI does (the calibration read from MLX_DSPARK_CACHE, measured if
absent), then runs `--runs` generations of one prompt in this process, stepping each Generation
and timing every step. Per run: decode seconds, the five slowest steps (their kind: prefill, plain,
or a round of width w, with what it committed) and the policy's counters. A first run whose
slowest steps are rounds that later runs take in a few ms is paying a per-process set-up there.
Several modes (comma-separated) take turns run by run; the last line gives each mode's median
decode tok/s over its runs after the first, and their ratio to the first mode's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import _package  # noqa: F401  (the installed mlx_dspark, else python/)

from mlx_dspark import benchmark as bm  # noqa: E402
from mlx_dspark.api import encode_prompt, start  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--mode", default="auto")
    ap.add_argument("--max-draft", default="auto")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--prompt", default=bm.PROMPT_SETS["code"][0])
    args = ap.parse_args()
    t0 = time.perf_counter()
    model, target, tok = bm.load_bench_target(args.model)
    print(f"load {time.perf_counter() - t0:.1f} s; {bm.device_stamp()}", flush=True)
    ids = encode_prompt(tok, args.prompt)
    max_draft = args.max_draft if args.max_draft == "auto" else int(args.max_draft)
    modes = args.mode.split(",")
    tps: dict[str, list[float]] = {m: [] for m in modes}
    for run in range(args.runs * len(modes)):
        mode = modes[run % len(modes)]
        t = time.perf_counter()
        gen = start(target, tok, None, prompt_ids=ids, mode=mode, max_new_tokens=args.tokens, max_draft=max_draft)
        t_start = time.perf_counter() - t
        g = gen.generation
        steps = []
        for commit in gen:
            steps.append((time.perf_counter() - t, len(commit.tokens)))
            t = time.perf_counter()
        res = gen.result()
        widths = res.accept_lengths
        slow = sorted(range(len(steps)), key=lambda i: -steps[i][0])[:5]
        print(
            f"run {run // len(modes) + 1}: start {t_start * 1e3:.0f} ms, {len(steps)} steps, "
            f"prefill {res.prefill_s * 1e3:.0f} ms, "
            f"decode {res.decode_s:.3f} s ({len(res.tokens) / max(res.decode_s, 1e-9):.1f} tok/s), mode {res.mode}",
            flush=True,
        )
        print(
            "  slowest steps (index: ms, tokens committed): "
            + ", ".join(f"{i}: {steps[i][0] * 1e3:.1f}, {steps[i][1]}" for i in slow)
        )
        decode = sorted(ms for ms, _ in steps[1:])
        if decode:
            med = decode[len(decode) // 2]
            slow_steps = [ms for ms in decode if ms > 3 * med]
            print(
                f"  median step {med * 1e3:.1f} ms; {len(slow_steps)} steps over 3x it, "
                f"{sum(ms - med for ms in slow_steps) * 1e3:.0f} ms above the median in all"
            )
        st = res.stats
        keys = ("drafter_rounds", "drafter_proposed", "drafter_accepted", "lookup_rounds", "probe_rounds", "p_drafter")
        print("  " + ", ".join(f"{k} {st.get(k)}" for k in keys) + f"; rounds {len(widths)}", flush=True)
        tps[mode].append(len(res.tokens) / max(res.decode_s, 1e-9))
        del g
    if len(modes) > 1 and args.runs > 1:
        med = {m: statistics.median(v[1:]) for m, v in tps.items()}
        print(
            "warm medians (runs 2..): "
            + ", ".join(f"{m} {med[m]:.1f} tok/s ({med[m] / med[modes[0]]:.3f}x)" for m in modes)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
