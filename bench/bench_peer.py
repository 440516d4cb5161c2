"""Ours against the other implementation (`mlx-dspark==0.20.3` from PyPI) in one job: same target,
same drafter, same prompt token ids, greedy, warm, each side in its own process.

  python bench/bench_peer.py [--model GGUF_OR_MLX_DIR] [--n 3] [--tokens 192] [--trials 2]
                             [--caps 2,4,7] [--ours-bits default,16|default,hostdraft,noahead] [--no-peer]
                             [--out FILE] [--json FILE]

--no-peer: ref and ours only (the peer is neither installed nor run); --ours-bits hostdraft adds a
DSpark row whose compiled drafts are read back before the verify (two host syncs a round), noahead
one whose next block is drafted after the round's accept point is read back (decode/drafting.py's
draft ahead off).

What runs, one subprocess each, in this order (the parent imports neither package):
  prep  (ours, PYTHONPATH=python): the target GGUF (--model, else $MLX_DSPARK_DEMO_GGUF / the demo)
        becomes an MLX folder once with `mlx-dspark convert --dtype D` (D: bfloat16 on a GPU,
        float32 on CPU), which all three sides load; the peer has no target GGUF loader. Our shipped
        8-bit drafter (python/mlx_dspark/assets/dspark-smollm2-135m-instruct) is dequantized to an
        unquantized D copy: the peer cannot quantize its rank-48 Markov head, so it loads it with
        its `--drafter-bits 0` equivalent (load_drafter(quantize=False)).
  ref   (mlx-lm only, neither mlx_dspark importable): mlx_lm.stream_generate (what mlx_lm.generate
        runs), argmax; it also makes the prompt ids (chat template, as our encode_prompt does), which
        both sides then decode from.
  ours  (PYTHONPATH=python): baseline, and DSpark as `generate --mode dspark` runs it by default
        (--max-draft auto, lookup drafts on, default drafter bits), plus DSpark with the drafter
        unquantized (--ours-bits 16).
  peer  (sys.path: its own site first; ours removed, editable finders dropped; asserted): its
        greedy_generate (`--mode baseline`) and speculative_generate at --max-draft 2, 4, 7 with
        its own defaults otherwise (lookup drafts as lookup_drafts_default says, long drafts 32,
        drafter window as resolve_drafter_window says), after the kernel gates its CLI applies
        (apply_small_m, _sdpa_split, _multirow_attn, _wide_gemm, _cpu_split; what each did is in
        the JSON). Its caches go to <work>/peer_home (HOME), not ~/.cache.
Per side: one untimed pass over every prompt and mode (MLX compiles kernels per shape on first
use), then --trials timed passes (mode order reversed on odd passes); per prompt the best tok/s,
tok/s = tokens / wall time of the whole call (prefill included); per domain and overall the
geometric mean over prompts. Lossless: each side's DSpark ids and text against its own baseline
(every run, the warm-up too). Prompts: the first turn of the first --n rows of each
--eval-dir/{humaneval,mbpp,mt-bench,math500}.jsonl. A --budget-s guard stops timed passes early.

Peer install (offline): `pip install --no-deps --no-index --target <work>/peer_site` of the wheels
in --peer-wheels (default .device-carry/peer-wheels, git-ignored): mlx_dspark-0.20.3 and mlx_vlm
go first on the peer's path (its model.py imports mlx_vlm's rope utils); the others only fill gaps
behind the machine's own packages. The wheels to carry to the H200 (Python 3.12, no index):
  mlx_dspark-0.20.3-py3-none-any.whl     the peer (pure Python)
  mlx_vlm-0.7.10-py3-none-any.whl        the peer imports mlx_vlm at import time
  requests-2.34.2, urllib3-2.8.0, certifi-2026.10.19.post1, idna-3.20 (py3-none-any),
  charset_normalizer-3.5.3-cp312 manylinux, pillow-13.0.0-cp312 manylinux_2_27/2_28
        mlx_vlm imports requests and PIL; used only where the machine lacks them
Made here with:
  pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    -d .device-carry/peer-wheels mlx-vlm==0.7.10 requests==2.34.2 urllib3==2.8.0 certifi idna \
    charset-normalizer pillow   (plus the peer's wheel copied in)
mlx, mlx-cuda-13, mlx-lm come from the machine's /tmp/site as for every other bench script.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "python"
ASSET = SRC / "mlx_dspark" / "assets" / "dspark-smollm2-135m-instruct"
EVAL_DIR = ROOT.parent / "shared" / "data" / "prompts" / "eval"
WHEELS = ROOT / ".device-carry" / "peer-wheels"
DOMAINS = ("humaneval", "mbpp", "mt-bench", "math500")
CODE, CHAT = ("humaneval", "mbpp"), ("mt-bench",)
FRONT = ("mlx_dspark-", "mlx_vlm-")  # wheels that go ahead of the machine's packages on the peer's path
PEER_VERSION = "0.20.3"
SIDES = Path(__file__).resolve().parent / "peer_sides.py"  # the per-side processes


def say(msg: str) -> None:
    print(f"[bench_peer {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def geomean(xs) -> float:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else 0.0


# ------------------------------------------------------------------ parent side
def child_env(kind: str, peer_home: Path) -> dict:
    """The environment of a child: PYTHONPATH without the other package's directory."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.realpath(p) != str(SRC)]
    if kind == "ours":
        parts.insert(0, str(SRC))
    if kind == "peer":
        env["HOME"] = str(peer_home)  # its calibration caches live under ~/.cache/mlx_dspark
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def run_child(role: str, job: dict, work: Path, python: str, env_kind: str) -> dict:
    job = dict(job, result=str(work / f"{role}.json"))
    jp = work / f"{role}-job.json"
    jp.write_text(json.dumps(job))
    t0 = time.time()
    say(f"{role}: starting")
    p = subprocess.run([python, str(SIDES), "--role", role, "--job", str(jp)],
                       env=child_env(env_kind, work / "peer_home"), cwd=str(work))  # fmt: skip
    if p.returncode != 0:
        raise SystemExit(f"bench_peer: the {role} process failed (exit {p.returncode}); its output is above")
    say(f"{role}: done in {time.time() - t0:.0f}s")
    return json.loads(Path(job["result"]).read_text())


