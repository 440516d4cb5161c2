"""Where `--mode auto` spends its time against plain decoding: every step of a generation, timed.

  python bench/diag_auto_steps.py [--model GGUF] [--dtype bfloat16] [--reps 4] [--tokens 192]
                                  [--prompts code,chat,math] [--timeline]

Per diag prompt (bench/diag_auto_ahead.py's three) and repetition, in one warm process (the first
repetition is a warm-up and not shown): baseline; `auto` (the CLI's defaults); `k7` (`--mode dspark
--max-draft 7`, drafted ahead); and `parked`: a DSpark generation that never drafts
(DrafterProposer.wants_round forced False: every step a pipelined plain step with the drafter's
taps on and its rows kept), which is what auto's parked stretches cost. Each Generation is stepped
by hand and every step timed (wall, from before step() to after it). Per mode: the whole decode,
its ratio to baseline, and the steps by kind (plain, a plain step that commits nothing, a round of
verify width w): how many, their time, median and the tokens they committed. `--timeline` also
prints auto's steps in order in the last repetition. Every mode's ids, and the text its steps
committed, equal baseline's (checked).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import _package  # noqa: F401  (the mlx_dspark on the path or installed, else python/)
from diag_auto_ahead import PROMPTS


def run(gen) -> tuple[list[tuple[int, int, float]], str]:
    """(drafts verified, tokens committed, ms) of every step of a Generation, stepped to its end,
    and the text its commits carried."""
    steps, text = [], []
    while not gen.done:
        n0, r0 = len(gen.res.tokens), len(gen.res.drafted)
        t0 = time.perf_counter()
        commit = gen.step()
        ms = (time.perf_counter() - t0) * 1e3
        text.append(commit.text)
        drafted = gen.res.drafted[r0:]
        steps.append((max(drafted) if drafted else 0, len(gen.res.tokens) - n0, ms))
    return steps, "".join(text)


def by_kind(steps) -> str:
    kinds = defaultdict(list)
    for k, c, ms in steps[1:]:  # the first step reads the prefill's token
        kinds[f"w{k + 1}" if k else ("plain" if c else "plain+0")].append((c, ms))
    order = sorted(kinds.items(), key=lambda kv: -sum(ms for _, ms in kv[1]))
    parts = []
    for kind, v in order:
        ms = [m for _, m in v]
        parts.append(f"{kind} n{len(v)} {sum(ms):.1f} ms (med {statistics.median(ms):.2f}) +{sum(c for c, _ in v)}")
    return "; ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--prompts", default=",".join(PROMPTS))
    ap.add_argument("--timeline", action="store_true")
    args = ap.parse_args()
    import mlx_dspark as md
    from mlx_dspark import benchmark as bm
    from mlx_dspark.api import drafter_for, start
    from mlx_dspark.decode.drafting import DrafterProposer

    _, t, tok = bm.load_bench_target(args.model, args.dtype)
    d = drafter_for(t, "dspark")
    modes = {
        "baseline": {"mode": "baseline"},
        "auto": {"mode": "auto", "max_draft": "auto", "drafter": d},
        "k7": {"mode": "dspark", "max_draft": 7, "drafter": d},
        "parked": {"mode": "dspark", "max_draft": "auto", "drafter": d},
    }
    wants = DrafterProposer.wants_round
    totals: dict = defaultdict(list)
    for name in args.prompts.split(","):
        ids = md.encode_prompt(tok, PROMPTS[name])
        for rep in range(args.reps):
            got = {}
            for mode, kw in modes.items():
                if mode == "parked":
                    DrafterProposer.wants_round = lambda self, history: False
                try:
                    tg = start(t, tok, None, prompt_ids=ids, max_new_tokens=args.tokens, **kw)
                    t0 = time.perf_counter()
                    steps, text = run(tg.generation)
                    got[mode] = (steps, (time.perf_counter() - t0) * 1e3, tg.generation.res, text)
                finally:
                    DrafterProposer.wants_round = wants
                if got[mode][2].tokens != got["baseline"][2].tokens or text != got["baseline"][3]:
                    raise SystemExit(f"{mode} on {name}: not baseline's ids and text")
            if rep == 0:
                continue  # warm-up: MLX compiles kernels per shape on first use
            base = got["baseline"][1]
            print(f"{name} {rep}: " + " | ".join(f"{m} {got[m][1]:.1f} ms ({base / got[m][1]:.3f}x)" for m in modes))
            for m in modes:
                totals[(name, m)].append(base / got[m][1])
                print(f"    {m}: {by_kind(got[m][0])}")
            if args.timeline and rep == args.reps - 1:
                line = " ".join(f"{f'w{k + 1}' if k else 'p'}:{ms:.1f}" for k, _, ms in got["auto"][0])
                print(f"    auto in order: {line}")
                stats = got["auto"][2].proposer_stats or {}
                print(f"    auto's policy: {stats}")
    print("\nmedian ratio to baseline over the repetitions:")
    for name in args.prompts.split(","):
        ratios = (f"{m} {statistics.median(totals[(name, m)]):.3f}x" for m in modes if m != "baseline")
        print(f"  {name}: " + ", ".join(ratios))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
