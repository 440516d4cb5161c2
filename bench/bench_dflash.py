"""A DFlash (or any block) drafter on eval prompts: mean acceptance per domain, and losslessness.

  python bench/bench_dflash.py --drafter DIR [--model M] [--dtype float32] [--samples 10]
                               [--domains humaneval mbpp mt-bench] [--out FILE.md] [--json FILE]
                               [--register] [--raw-code]

Every prompt is decoded twice by the one verify loop: plain greedy (baseline) and with the drafter
(its full block, drafter drafts only: no lookup drafts), and the two must agree in tokens AND
text (counted; any mismatch is listed and makes the exit status 1). Acceptance length per round
= accepted drafts + 1, pooled over every round of a domain (DeepSpec's accept_len). Bars of the
DFlash issue: >= 2.5 humaneval / mbpp, >= 2.0 mt-bench (greedy, CPU float32, full block).
A DSpark drafter named with --drafter is measured the same way (its full block, no lookup drafts);
--raw-code feeds each prompt as raw code (its fenced code block, else comment lines) with no chat
template, for a base model such as Gemma 3 270M (bars >= 2.5 on humaneval and mbpp).

--register writes the drafter's pair.json (models/registry.py: write_pair_file) with the figures
measured here and this command line, so that `mlx-dspark models` shows them once the folder is
registered (under python/mlx_dspark/assets/, or named in MLX_DSPARK_PAIRS).
On Linux CPU preload OpenBLAS (LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0).
"""

from __future__ import annotations

import argparse
import json
import shlex
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
BARS = {"humaneval": 2.5, "mbpp": 2.5, "mt-bench": 2.0}
RAW_CODE_BARS = {"humaneval": 2.5, "mbpp": 2.5}  # issue 22's Gemma 3 270M (a base model) pair


def measure(
    target, tok, drafter, prompts, max_new_tokens: int, deadline: float | None = None, chat_template: bool = True
) -> dict:
    """{domain: {mean_accept, rounds, prompts, tokens, lossless, mismatches}, '_all': pooled}."""
    per: dict = {}
    for p in prompts:
        if deadline is not None and time.time() > deadline:
            break
        ids = D.encode(tok, p.text, chat_template)
        base = generate(target, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=max_new_tokens)
        res = generate(
            target,
            tok,
            None,
            prompt_ids=ids,
            mode=drafter.kind,
            drafter=drafter,
            max_new_tokens=max_new_tokens,
            lookup_drafts=False,
        )
        d = per.setdefault(p.domain, {"accept_sum": 0, "rounds": 0, "prompts": 0, "tokens": 0, "lossless": 0})
        d.setdefault("mismatches", [])
        d["accept_sum"] += sum(res.accept_lengths)
        d["rounds"] += len(res.accept_lengths)
        d["prompts"] += 1
        d["tokens"] += len(res.tokens)
        if res.tokens == base.tokens and res.text == base.text:
            d["lossless"] += 1
        else:
            d["mismatches"].append(p.text[:60])
    out, tot = {}, {"accept_sum": 0, "rounds": 0, "prompts": 0, "tokens": 0, "lossless": 0, "mismatches": []}
    for dom, d in sorted(per.items()):
        for k in tot:
            tot[k] += d[k]
        out[dom] = d
    out["_all"] = tot
    for d in out.values():
        d["mean_accept"] = round(d["accept_sum"] / d["rounds"], 3) if d["rounds"] else 0.0
    return out