def install_peer(wheels: Path, site: Path, deps: Path, python: str) -> None:
    whls = sorted(wheels.glob("*.whl"))
    front = [w for w in whls if w.name.startswith(FRONT)]
    if not any(w.name.startswith(f"mlx_dspark-{PEER_VERSION}-") for w in front):
        raise SystemExit(f"bench_peer: no mlx_dspark-{PEER_VERSION} wheel in {wheels} (see the header for the list)")
    rest = [w for w in whls if w not in front]
    stamp = "\n".join(w.name for w in whls)
    mark = site / ".bench_peer_installed"
    if mark.is_file() and mark.read_text() == stamp:
        return
    env = dict(os.environ, PIP_ROOT_USER_ACTION="ignore")
    pip = [
        python,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-index",
        "--no-compile",
        "--disable-pip-version-check",
    ]
    subprocess.run([*pip, "--upgrade", "--target", str(site), *map(str, front)], check=True, env=env)
    for w in rest:  # one by one: a wheel built for another interpreter is skipped, said so
        p = subprocess.run([*pip, "--target", str(deps), str(w)], env=env, capture_output=True, text=True)
        if p.returncode:
            say(f"fallback {w.name} not installed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    mark.write_text(stamp)
    say(f"peer installed into {site} ({len(front)} wheels), fallbacks into {deps} ({len(rest)})")


def read_prompts(eval_dir: Path, domains, n: int) -> list[dict]:
    out = []
    for dom in domains:
        f = eval_dir / f"{dom}.jsonl"
        if not f.is_file():
            raise SystemExit(f"bench_peer: no prompt file {f}: pass --eval-dir")
        with f.open() as fh:
            for line in fh:
                if len([p for p in out if p["domain"] == dom]) >= n:
                    break
                row = json.loads(line)
                out.append({"domain": dom, "text": row["turns"][0]})
    return out


def summarize(prompts, sides: dict) -> dict:
    """Per mode: geomean tok/s per domain and overall; lossless per side."""
    doms = list(dict.fromkeys(p["domain"] for p in prompts))
    table = {}
    for side, res in sides.items():
        for mode, rows in res["modes"].items():
            key = f"{side}:{mode}"
            t = {d: geomean(r["tps"] for r in rows if r["domain"] == d) for d in doms}
            t["code"] = geomean(r["tps"] for r in rows if r["domain"] in CODE)
            t["chat"] = geomean(r["tps"] for r in rows if r["domain"] in CHAT)
            t["overall"] = geomean(r["tps"] for r in rows)
            t["accept"] = sum(r["accept"] for r in rows) / len(rows)
            table[key] = t
    return table


def lossless(res: dict, ref_rows=None) -> dict:
    """Each mode's ids and text (of the tokens asked for) against the side's baseline, prompt by
    prompt; every run was also checked to repeat the first (all_runs_same)."""
    base = res["modes"]["baseline"]
    out = {}
    for mode, rows in res["modes"].items():
        against = ref_rows if mode == "baseline" and ref_rows is not None else base
        ids = sum(r["tokens"] == b["tokens"] for r, b in zip(rows, against))
        txt = sum(r["text_n"] == b["text_n"] for r, b in zip(rows, against))
        rep = all(r["all_runs_same"] for r in rows)
        extra = max(r["extra"] for r in rows)
        out[mode] = {"ids": ids, "text": txt, "of": len(rows), "repeatable": rep, "extra": extra}
    return out


def report(args, prep, ref, ours, peer, prompts) -> tuple[str, dict]:
    """The report and the JSON record; `peer` None: ours against mlx-lm only (--no-peer)."""
    sides = {"ref": ref, "ours": ours, **({"peer": peer} if peer else {})}
    t = summarize(prompts, sides)
    cols = list(dict.fromkeys(p["domain"] for p in prompts)) + ["code", "chat", "overall"]
    fmt = lambda x: f"{x:.1f}" if x else "-"  # noqa: E731
    caps = [k for k in t if k.startswith("peer:dspark")]
    ours_main = "ours:dspark" if "ours:dspark" in t else next(k for k in t if k.startswith("ours:dspark"))
    best = {c: max(caps, key=lambda k: t[k][c]) for c in cols} if caps else {}

    def ratio(a, b, c):
        return t[a][c] / t[b][c] if t[b][c] else 0.0

    title = f"Ours against mlx-dspark {peer['version']} (PyPI)" if peer else "Ours against mlx-lm (the peer not run)"
    lines = [
        f"## {title} in one job: {prep['device']}, mlx {prep['mlx']}, mlx-lm {ref['mlx_lm']}, {prep['dtype']}",
        f"`python {' '.join(sys.argv)}` at {time.strftime('%Y-%m-%d %H:%M')}; Python {prep['python']}",
        "",
        f"{args.n} prompts per domain (first turn of the first rows of {', '.join(args.domains)}), {args.tokens} new "
        f"tokens, greedy, the same prompt ids on every side; one warm-up pass, then the best of "
        f"{ours['timed_passes']} (ours) / {peer['timed_passes'] if peer else '-'} (peer) / "
        f"{ref['timed_passes']} (mlx-lm) timed passes; "
        "tok/s = tokens / wall time of the whole call; geometric means over prompts (code = humaneval + mbpp, "
        "chat = mt-bench).",
        f"Target: {prep['target_dir']} (from {Path(prep['model']).name}, "
        f"`mlx-dspark convert --dtype {prep['dtype']}`), "
        "loaded by each side. Drafter: our shipped asset; ours loads it as its CLI does "
        + ", ".join(
            f"({k}: {v.get('bits')}-bit, draft vocabulary {v.get('draft_vocab')})" for k, v in ours["drafters"].items()
        )
        + f"; the peer loads its {prep['dtype']} dequantized copy unquantized (`--drafter-bits 0`).",
        (
            f"Peer: {peer['file']} (Python {peer['python']}; {json.dumps(peer['packages'])}); "
            f"lookup drafts {peer['lookup_drafts']}, drafter window {peer['drafter_window']}; "
            f"kernel gates: {json.dumps(peer['gates'])}."
            if peer
            else "Peer: not run (--no-peer)."
            if args.no_peer
            else "Peer: not yet run (this report is written before its side starts)."
        ),
        "",
        "| tok/s | " + " | ".join(cols) + " | accept |",
        "|---|" + "---|" * (len(cols) + 1),
    ]
    label = {"ref:mlx_lm": "mlx_lm.generate (reference)"}
    for k, row in t.items():
        name = label.get(
            k, k.replace(":", " ").replace("dspark-cap", "DSpark cap ").replace("ours dspark", "ours DSpark")
        )
        lines.append(f"| {name} | " + " | ".join(fmt(row[c]) for c in cols) + f" | {row['accept']:.2f} |")
    rat = {"ours DSpark / mlx_lm": {c: ratio(ours_main, "ref:mlx_lm", c) for c in cols}}
    if peer:
        rat = {
            "ours DSpark / peer best cap": {c: ratio(ours_main, best[c], c) for c in cols},
            "peer best cap": {c: best[c].split("cap")[-1] for c in cols},
            **rat,
            "peer best cap / mlx_lm": {c: ratio(best[c], "ref:mlx_lm", c) for c in cols},
            "ours baseline / peer baseline": {c: ratio("ours:baseline", "peer:baseline", c) for c in cols},
        }
    for k in t:
        if k.startswith("ours:dspark-"):
            rat[f"{k[5:]} / mlx_lm"] = {c: ratio(k, "ref:mlx_lm", c) for c in cols}
            if peer:
                rat[f"{k[5:]} / peer best cap"] = {c: ratio(k, best[c], c) for c in cols}
    lines += ["", "| ratio | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for name, row in rat.items():
        cells = [v if isinstance(v, str) else f"{v:.2f}x" for v in (row[c] for c in cols)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    bars = [
        *(
            [("ours DSpark / peer best cap, overall", rat["ours DSpark / peer best cap"]["overall"], 1.3)]
            if peer
            else []
        ),
        ("ours DSpark / mlx_lm, code", rat["ours DSpark / mlx_lm"]["code"], 2.0),
        ("ours DSpark / mlx_lm, chat", rat["ours DSpark / mlx_lm"]["chat"], 1.5),
    ]
    lines.append("")
    for name, v, bar in bars:
        lines.append(f"- {name}: **{v:.2f}x** (bar >= {bar}x): {'met' if v >= bar else 'NOT met'}")
    ll = {side: lossless(res, ref["modes"]["mlx_lm"]) for side, res in sides.items() if side != "ref"}
    lines += [
        "",
        "| side | mode | token ids equal | text equal | against | every run repeats | most tokens past the asked |",
        "|---|---|---|---|---|---|---|",
    ]
    for side, modes in ll.items():
        for mode, v in modes.items():
            against = "mlx_lm reference" if mode == "baseline" else f"{side} baseline"
            lines.append(f"| {side} | {mode} | {v['ids']}/{v['of']} | {v['text']}/{v['of']} | {against} | "
                         f"{'yes' if v['repeatable'] else 'NO'} | {v['extra']} |")  # fmt: skip
    lines.append(
        "\nPrompt ids as each side's own chat-template encoding makes them: "
        + ", ".join(f"{side} {sum(sides[side]['same_prompt_ids'])}/{len(prompts)}" for side in ll)
        + " equal to the shared ones."
    )
    for side, modes in ll.items():
        ok = all(v["ids"] == v["of"] and v["text"] == v["of"] for m, v in modes.items() if m != "baseline")
        extra = max(v["extra"] for v in modes.values())
        lines.append(
            f"- {side}: DSpark = its own baseline (ids and text, every prompt): **{'yes' if ok else 'NO'}**"
            + (f"; its calls returned up to {extra} tokens past the {args.tokens} asked (tok/s and the checks "
               f"count the first {args.tokens})" if extra else "")
        )  # fmt: skip
    record = {"prep": prep, "tok_s": t, "ratios": rat, "lossless": ll, "bars": bars, "prompts": prompts,
              "sides": {k: {kk: vv for kk, vv in v.items() if kk != "modes"} for k, v in sides.items()},
              "rows": {k: {m: [{kk: vv for kk, vv in r.items() if kk != "text"} for r in rows]
                           for m, rows in v["modes"].items()} for k, v in sides.items()}}  # fmt: skip
    return "\n".join(lines) + "\n", record


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="target GGUF or MLX folder (default: $MLX_DSPARK_DEMO_GGUF, else the demo)")
    ap.add_argument("--drafter", default=str(ASSET), help="our drafter folder (default: the shipped asset)")
    ap.add_argument(
        "--dtype", choices=["float32", "float16", "bfloat16"], help="default: bfloat16 on a GPU, float32 on CPU"
    )
    ap.add_argument("--eval-dir", default=str(EVAL_DIR))
    ap.add_argument("--domains", nargs="+", default=list(DOMAINS))
    ap.add_argument("--n", type=int, default=3, help="prompts per domain")
    ap.add_argument("--tokens", type=int, default=192, help="new tokens per call")
    ap.add_argument("--trials", type=int, default=2, help="timed passes per side (after one warm-up pass)")
    ap.add_argument("--caps", default="2,4,7", help="the peer's --max-draft values")
    ap.add_argument(
        "--ours-bits",
        default="default,16",
        help="our DSpark rows, by drafter bits: default (as the CLI), 4, 8, 16; hostdraft: default bits with "
        "the compiled drafts read back before the verify (two syncs a round, as before); noahead: default bits, "
        "the next block drafted after the accept point is read back",
    )
    ap.add_argument("--work", default="/tmp/bench_peer", help="converted target/drafter, peer site, per-side JSON")
    ap.add_argument("--peer-wheels", default=str(WHEELS), help="folder of the wheels listed in the header")
    ap.add_argument("--peer-python", default=sys.executable, help="the interpreter of the peer's process")
    ap.add_argument("--budget-s", type=float, default=480, help="stop timed passes when this is spent (whole run)")
    ap.add_argument("--out", help="append the markdown report here")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument(
        "--no-peer", action="store_true", help="ours against mlx-lm only: the peer is neither installed nor run"
    )
    args = ap.parse_args()
    t0 = time.time()
    work = Path(args.work).resolve()
    (work / "peer_home").mkdir(parents=True, exist_ok=True)
    site, deps = work / "peer_site", work / "peer_deps"
    prompts = read_prompts(Path(args.eval_dir), args.domains, args.n)
    paths = {"peer_site": str(site), "peer_deps": str(deps)}
    if not args.no_peer:
        install_peer(Path(args.peer_wheels), site, deps, args.peer_python)
        check = run_child("check", paths, work, args.peer_python, "peer")  # fails here, before any timing
        say(f"peer {check['version']} imports from {check['file']}; around it: {json.dumps(check['packages'])}")
    model = args.model or os.environ.get("MLX_DSPARK_DEMO_GGUF")
    base = {"work": str(work), "model": model, "drafter": str(Path(args.drafter).resolve()), "dtype": args.dtype}
    prep = run_child("prep", base, work, sys.executable, "ours")
    job = {**base, **{k: prep[k] for k in ("target_dir", "drafter_dir")}, "prompts": prompts, "tokens": args.tokens,
           "trials": args.trials, "caps": [int(c) for c in args.caps.split(",")], **paths,
           "ours_bits": args.ours_bits.split(",")}  # fmt: skip
    # the time left, shared by the sides in proportion to their modes (ref 1, ours 1+bits, peer 1+caps)
    weights = {"ref": 1, "ours": 1 + len(job["ours_bits"]), "peer": 0 if args.no_peer else 1 + len(job["caps"])}
    left = lambda: args.budget_s - (time.time() - t0)  # noqa: E731
    job["deadline"] = time.time() + left() * weights["ref"] / sum(weights.values())
    ref = run_child("ref", job, work, sys.executable, "ref")
    for p, ids in zip(prompts, ref["prompt_ids"]):
        p["ids"] = ids
    job["prompts"] = prompts
    job["deadline"] = time.time() + left() * weights["ours"] / (weights["ours"] + weights["peer"])
    ours = run_child("ours", job, work, sys.executable, "ours")
    job["deadline"] = time.time() + left()
    peer = None
    if not args.no_peer:
        # ours against mlx-lm first, on its own: the peer's first pass (its one-time calibrations)
        # took minutes on an H100, and a device call cut before the end keeps this much
        early, _ = report(args, prep, ref, ours, None, [{k: v for k, v in p.items() if k != "ids"} for p in prompts])
        print(early, flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).with_suffix(".before-peer.md").write_text(early)
        peer = run_child("peer", job, work, args.peer_python, "peer")
        peer["packages"] = check["packages"]
    text, record = report(args, prep, ref, ours, peer, [{k: v for k, v in p.items() if k != "ids"} for p in prompts])
    text += f"\n(whole run {time.time() - t0:.0f}s)\n"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            f.write(text)
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
