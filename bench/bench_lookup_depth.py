"""How often a lookup draft is right, by the depth of its n-gram match: the data behind the cost
policy's lookup priors (decode/policy.py PRIOR).

  python bench/bench_lookup_depth.py [--model M] [--dtype float32] [--per-domain 12] [--tokens 160]
                                     [--prompts-dir ../shared/data/prompts/train] [--out FILE.md]

The target answers `--per-domain` prompts of each file in `--prompts-dir` (greedy, plain decoding;
train/ by default: a policy constant is set on training prompts, never on eval/). Then, at every
answer position where lookup (decode/lookup.py's NgramIndex, as the loop uses it) has a match, the
match's continuation is compared with what the target actually wrote: the first token's hit rate,
and the per-slot acceptance of up to 8 drafted tokens (a slot counts once the slots before it hit),
by match depth (2, 3, 4-7, 8+) and by domain. No timing: nothing here depends on the machine.
On Linux CPU preload OpenBLAS (LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0).
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import time
from pathlib import Path

import _package  # noqa: F401  (the installed mlx_dspark, else python/)

DEPTHS = ("2", "3", "4-7", "8+")
SLOTS = 8


def depth_class(d: int) -> str:
    return "2" if d == 2 else "3" if d == 3 else "4-7" if d < 8 else "8+"


def tally(prompt: list[int], answer: list[int], firsts: dict, slots: dict) -> None:
    """Add one answer's lookup matches to `firsts` / `slots` ({depth class: [tried, hit]})."""
    from mlx_dspark.decode.lookup import NgramIndex

    seq = list(prompt) + list(answer)
    idx = NgramIndex()
    for t in range(len(prompt), len(seq)):
        hist = seq[:t]
        idx.sync(hist)
        start, depth = idx.match(hist)
        if start < 0 or depth < 2:
            continue
        c = depth_class(depth)
        cont = idx.tokens[start : start + SLOTS]
        firsts[c][0] += 1
        firsts[c][1] += int(bool(cont) and cont[0] == seq[t])
        for j, tok in enumerate(cont):
            if t + j >= len(seq):
                break
            slots[c][0] += 1
            if tok != seq[t + j]:
                break
            slots[c][1] += 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--per-domain", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--max-prompt-tokens", type=int, default=700)
    ap.add_argument("--prompts-dir", default=str(Path(__file__).resolve().parents[2] / "shared/data/prompts/train"))
    ap.add_argument("--out")
    a = ap.parse_args(argv)

    from mlx_dspark import benchmark as bm
    from mlx_dspark.api import encode_prompt, generate
    from mlx_dspark.train.data import read_prompt_file

    t0 = time.time()
    model, target, tok = bm.load_bench_target(a.model, a.dtype)
    per_dom: dict = {}
    n_tokens = 0
    for f in sorted(Path(a.prompts_dir).glob("*.jsonl")):
        prompts = read_prompt_file(f)
        random.Random(7).shuffle(prompts)
        firsts = collections.defaultdict(lambda: [0, 0])
        slots = collections.defaultdict(lambda: [0, 0])
        done = 0
        for p in prompts:
            if done >= a.per_domain:
                break
            ids = encode_prompt(tok, p.text)
            if len(ids) > a.max_prompt_tokens:
                continue
            res = generate(target, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=a.tokens)
            tally(ids, res.tokens, firsts, slots)
            n_tokens += len(res.tokens)
            done += 1
        per_dom[f.stem] = (firsts, slots)
        print(f"  {f.stem}: {done} answers", file=sys.stderr, flush=True)

    def cell(firsts, slots, c):
        f, s = firsts.get(c, [0, 0]), slots.get(c, [0, 0])
        if not f[0]:
            return "-"
        return f"{f[1] / f[0]:.2f} / {s[1] / max(s[0], 1):.2f} ({f[0]})"

    total_f = collections.defaultdict(lambda: [0, 0])
    total_s = collections.defaultdict(lambda: [0, 0])
    for firsts, slots in per_dom.values():
        for c in DEPTHS:
            for tot, src in ((total_f, firsts), (total_s, slots)):
                tot[c][0] += src.get(c, [0, 0])[0]
                tot[c][1] += src.get(c, [0, 0])[1]
    cmd = "python bench/bench_lookup_depth.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        f"## Lookup drafts by match depth: {Path(str(model)).name} ({a.dtype}), {bm.device_stamp()}",
        f"`{cmd}` at {time.strftime('%Y-%m-%d %H:%M')}; {a.per_domain} prompts per domain from {a.prompts_dir}, "
        f"{n_tokens} greedy answer tokens, {time.time() - t0:.0f} s",
        "",
        "Each cell: first-token hit rate / per-slot acceptance over up to 8 drafted tokens (positions with a match).",
        "",
        "| domain | " + " | ".join(f"depth {c}" for c in DEPTHS) + " |",
        "|---|" + "---|" * len(DEPTHS),
    ]
    for dom, (firsts, slots) in per_dom.items():
        lines.append(f"| {dom} | " + " | ".join(cell(firsts, slots, c) for c in DEPTHS) + " |")
    lines.append("| all | " + " | ".join(cell(total_f, total_s, c) for c in DEPTHS) + " |")
    bm.emit("\n".join(lines) + "\n", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
