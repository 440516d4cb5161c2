"""`mlx-dspark benchmark`: a mode against plain decoding on this machine, as ratios from one run."""

from __future__ import annotations

import json

from .common import add_decode_args, add_model_args, drafter_options, load_from_args, positive_int


def add_parser(sub) -> None:
    p = sub.add_parser("benchmark", help="measure a mode against baseline (and mlx-lm) on this machine")
    add_model_args(p)
    add_decode_args(p)
    p.add_argument("--prompt", action="append", help="prompt(s) to measure (default: chat, code and copy prompts)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--trials", type=positive_int, default=1, help="runs per side; the best is reported")
    p.add_argument("--versus-mlx-lm", action="store_true", help="also time plain mlx-lm generate_step")
    p.add_argument("--json", action="store_true")


def run(args) -> int:
    from .. import benchmark as bm
    from ..decode.modes import make_proposer

    target, tokenizer, drafter = load_from_args(args)
    mode = make_proposer(args.mode, drafter=drafter, lookup_long_draft=args.lookup_long_draft,
                         **drafter_options(args)).name
    prompts = args.prompt or [bm.CHAT_PROMPT, bm.CODE_PROMPT, bm.COPY_PROMPT]
    sides = (["mlx_lm"] if args.versus_mlx_lm else []) + ["baseline"] + ([mode] if mode != "baseline" else [])
    rows = []
    for prompt in prompts:
        res = bm.compare(target, tokenizer, prompt, args.max_new_tokens, sides, drafter=drafter,
                         repeats=args.trials, max_draft=args.max_draft, lookup_long_draft=args.lookup_long_draft,
                         **drafter_options(args))
        rows.append((prompt, res))
    if args.json:
        out = {"device": bm.device_stamp(), "model": target.source, "mode": mode, "results": [
            {"prompt": p[:80], **{s: {"decode_tps": m.decode_tps, "mean_accept": m.mean_accept,
                                      "tokens": len(m.tokens), "same_as_baseline": m.tokens == r["baseline"].tokens}
                                  for s, m in r.items()}} for p, r in rows]}
        print(json.dumps(out, indent=1))
        return 0
    print(f"# {target.source} on {bm.device_stamp()}; mode {mode}; {args.max_new_tokens} new tokens")
    for prompt, res in rows:
        print(f"\n{prompt[:70]!r}")
        for line in bm.report(res, "baseline"):
            print("  " + line)
    return 0
