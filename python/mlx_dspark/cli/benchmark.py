"""`mlx-dspark benchmark`: a mode against plain decoding (and mlx-lm) on this machine.

Warm (one untimed run per side and prompt), `--trials` rounds in which the sides alternate, the
median decode tok/s per prompt, the geometric mean per class (chat, code, math prompt sets;
copy on request). A table on stdout, a progress bar on stderr; `--json` prints one device-stamped
object (device, chip or CPU, MLX version, BLAS, precision, ratios) that can be folded into the
registry; `--chart FILE.png` draws the ratios (matplotlib: pip install 'mlx-dspark[chart]').
"""

from __future__ import annotations

import json
import sys

from .common import add_decode_args, add_model_args, drafter_options, load_from_args, positive_int

CLASSES = ("chat", "code", "math", "copy")


def add_parser(sub) -> None:
    p = sub.add_parser("benchmark", help="measure a mode against baseline (and mlx-lm) on this machine")
    add_model_args(p)
    add_decode_args(p)
    p.add_argument(
        "--prompts",
        default="chat,code,math",
        metavar="CLASSES",
        help=f"prompt sets to run, comma-separated, from {', '.join(CLASSES)} (default: chat,code,math)",
    )
    p.add_argument("--prompt", action="append", help="your own prompt(s) instead of the sets (class 'custom')")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--trials", type=positive_int, default=3, help="timed runs per side and prompt; medians (default 3)")
    p.add_argument("--versus-mlx-lm", action="store_true", help="also time plain mlx-lm generate_step")
    p.add_argument("--json", action="store_true", help="print one device-stamped JSON object")
    p.add_argument("--chart", metavar="FILE.png", help="draw the ratios into a PNG (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _bar(done: int, total: int, what: str) -> None:
    width = 30
    fill = int(width * done / max(total, 1))
    sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total} {what:<24}")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def run(args) -> int:
    from .. import benchmark as bm
    from ..errors import UserError

    if args.prompt:
        sets = {"custom": list(args.prompt)}
    else:
        names = [c.strip() for c in args.prompts.split(",") if c.strip()]
        bad = [c for c in names if c not in bm.PROMPT_SETS]
        if bad or not names:
            raise UserError(f"--prompts {args.prompts!r}: choose from {', '.join(CLASSES)}")
        sets = {c: bm.PROMPT_SETS[c] for c in names}
    target, tokenizer, drafter = load_from_args(args)
    progress = None if args.no_progress or not sys.stderr.isatty() else _bar
    result = bm.run_sets(
        target,
        tokenizer,
        sets,
        args.max_new_tokens,
        mode=args.mode,
        trials=args.trials,
        drafter=drafter,
        versus_mlx_lm=args.versus_mlx_lm,
        progress=progress,
        max_draft=args.max_draft,
        lookup_long_draft=args.lookup_long_draft,
        **drafter_options(args),
    )
    result["max_draft"] = args.max_draft
    stamp = bm.stamp(target, drafter)
    if args.chart:
        bm.chart(result, stamp, args.chart)
    if args.json:
        print(json.dumps({**stamp, **result}, indent=1))
        return 0
    print(
        f"# {stamp['model']} ({stamp['precision']}) on {stamp['chip']}, {stamp['device']}"
        + (f", BLAS {stamp['blas']}" if stamp["blas"] else "")
        + f", mlx {stamp['mlx']}; mode {result['mode']}, "
        f"--max-draft {args.max_draft}, {args.max_new_tokens} new tokens, median of {args.trials}"
    )
    print(bm.table(result))
    if args.chart:
        print(f"chart: {args.chart}")
    return 0
