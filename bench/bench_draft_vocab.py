"""The draft vocabulary (models/draft_vocab.py) on the reference pair: what it saves per round and
what it costs in acceptance, full vocabulary against `auto` (and any other sizes), in one run.

  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
      python bench/bench_draft_vocab.py [--sizes full auto 4096] [--out bench/results/draft-vocab-cpu.md]

1. Drafter pass: the median time of one DSpark draft (backbone + lm_head + Markov chain, forced
   to completion) at a fixed context, per vocabulary size, interleaved.
2. Decode: DSpark drafts only (no lookup drafts) against plain greedy on code prompts: tok/s,
   tokens per round, token identity with greedy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
import _package  # noqa: E402,F401  (the installed mlx_dspark, else python/)
import mlx.core as mx  # noqa: E402

from mlx_dspark import benchmark as bm  # noqa: E402
from mlx_dspark.api import generate  # noqa: E402
from mlx_dspark.models.drafters import resolve_drafter  # noqa: E402
from mlx_dspark.train import data as D  # noqa: E402

EVAL_DIR = ROOT.parent / "shared" / "data" / "prompts" / "eval"


def draft_pass_ms(target, drafter, ids: list[int], reps: int) -> list[float]:
    """Times of one draft (block pass + sampling) with the prompt's context ingested."""
    fwd = target.forward(mx.array([ids]), target.make_cache(), taps=drafter.taps)
    state = drafter.new_state()
    drafter.ingest(fwd.hidden[0][:-1], state)
    mx.eval([c.state for c in state])
    anchor = ids[-1]

    def greedy(row, _drafted):  # the greedy proposer's chooser (decode/drafting.py)
        return mx.argmax(row, axis=-1).astype(mx.int32), None

    greedy.argmax = True
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        h = drafter.block_hidden(anchor, None, state)
        toks, _, _ = drafter.sample(h, anchor, greedy)
        mx.eval(mx.stack(toks))
        out.append((time.perf_counter() - t0) * 1000)  # block K/V never enter the context cache
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="default: the demo model")
    ap.add_argument("--drafter", help="default: the registered DSpark drafter")
    ap.add_argument("--sizes", nargs="+", default=["full", "auto"])
    ap.add_argument("--prompts", type=int, default=3, help="code prompts (humaneval, mbpp) for decode")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out")
    args = ap.parse_args()
    model, target, tok = bm.load_bench_target(args.model)
    drafters = {s: resolve_drafter(target, mode="dspark", drafter=args.drafter, draft_vocab=s) for s in args.sizes}
    prompts = [
        p
        for dom in ("humaneval", "mbpp")
        for p in D.subsample(D.read_prompt_file(EVAL_DIR / f"{dom}.jsonl"), args.prompts, 2)
    ]
    lines = [
        f"## Draft vocabulary: {Path(model).name}, {bm.device_stamp()}",
        f"`{' '.join(sys.argv)}` at {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        "| draft vocabulary | tokens | drafter pass (median ms) |",
        "|---|---:|---:|",
    ]
    ids0 = D.encode(tok, prompts[0].text)
    times = {s: [] for s in args.sizes}
    for _ in range(3):  # interleaved repetitions
        for s, d in drafters.items():
            times[s] += draft_pass_ms(target, d, ids0, args.reps // 3 + 1)
    for s, d in drafters.items():
        lines.append(f"| {s} | {d.describe()['draft_vocab']} | {statistics.median(times[s][3:]):.2f} |")
    lines += [
        "",
        f"Decode, DSpark drafts only, {args.max_new_tokens} new tokens, warm, best of 2:",
        "",
        "| prompt | baseline tok/s | " + " | ".join(f"{s} tok/s | x | accept | same" for s in args.sizes) + " |",
        "|---|---:|" + "---:|---:|---:|---|" * len(args.sizes),
    ]
    ratios = {s: [] for s in args.sizes}
    for p in prompts:
        ids = D.encode(tok, p.text)
        best = {}
        for side in ["baseline", *args.sizes]:
            kw = (
                {"mode": "baseline"}
                if side == "baseline"
                else {"mode": "dspark", "drafter": drafters[side], "lookup_drafts": False}
            )
            generate(target, tok, None, prompt_ids=ids, max_new_tokens=8, **kw)
            runs = [
                generate(target, tok, None, prompt_ids=ids, max_new_tokens=args.max_new_tokens, **kw) for _ in range(2)
            ]
            best[side] = max(runs, key=lambda r: r.decode_tps)
        b = best["baseline"]
        cells = []
        for s in args.sizes:
            r = best[s]
            ratios[s].append(r.decode_tps / b.decode_tps)
            cells.append(
                f"{r.decode_tps:.1f} | {ratios[s][-1]:.2f}x | {r.mean_accept_len:.2f} | "
                f"{'yes' if r.tokens == b.tokens else 'NO'}"
            )
        lines.append(
            f"| {p.domain}: {p.text[:32].replace('|', '/')} | {b.decode_tps:.1f} | " + " | ".join(cells) + " |"
        )
        print(lines[-1], flush=True)
    lines.append("")
    for s in args.sizes:
        lines.append(f"- {s}: mean {statistics.mean(ratios[s]):.2f}x against greedy")
    text = "\n".join(lines) + "\n"
    bm.emit(text, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
