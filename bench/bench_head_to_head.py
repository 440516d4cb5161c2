"""DSpark against DFlash on one target, each at its own best cap, per domain, from one run.

  python bench/bench_head_to_head.py --dflash DIR [--dspark DIR] [--model M] [--dtype float32]
                                     [--prompts 2] [--max-new-tokens 96] [--trials 2]
                                     [--dspark-caps 3,5,0] [--dflash-caps 4,8,0] [--out FILE.md] [--json FILE]

Domains: chat (eval mt-bench), code (eval humaneval and mbpp), maths (eval math500), copy
(`mlx-dspark benchmark`'s copy-edit prompt). Each prompt runs, after one untimed warm-up of every
side, `--trials` rounds in which plain greedy (baseline) and every (drafter, cap) alternate; a
side's figure per prompt is its median decode tok/s, and every run must equal baseline in token
ids AND text (exit status 1 otherwise). A cap is the most draft tokens per round (`--max-draft`;
0 = the drafter's full block); a drafter's best cap is the one with the highest geometric-mean
ratio to baseline over all prompts, and the per-domain table shows each drafter at that cap:
decode tok/s, mean acceptance (accepted + 1 per round) and the ratio to plain decoding. Free
n-gram lookup drafts are off for both: the figures are the drafters' own.
On Linux CPU preload OpenBLAS (LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0).
On the H200 (MLX CUDA, the carry set of bench/h200_distill_dflash.sh in $C; both shipped drafters
travel in the tree): `source bench/h200_wheels.sh; PYTHONPATH=/tmp/site:python python3
bench/bench_head_to_head.py --model $C/SmolLM2-135M-Instruct.Q4_1.gguf --dtype bfloat16 --eval-dir
$C/eval --dflash-caps 4,6,8,0` (drafter bits auto: 4 on a GPU).
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

EVAL_DIR = ROOT.parent / "shared" / "data" / "prompts" / "eval"
DOMAINS = {"chat": ["mt-bench"], "code": ["humaneval", "mbpp"], "maths": ["math500"]}


def prompts_by_domain(eval_dir: Path, n: int) -> dict[str, list[str]]:
    out = {}
    for dom, files in DOMAINS.items():
        each = -(-n // len(files))  # n prompts per domain, taken in turn from its eval files
        per_file = [[p.text for p in D.subsample(D.read_prompt_file(eval_dir / f"{f}.jsonl"), each, 0)] for f in files]
        out[dom] = [p for group in zip(*per_file) for p in group][:n]
    out["copy"] = list(bm.PROMPT_SETS["copy"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="default: the demo model (SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--dspark", help="DSpark drafter (default: the target's registered one)")
    ap.add_argument("--dflash", help="DFlash drafter (default: the target's registered one)")
    ap.add_argument("--bits", default="auto", help="drafter bits: 4, 8, 16 or auto")
    ap.add_argument("--eval-dir", default=str(EVAL_DIR))
    ap.add_argument("--prompts", type=int, default=2, help="prompts per domain (code: humaneval and mbpp in turn)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--dspark-caps", default="3,5,0")
    ap.add_argument("--dflash-caps", default="4,8,0")
    ap.add_argument("--out", help="append a markdown record here")
    ap.add_argument("--json", help="write all figures here")
    a = ap.parse_args()
    bits = None if a.bits == "auto" else int(a.bits)
    model, target, tok = bm.load_bench_target(a.model, a.dtype)
    drafters = {
        "dspark": resolve_drafter(target, mode="dspark", drafter=a.dspark, bits=bits),
        "dflash": resolve_drafter(target, mode="dflash", drafter=a.dflash, bits=bits),
    }
    caps = {"dspark": [int(c) for c in a.dspark_caps.split(",")], "dflash": [int(c) for c in a.dflash_caps.split(",")]}
    sides = ["baseline"] + [f"{k}@{c}" for k in drafters for c in caps[k]]
    sets = prompts_by_domain(Path(a.eval_dir), a.prompts)
    t0 = time.perf_counter()

    def run(side: str, ids: list[int]):
        if side == "baseline":
            return generate(target, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=a.max_new_tokens)
        kind, cap = side.split("@")
        return generate(
            target,
            tok,
            None,
            prompt_ids=ids,
            mode=kind,
            drafter=drafters[kind],
            max_draft=int(cap),
            max_new_tokens=a.max_new_tokens,
            lookup_drafts=False,
        )

    rows, mismatches = [], []
    for dom, texts in sets.items():
        for text in texts:
            ids = bm.encode_prompt(tok, text)
            for side in sides:  # warm-up, untimed
                run(side, ids)
            got: dict[str, list] = {s: [] for s in sides}
            for t in range(a.trials):
                for side in sides if t % 2 == 0 else reversed(sides):
                    got[side].append(run(side, ids))
            base = got["baseline"][0]
            for side in sides[1:]:
                for r in got[side]:
                    if r.tokens != base.tokens or r.text != base.text:
                        mismatches.append(f"{dom} {side}: {text[:40]!r}")
            rows.append(
                {
                    "domain": dom,
                    "prompt": text[:60],
                    "tps": {s: statistics.median(r.decode_tps for r in got[s]) for s in sides},
                    "accept": {s: statistics.median(r.mean_accept_len for r in got[s]) for s in sides[1:]},
                }
            )
            print(f"  {dom}: {text[:40]!r} done at {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)

    def ratio(side, rs):
        return bm.geomean([r["tps"][side] / r["tps"]["baseline"] for r in rs])

    best = {k: max((f"{k}@{c}" for c in caps[k]), key=lambda s: ratio(s, rows)) for k in drafters}
    lines = [
        f"## DSpark vs DFlash: {Path(model).name} ({a.dtype or 'default dtype'}), {bm.device_stamp()}",
        f"`{' '.join(sys.argv)}` at {time.strftime('%Y-%m-%d %H:%M')}; {time.perf_counter() - t0:.0f}s",
        "",
        f"- DSpark: {drafters['dspark'].source}; DFlash: {drafters['dflash'].source}. {a.max_new_tokens} new tokens, "
        f"greedy, median of {a.trials} alternating trials per prompt, lookup drafts off; cap 0 = the full block.",
        "- Overall ratio to plain decoding (geometric mean over all prompts) per cap: "
        + ", ".join(f"{s} {ratio(s, rows):.2f}x" for s in sides[1:]),
        f"- Best caps: DSpark {best['dspark'].split('@')[1]}, DFlash {best['dflash'].split('@')[1]}.",
        "",
        "| domain | prompts | baseline tok/s | DSpark tok/s | accept | x | DFlash tok/s | accept | x |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    per_dom = {}
    for dom in sets:
        rs = [r for r in rows if r["domain"] == dom]
        d = {"prompts": len(rs), "baseline_tps": bm.geomean([r["tps"]["baseline"] for r in rs])}
        for k, s in best.items():
            d[k] = {
                "cap": int(s.split("@")[1]),
                "tps": bm.geomean([r["tps"][s] for r in rs]),
                "accept": statistics.mean(r["accept"][s] for r in rs),
                "x": ratio(s, rs),
            }
        per_dom[dom] = d
        cells = [f"{d[k]['tps']:.1f} | {d[k]['accept']:.2f} | {d[k]['x']:.2f}x" for k in ("dspark", "dflash")]
        lines.append(f"| {dom} | {len(rs)} | {d['baseline_tps']:.1f} | {cells[0]} | {cells[1]} |")
    lines += ["", f"- same tokens and text as plain decoding: {'yes, every run' if not mismatches else 'NO'}"]
    lines += [f"  - mismatch: {m}" for m in mismatches]
    bm.emit("\n".join(lines) + "\n", a.out)
    if a.json:
        Path(a.json).write_text(
            json.dumps({"device": bm.device_stamp(), "best": best, "domains": per_dom, "rows": rows}, indent=1)
        )
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