def summary(res: dict, device: str) -> str:
    """One line for the registry's `measured` field."""
    doms = [f"{res[d]['mean_accept']:.2f} {d}" for d in res if d != "_all"]
    n = max((res[d]["prompts"] for d in res if d != "_all"), default=0)
    ok = res["_all"]["lossless"] == res["_all"]["prompts"]
    return (
        f"{device}: accept {', '.join(doms)} (greedy, full block, {n} eval prompts/domain); "
        f"{'lossless' if ok else 'NOT lossless'} on all {res['_all']['prompts']}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="default: the demo model (SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--drafter", help="default: the registered DFlash drafter of the target")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--bits", default="auto", help="drafter bits: 4, 8, 16 or auto (16 on CPU, 4 on a GPU)")
    ap.add_argument("--draft-vocab", default="auto")
    ap.add_argument("--eval-dir", default=str(EVAL_DIR))
    ap.add_argument("--domains", nargs="+", default=["humaneval", "mbpp", "mt-bench"])
    ap.add_argument("--samples", type=int, default=10, help="prompts per domain")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seconds", type=float, help="stop starting prompts after this many seconds")
    ap.add_argument("--out", help="append a markdown record here")
    ap.add_argument("--json", help="write all figures here")
    ap.add_argument("--register", action="store_true", help="write the drafter's pair.json with these figures")
    ap.add_argument(
        "--raw-code",
        action="store_true",
        help="each prompt as raw code (train/data.py raw_code), no chat template: a base model's code drafter; "
        "bars >= 2.5 on humaneval and mbpp",
    )
    args = ap.parse_args(argv)
    t0 = time.time()
    bits = None if args.bits == "auto" else int(args.bits)
    model, target, tok = bm.load_bench_target(args.model, args.dtype)
    # a named drafter of either kind (a DSpark drafter drafts its block the same way); else the registered DFlash
    mode = "auto" if args.drafter else "dflash"
    drafter = resolve_drafter(target, mode=mode, drafter=args.drafter, bits=bits, draft_vocab=args.draft_vocab)
    info = drafter.describe()
    prompts = []
    for dom in args.domains:
        prompts += D.subsample(D.read_prompt_file(Path(args.eval_dir) / f"{dom}.jsonl"), args.samples, 0)
    if args.raw_code:
        prompts = D.as_raw_code(prompts)
    res = measure(
        target,
        tok,
        drafter,
        prompts,
        args.max_new_tokens,
        deadline=t0 + args.seconds if args.seconds else None,
        chat_template=not args.raw_code,
    )
    device = bm.device_stamp()
    cmd = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    lines = [
        f"## {'DFlash' if drafter.kind == 'dflash' else 'DSpark'} drafter on eval prompts"
        f"{' as raw code' if args.raw_code else ''}: {Path(model).name} ({args.dtype or 'default dtype'}), {device}",
        f"`{cmd}` at {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"drafter {drafter.source} ({info['packaging']}): {info['layers']} layers, "
        f"{info['drafts_per_round']} drafts per round, taps {info['taps']}, {info['bits']}-bit, "
        f"draft vocabulary {info['draft_vocab']} tokens; {args.max_new_tokens} new tokens, greedy, "
        f"drafter drafts only; {time.time() - t0:.0f}s",
        "",
        "| domain | prompts | rounds | mean accept | lossless (tokens and text) |",
        "|---|---|---|---|---|",
    ]
    for dom, r in res.items():
        name = "all (pooled)" if dom == "_all" else dom
        acc, ok = f"{r['mean_accept']:.3f}", f"{r['lossless']}/{r['prompts']}"
        lines.append(f"| {name} | {r['prompts']} | {r['rounds']} | {acc} | {ok} |")
    lines.append("")
    for dom, bar in (RAW_CODE_BARS if args.raw_code else BARS).items():
        if dom in res:
            ok = res[dom]["mean_accept"] >= bar
            lines.append(f"- {dom}: {res[dom]['mean_accept']:.2f} (bar >= {bar}): {'met' if ok else 'NOT met'}")
    bad = res["_all"]["mismatches"]
    lines.append(f"- lossless: {'yes, every prompt' if not bad else 'NO: ' + '; '.join(bad[:5])}")
    lines.append("")
    bm.emit("\n".join(lines), args.out)
    record = {"model": model, "drafter": drafter.source, "device": device, "drafter_info": info, "result": res}
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    if args.register:
        from mlx_dspark.models.drafters import target_dtype
        from mlx_dspark.models.registry import write_pair_file

        first = device.split(";")[0]
        label = ("CPU" if "cpu" in first.lower() else first) + " " + str(target_dtype(target)).split(".")[-1]
        measured = summary(res, label) + ("; prompts as raw code (no chat template)" if args.raw_code else "")
        accept = {d: r["mean_accept"] for d, r in res.items() if d != "_all" and r["rounds"]}
        f = write_pair_file(Path(drafter.source), target, measured=measured, reproduce=cmd, accept=accept)
        print(f"registered: {f}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
