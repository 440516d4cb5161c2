"""Identity of every mode with baseline, per precision: greedy, on the eval prompts.

  python bench/bench_invariance.py [--model M] --precision bf16|8|4 [--prompts DIR] [--n 30]
         [--tokens 192] [--modes baseline,lookup,dspark,dspark-nolookup,dflash] [--out FILE.md]
         [--shard K/S]                # this process takes prompts i with i % S == K (S processes at once)
  python bench/bench_invariance.py --merge A.json B.json ... [--out FILE.md]   # one summary of the shards

Prompts: the first turn of the first n/5 rows of each eval file (humaneval, math500, mbpp,
mt-bench, swe-bench), chat template applied. Every mode is compared with `--mode baseline` of
the same loaded target, token ids AND text. dspark uses the target's registered drafter; dflash a
random fixture drafter written for this target (tests/drafter_fixtures.py: it drafts badly, so
verify rounds of every width happen). Prints "N of N identical" per mode, with the first
divergence where there is one. MLX_DSPARK_INVARIANT=off shows the native forward's result.
Every run also writes its counts next to --out (FILE.json), which --merge sums over shards.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import _package  # the installed mlx_dspark, else python/; the precision loader

ROOT = Path(__file__).resolve().parents[1]
FILES = ("humaneval", "math500", "mbpp", "mt-bench", "swe-bench")


def eval_prompts(folder: Path, n: int) -> list[tuple[str, str]]:
    per = -(-n // len(FILES))
    out = []
    for name in FILES:
        rows = [json.loads(line) for line in (folder / f"{name}.jsonl").read_text().splitlines() if line.strip()]
        out += [(f"{name}[{i}]", r["turns"][0]) for i, r in enumerate(rows[:per])]
    return out[:n]


def fixture_dflash(target, folder: Path) -> Path:
    """A random z-lab DFlash drafter shaped for `target` (its config only is read)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from drafter_fixtures import write_zlab
    from safetensors.numpy import save_file

    tdir = folder / "target-config"
    tdir.mkdir(parents=True, exist_ok=True)
    cfg = {k: v for k, v in target.config.items() if isinstance(v, (int, float, str, bool, list, dict, type(None)))}
    (tdir / "config.json").write_text(json.dumps(cfg))
    save_file({}, str(tdir / "model.safetensors"))
    return write_zlab(folder / "dflash", tdir, layers=1)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="default: the demo model")
    ap.add_argument("--precision", default="bf16", choices=_package.PRECISIONS)
    ap.add_argument("--prompts", default="/work/shared/data/prompts/eval")
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--modes", default="lookup,dspark,dspark-nolookup,dflash")
    ap.add_argument("--out")
    ap.add_argument("--shard", default="0/1", help="K/S: prompts i with i %% S == K")
    ap.add_argument(
        "--max-draft",
        default=None,
        help="the drafting modes' cap: unset = the Python API's default (every round the full block: "
        "the most verify widths), 'auto' = the CLI's default (the measured cost model), or N",
    )
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="sum the counts of shard runs")
    args = ap.parse_args()
    if args.merge:
        return merge(args.merge, args.out)
    k, s = (int(x) for x in args.shard.split("/"))
    if not 0 <= k < s:
        ap.error(f"--shard {args.shard}: expected K/S with 0 <= K < S")

    import mlx_dspark as md
    from mlx_dspark import benchmark as bm
    from mlx_dspark.api import drafter_for
    from mlx_dspark.kernels import invariant

    t0 = time.perf_counter()
    target, tok, model = _package.load_precision(args.model, args.precision)
    load_s = time.perf_counter() - t0
    prompts = [p for i, p in enumerate(eval_prompts(Path(args.prompts), args.n)) if i % s == k]
    modes = [m for m in args.modes.split(",") if m and m != "baseline"]
    tmp = Path(tempfile.mkdtemp(prefix="inv-bench-"))
    atexit.register(shutil.rmtree, tmp, True)
    drafters = {}
    if "dflash" in modes:
        drafters["dflash"] = drafter_for(target, "dflash", str(fixture_dflash(target, tmp)))
    if any(m.startswith("dspark") for m in modes):
        drafters["dspark"] = drafter_for(target, "dspark", None)

    def run(mode: str, ids: list[int]):
        kw = (
            {} if args.max_draft is None else {"max_draft": "auto" if args.max_draft == "auto" else int(args.max_draft)}
        )
        name = mode
        if mode == "dspark-nolookup":
            name, kw = "dspark", {**kw, "lookup_drafts": False}
        return md.generate(
            target, tok, None, prompt_ids=ids, mode=name, drafter=drafters.get(name), max_new_tokens=args.tokens, **kw
        )

    shard = f" (shard {k} of {s})" if s > 1 else ""
    head = (
        f"## {Path(model).name} {args.precision}: {len(prompts)} eval prompts{shard}, {args.tokens} tokens greedy, "
        f"max draft {args.max_draft or 'the full block'}, {bm.device_stamp()}"
    )
    from mlx_dspark.kernels import invariant_linear
    from mlx_dspark.models import invariance

    decode_path = invariance.path_of(target)
    attention = invariant.attention_path() if decode_path != "native" else "MLX's own"
    linears = invariant_linear.linear_path() if decode_path == "kernels" else "MLX's own"
    width = f", decode width {target.decode_width}" if decode_path == "fixed" else ""
    lines = [
        head,
        f"`{' '.join(sys.argv)}` at {time.strftime('%Y-%m-%d %H:%M')}",
        f"target path: invariance={target.invariance} (decode path {decode_path}{width}), linears={linears}, "
        f"attention={attention}, MLX_DSPARK_INVARIANT={os.environ.get('MLX_DSPARK_INVARIANT', 'auto')}; "
        f"load + self-check {load_s:.1f} s",
        "",
    ]
    print(lines[2], flush=True)
    same = {m: 0 for m in modes}
    first = {m: None for m in modes}
    tps = {m: [] for m in ["baseline"] + modes}
    for i, (label, text) in enumerate(prompts):
        ids = md.encode_prompt(tok, text)
        base = run("baseline", ids)
        tps["baseline"].append(base.decode_tps)
        for m in modes:
            print(f"  [{i + 1}/{len(prompts)}] {label} ({len(ids)} prompt tokens): {m}", file=sys.stderr, flush=True)
            r = run(m, ids)
            tps[m].append(r.decode_tps)
            if r.tokens == base.tokens and r.text == base.text:
                same[m] += 1
                continue
            at = first_divergence(r.tokens, base.tokens)
            detail = (
                f"{label} token {at}: baseline {base.tokens[at] if at is not None and at < len(base.tokens) else None}"
                f" vs {r.tokens[at] if at is not None and at < len(r.tokens) else None}"
                if at is not None
                else f"{label}: same tokens, different text"
            )
            print(f"  {m}: DIFFERS on {detail}", flush=True)
            if first[m] is None:
                first[m] = detail
    counts = {"precision": args.precision, "n": len(prompts), "same": same, "first": first, "tps": tps}
    if args.out:
        Path(args.out).with_suffix(".json").write_text(json.dumps(counts))
    lines += summary(counts)
    bm.emit("\n".join(lines), args.out)
    return 0 if all(same[m] == len(prompts) for m in modes) else 1


