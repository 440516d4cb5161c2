"""DSpark on the reference pair: acceptance per eval domain, and speed against plain greedy.

  python bench/bench_dspark.py [--model M] [--drafter DIR] [--dtype float32] [--samples 20]
                               [--out bench/results/dspark-cpu.md] [--json FILE]

Default pair: the demo target (SmolLM2-135M-Instruct, Q4_1 GGUF) and its registered DSpark
drafter (distilled with `mlx-dspark distill`, python/mlx_dspark/assets/). On Linux CPU run it with
OpenBLAS preloaded (the CLI does this by itself; a script does not):
  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python bench/bench_dspark.py

1. Acceptance: mean acceptance length (tokens committed per round = accepted drafts + 1, pooled
   over every round of a domain, DeepSpec's accept_len), greedy, DSpark drafts only (no lookup
   drafts), on a fixed subsample of each ../shared/data/prompts/eval/ file (first turn, the
   chat template). Bars: >= 3.0 humaneval / mbpp, >= 2.2 mt-bench.
2. Speed: decode tok/s of DSpark against plain greedy (baseline mode) on the same target in one
   run, per prompt, warm (one untimed run first), best of --trials; token identity is checked.
   'dspark' is the product default (hybrid lookup drafts on); 'dspark-pure' has them off.
   Bar: >= 1.5x on code on CPU float32.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
import _package  # noqa: E402,F401  (the installed mlx_dspark, else python/)

from mlx_dspark import benchmark as bm  # noqa: E402
from mlx_dspark.api import generate  # noqa: E402
from mlx_dspark.models.drafters import resolve_drafter  # noqa: E402
from mlx_dspark.train import data as D  # noqa: E402
from mlx_dspark.train.evaluate import acceptance, format_table  # noqa: E402

EVAL_DIR = ROOT.parent / "shared" / "data" / "prompts" / "eval"
BARS = {"humaneval": 3.0, "mbpp": 3.0, "mt-bench": 2.2}


def speed(
    target,
    tok,
    drafter,
    prompts: list[D.Prompt],
    n: int,
    trials: int,
    max_draft: int | None = None,
    threshold: float = 0.0,
    chat_template: bool = True,
) -> tuple[list[str], dict]:
    lines, per_dom = [], {}
    for p in prompts:
        ids = D.encode(tok, p.text, chat_template)
        runs = {}
        for side, mode, kw in (
            ("baseline", "baseline", {}),
            (
                "dspark",
                drafter.kind,
                {"lookup_drafts": True, "max_draft": max_draft, "confidence_threshold": threshold},
            ),
            (
                "dspark-pure",
                drafter.kind,
                {"lookup_drafts": False, "max_draft": max_draft, "confidence_threshold": threshold},
            ),
        ):
            generate(target, tok, None, prompt_ids=ids, mode=mode, drafter=drafter, max_new_tokens=8, **kw)  # warm
            best = None
            for _ in range(trials):
                r = generate(target, tok, None, prompt_ids=ids, mode=mode, drafter=drafter, max_new_tokens=n, **kw)
                if best is None or r.decode_tps > best.decode_tps:
                    best = r
            runs[side] = best
        b = runs["baseline"]
        row = {"prompt": p.text[:60], "baseline_tps": round(b.decode_tps, 2), "tokens": len(b.tokens)}
        for side in ("dspark", "dspark-pure"):
            r = runs[side]
            row[f"{side}_tps"] = round(r.decode_tps, 2)
            row[f"{side}_x"] = round(r.decode_tps / b.decode_tps, 3) if b.decode_tps else 0.0
            row[f"{side}_accept"] = round(r.mean_accept_len, 3)
            row[f"{side}_same"] = r.tokens == b.tokens
        per_dom.setdefault(p.domain, []).append(row)
        lines.append(
            f"| {p.domain} | {row['prompt'][:40].replace('|', '/')!s} | {len(b.tokens)} | "
            f"{row['baseline_tps']:.1f} | {row['dspark_tps']:.1f} | **{row['dspark_x']:.2f}x** | "
            f"{row['dspark_accept']:.2f} | {row['dspark-pure_tps']:.1f} | {row['dspark-pure_x']:.2f}x | "
            f"{row['dspark-pure_accept']:.2f} | {'yes' if row['dspark_same'] and row['dspark-pure_same'] else 'NO'} |"
        )
        print(lines[-1], flush=True)
    summary = {}
    for dom, rows in per_dom.items():
        summary[dom] = {
            f"{s}_x_mean": round(statistics.mean(r[f"{s}_x"] for r in rows), 3) for s in ("dspark", "dspark-pure")
        }
        summary[dom]["rows"] = rows
    return lines, summary


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="default: the demo model (SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--drafter", help="default: the registered DSpark drafter of the target")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--bits", default="auto", help="drafter bits: 4, 8, 16 or auto (16 on CPU, 4 on a GPU)")
    ap.add_argument("--draft-vocab", default="auto", help="auto, full or a token count (models/draft_vocab.py)")
    ap.add_argument("--eval-dir", default=str(EVAL_DIR))
    ap.add_argument("--domains", nargs="+", default=["humaneval", "mbpp", "mt-bench", "math500", "swe-bench"])
    ap.add_argument("--samples", type=int, default=20, help="prompts per domain for acceptance")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--speed-domains", nargs="+", default=["humaneval", "mbpp", "mt-bench"])
    ap.add_argument("--speed-prompts", type=int, default=3, help="prompts per speed domain")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--max-draft", type=int, default=None, help="draft tokens per round (default: the full block)")
    ap.add_argument(
        "--confidence-threshold",
        type=float,
        default=0.0,
        help="speed runs: cut each block at the first slot whose confidence is below this",
    )
    ap.add_argument(
        "--no-chat-template", action="store_true", help="feed the prompts as raw text (a base-model target)"
    )
    ap.add_argument(
        "--raw-code",
        action="store_true",
        help="each prompt as raw code (train/data.py raw_code), no chat template: a base model's code prompts",
    )
    ap.add_argument("--skip-accept", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--out", help="append a markdown record here")
    ap.add_argument("--json", help="write all figures here")
    args = ap.parse_args()
    args.no_chat_template = args.no_chat_template or args.raw_code
    bits = None if args.bits == "auto" else int(args.bits)
    model, target, tok = bm.load_bench_target(args.model, args.dtype)
    drafter = resolve_drafter(target, mode="dspark", drafter=args.drafter, bits=bits, draft_vocab=args.draft_vocab)
    info = drafter.describe()
    lines = [
        f"## DSpark vs greedy: {Path(model).name} ({args.dtype or 'default dtype'}), {bm.device_stamp()}",
        f"`{' '.join(sys.argv)}` at {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"drafter {drafter.source}: {info['layers']} layers, block {info['block_size']}, "
        f"Markov rank {info['markov_rank']}, taps {info['taps']}, {info['bits']}-bit, "
        f"draft vocabulary {info['draft_vocab']} tokens",
        "",
    ]
    record: dict = {"model": model, "drafter": drafter.source, "device": bm.device_stamp(), "drafter_info": info}
    eval_dir = Path(args.eval_dir)
    if not args.skip_accept:
        prompts = []
        for dom in args.domains:
            prompts += D.subsample(D.read_prompt_file(eval_dir / f"{dom}.jsonl"), args.samples, 0)
        prompts = D.as_raw_code(prompts) if args.raw_code else prompts
        t0 = time.perf_counter()
        res = acceptance(
            target,
            tok,
            drafter,
            prompts,
            max_new_tokens=args.max_new_tokens,
            chat_template=not args.no_chat_template,
        )
        record["acceptance"] = res
        lines += [
            f"### Mean acceptance length (greedy, DSpark drafts only, {args.samples} prompts/domain, "
            f"{args.max_new_tokens} new tokens; {time.perf_counter() - t0:.0f}s)",
            "",
            "```",
            format_table(res),
            "```",
            "",
        ]
        for dom, bar in BARS.items():
            if dom in res:
                ok = res[dom]["mean_accept"] >= bar
                lines.append(f"- {dom}: {res[dom]['mean_accept']:.2f} (bar >= {bar}): {'met' if ok else 'NOT met'}")
        lines.append("")
        print("\n".join(lines), flush=True)
    if not args.skip_speed:
        prompts = []
        for dom in args.speed_domains:
            prompts += D.subsample(D.read_prompt_file(eval_dir / f"{dom}.jsonl"), args.speed_prompts, 1)
        prompts = D.as_raw_code(prompts) if args.raw_code else prompts
        head = [
            "### Speed: decode tok/s, DSpark against plain greedy (baseline) in one run, warm, "
            f"best of {args.trials}, {args.max_new_tokens} new tokens, "
            f"{args.max_draft or 'full-block'} drafts per round"
            + (f", confidence threshold {args.confidence_threshold}" if args.confidence_threshold else ""),
            "",
            "| domain | prompt | tokens | baseline | dspark | x | accept | dspark-pure | x | accept | same tokens |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        print("\n".join(head), flush=True)
        rows, summ = speed(
            target,
            tok,
            drafter,
            prompts,
            args.max_new_tokens,
            args.trials,
            args.max_draft,
            args.confidence_threshold,
            chat_template=not args.no_chat_template,
        )
        record["speed"] = summ
        lines += head + rows + [""]
        for dom, s in summ.items():
            lines.append(
                f"- {dom}: dspark {s['dspark_x_mean']:.2f}x, dspark-pure {s['dspark-pure_x_mean']:.2f}x "
                f"(mean of per-prompt ratios)"
            )
        code = [r for d in ("humaneval", "mbpp") for r in summ.get(d, {}).get("rows", [])]
        if code:
            mean_x = statistics.mean(r["dspark_x"] for r in code)
            record["code_speedup"] = mean_x
            lines.append(f"- code (humaneval + mbpp): **{mean_x:.2f}x** (bar >= 1.5x on CPU float32)")
        lines.append("")
    text = "\n".join(lines)
    bm.emit(text, args.out)
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