def summary(c: dict) -> list[str]:
    """The per-mode lines: N of N identical, the first divergence, speed against baseline."""
    from mlx_dspark.benchmark import geomean

    out = []
    for m in c["same"]:
        gm = geomean(c["tps"][m]) / max(geomean(c["tps"]["baseline"]), 1e-9)
        line = f"{m:>16} {c['precision']:>4}: {c['same'][m]} of {c['n']} identical"
        line += f"; first divergence: {c['first'][m]}" if c["first"][m] else ""
        line += f"  (decode tok/s x{gm:.3f} baseline, geomean)"
        out.append(line)
    out.append(f"{'baseline':>16} {c['precision']:>4}: {geomean(c['tps']['baseline']):.1f} tok/s decode (geomean)")
    return out + [""]


def merge(files: list[str], out: str | None) -> int:
    """One summary per precision of shard runs (their FILE.json counts)."""
    from mlx_dspark import benchmark as bm

    by: dict[str, dict] = {}
    for f in files:
        c = json.loads(Path(f).read_text())
        t = by.setdefault(c["precision"], {**c, "n": 0, "same": dict.fromkeys(c["same"], 0), "tps": {}})
        t["n"] += c["n"]
        for m, v in c["same"].items():
            t["same"][m] += v
            t["first"][m] = t["first"].get(m) or c["first"][m]
        for m, v in c["tps"].items():
            t["tps"].setdefault(m, []).extend(v)
    lines = [f"## merged: {', '.join(files)}"]
    for c in by.values():
        lines += summary(c)
    bm.emit("\n".join(lines), out)
    return 0 if all(v == c["n"] for c in by.values() for v in c["same"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
