"""Where a decode round's time goes, per mode, in the product's real Generation (decode/loop.py).

  python bench/profile_round.py [--model M] [--precision bf16|8|4|f32] [--prompts DIR] [--n 5]
         [--tokens 128] [--modes baseline,lookup,dspark,dspark-nolookup,dspark-noahead] [--max-draft N|auto]
         [--drafter-bits 4|8|16] [--confidence-threshold T] [--out FILE.md]

Each prompt runs, per mode, through mlx_dspark.api.start() (the Generation every entry point
steps), three times: (1) warm-up, with the graph of each drafter pass and of the first verify
forward at each width exported (mx.export_to_dot) to count its ops, a proxy for kernel launches;
(2) timed, every step broken into phases by wall-clock timers wrapped around the product's own
methods (this script monkeypatches instances and restores them; the product is unchanged, and no
timer syncs: the only syncs are the product's own); (3) bare, no wrapper at all, for the wrappers'
overhead and to check that every mode's tokens equal baseline's. A timer's time is exclusive
(nested timed calls are subtracted), so the phases add up to the step:

  1 decide        Generation.plan_begin, proposer.wants_round / _prepare, the lookup index
                  (NgramIndex.sync + match, also shown alone), LookupProposer.propose: host only
  2 draft build   drafter.block_hidden + proposer._sample (backbone, lm_head, Markov chain), or
                  the compiled greedy pass (proposer._compiled_sample: models/compiled_draft.py): lazy
  3 draft eval    the rest of DrafterProposer.propose (its mx.eval of the block) + _drafted (the
                  .tolist() of the drafts, the truncation), context ingest chunks; ~0 where the
                  compiled drafts stay on the device (their pass then ends inside phase 5's sync)
  4 verify build  plan_draft (the block as an mx.array) + target.forward (lazy)
  5 verify eval   the acceptor's verify (greedy_accept + its mx.eval + .item()); a plain step's
                  _finish_plain (lazy sample, async_eval, .item() of the pending token); the
                  .item() of a pending token that plan_begin reads before a round
  6 commit        _commit (history, stop checks, detokenizer), _trim, _fed, proposer.observe,
                  _finish_round / _finish_sync and the step's own residue

Counts per mode: steps by kind (drafter round, lookup round, pipelined plain step, synchronous
plain step), tokens per step, host syncs per step (mx.eval calls + pending .item() reads), the
verify width histogram, drafter passes and ingest chunks, graph ops per drafter pass and per verify
width. mlx_lm's own generate_step is timed per token on the same prompts for reference.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import re
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import _package  # the installed mlx_dspark, else python/; the precision loader
from bench_invariance import FILES

PHASES = ("1 decide", "2 draft build", "3 draft eval", "4 verify build", "5 verify eval+accept", "6 commit")
PHASE_OF = {
    "plan_begin": 0,
    "wants_round": 0,
    "prepare": 0,
    "lookup index": 0,
    "lookup propose": 0,
    "block_hidden": 1,
    "sample": 1,
    "compiled pass": 1,
    "propose eval": 2,
    "drafted": 2,
    "ingest": 2,
    "plan_draft": 3,
    "forward": 3,
    "accept": 4,
    "pending read": 4,
    "finish_plain": 4,
    "finish_round": 5,
    "finish_sync": 5,
    "observe": 5,
    "commit": 5,
    "step": 5,
}
KINDS = ("drafter round", "lookup round", "plain (pipelined)", "plain (sync)", "end")
# Graph nodes that are views on every backend (no kernel of their own, as a rule).
VIEW_OPS = {"Reshape", "Broadcast", "Slice", "Transpose", "ExpandDims", "Squeeze", "AsStrided", "StopGradient"}


def pick_prompts(folder: Path, n: int, files: list[str]) -> list[tuple[str, str]]:
    """n first turns, round-robin over the eval files (row 0 of each, then row 1, ...)."""
    import json

    rows = {f: [json.loads(x) for x in (folder / f"{f}.jsonl").read_text().splitlines() if x.strip()] for f in files}
    out: list[tuple[str, str]] = []
    i = 0
    while len(out) < n and any(i < len(r) for r in rows.values()):
        out += [(f"{f}[{i}]", rows[f][i]["turns"][0]) for f in files if i < len(rows[f])]
        i += 1
    return out[:n]


def graph_ops(arrays) -> Counter:
    """Primitive nodes of the lazy graph behind `arrays`, by name (already evaluated inputs end it)."""
    import mlx.core as mx

    f = io.StringIO()
    try:
        mx.export_to_dot(f, *[a for a in arrays if a is not None])
    except Exception as e:  # an MLX without export_to_dot, a primitive it cannot print
        return Counter({f"<export failed: {type(e).__name__}>": 0})
    return Counter(re.findall(r'\[label ="([^"]+)", shape=rectangle\]', f.getvalue()))


def launches(c: Counter) -> tuple[int, int]:
    """(graph ops, of them not views)."""
    return sum(c.values()), sum(n for k, n in c.items() if k not in VIEW_OPS)


class Profiler:
    """Exclusive wall-clock timers around methods, and per-step records. Nothing here syncs."""

    def __init__(self, count_ops: bool):
        self.count_ops = count_ops
        self.stack: list[list[float]] = []  # [start, child time]
        self.rec: dict | None = None  # the step being timed
        self.steps: list[dict] = []
        self.undo: list = []
        self.drafter_ops: list[tuple[Counter, Counter]] = []
        self.verify_ops: dict[int, Counter] = {}

    def enter(self) -> None:
        self.stack.append([time.perf_counter(), 0.0])

    def leave(self, label: str) -> None:
        start, child = self.stack.pop()
        dt = time.perf_counter() - start
        if self.stack:
            self.stack[-1][1] += dt
        if self.rec is not None:
            self.rec["t"][label] += dt - child

    def patch(self, obj, name: str, wrapper) -> None:
        had = name in vars(obj) if not isinstance(obj, type) else name in obj.__dict__
        old = vars(obj)[name] if had else None
        self.undo.append((obj, name, had, old))
        setattr(obj, name, wrapper)

    def wrap(self, obj, name: str, label, after=None) -> None:
        """obj.name timed under `label` (a str, or label(result) -> str); after(result) runs untimed."""
        fn = getattr(obj, name)

        def timed(*a, **k):
            self.enter()
            try:
                out = fn(*a, **k)
            except BaseException:
                self.leave(label if isinstance(label, str) else "step")
                raise
            self.leave(label if isinstance(label, str) else label(out))
            if after is not None:
                after(out, *a)
            return out

        self.patch(obj, name, timed)

    def restore(self) -> None:
        for obj, name, had, old in reversed(self.undo):
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
        self.undo = []

    def note(self, key: str, n: int = 1) -> None:
        if self.rec is not None:
            self.rec[key] = self.rec.get(key, 0) + n


def instrument(prof: Profiler, g, target) -> None:
    """Wrap the methods one Generation's steps go through (instances; NgramIndex and mx.eval for
    the duration)."""
    import mlx.core as mx

    from mlx_dspark.decode.drafting import DrafterProposer
    from mlx_dspark.decode.lookup import NgramIndex

    p = g.proposer
    drafting = isinstance(p, DrafterProposer)

    real_step = g.step

    def step():
        if not g.prefilled:
            return real_step()  # prefill: not a decode step
        prof.rec = {"t": defaultdict(float), "widths": [], "syncs": 0, "kind": None}
        prof.enter()
        try:
            commit = real_step()
        finally:
            prof.leave("step")
            rec, prof.rec = prof.rec, None
        rec["tokens"] = len(commit.tokens)
        if rec["kind"] is None:
            wide = [w for w in rec["widths"] if w > 1]
            if rec.get("drafter passes"):
                rec["kind"] = "drafter round"
            elif wide:
                rec["kind"] = "lookup round"
            elif rec["widths"]:
                rec["kind"] = "plain (sync)"
            else:
                rec["kind"] = "end"
        prof.steps.append(rec)
        return commit

    prof.patch(g, "step", step)

    real_plan_begin = g.plan_begin

    def plan_begin():
        had = g.pending is not None
        prof.enter()
        try:
            out = real_plan_begin()
        finally:
            read = had and g.pending is None
            if read and prof.rec is not None:
                prof.rec["syncs"] += 1  # its .item() of the pending token
                prof.rec["pending reads"] = 1
            prof.leave("pending read" if read else "plan_begin")
        return out

    prof.patch(g, "plan_begin", plan_begin)
    prof.wrap(g, "plan_draft", "plan_draft")
    prof.wrap(g, "_finish_round", "finish_round")
    prof.wrap(g, "_finish_sync", "finish_sync")
    prof.wrap(g, "_commit", "commit")

    def plain_done(out, *a):
        if prof.rec is not None:
            prof.rec["syncs"] += 1  # its .item() of the pending token
            prof.rec["kind"] = "plain (pipelined)"

    prof.wrap(g, "_finish_plain", "finish_plain", after=plain_done)
    prof.wrap(g.acceptor, "verify", "accept")

    real_forward = target.forward

    def forward(tokens, cache, taps=(), last_only=False):
        prof.enter()
        try:
            out = real_forward(tokens, cache, taps=taps, last_only=last_only)
        finally:
            prof.leave("forward")
        if prof.rec is not None:
            w = int(tokens.shape[-1])
            prof.rec["widths"].append(w)
            if prof.count_ops and w not in prof.verify_ops:
                prof.verify_ops[w] = graph_ops([out.logits, out.hidden])
        return out

    prof.patch(target, "forward", forward)

    prof.wrap(p, "wants_round", "wants_round")
    prof.wrap(NgramIndex, "sync", "lookup index")
    prof.wrap(NgramIndex, "match", "lookup index")
    if drafting:
        prof.wrap(p, "propose", "propose eval")
        prof.wrap(p, "_prepare", "prepare")
        prof.wrap(p, "_drafted", "drafted")
        prof.wrap(p, "observe", "observe")
        prof.wrap(p, "_ingest_pending", "ingest", after=lambda out, *a: prof.note("ingest chunks"))

        def sampled(lazy, *a):
            prof.note("drafter passes")
            if prof.count_ops and len(prof.drafter_ops) < 4:  # (the whole pass, its backbone)
                prof.drafter_ops.append((graph_ops(lazy[3]), graph_ops([a[1]])))

        def compiled_pass():
            prof.note("drafter passes")
            prof.note("compiled passes")

        prof.wrap(p, "_sample", "sample", after=sampled)
        prof.wrap(p.drafter, "block_hidden", "block_hidden")
        prof.wrap(  # the drafter's compiled greedy pass (models/compiled_draft.py), where it runs
            p, "_compiled_sample", "compiled pass", after=lambda out, *a: out is not None and compiled_pass()
        )
    else:
        prof.wrap(p, "propose", "lookup propose")
        prof.wrap(p, "observe", "observe")

    real_eval = mx.eval

    def counted_eval(*a, **k):
        prof.note("syncs")
        return real_eval(*a, **k)

    prof.patch(mx, "eval", counted_eval)


def generation(md, target, tok, ids, mode, drafters, args):
    kw = {"confidence_threshold": args.confidence_threshold} if mode.startswith("dspark") else {}
    if args.max_draft is not None:
        kw["max_draft"] = "auto" if args.max_draft == "auto" else int(args.max_draft)
    name = mode
    if mode == "dspark-nolookup":
        name, kw = "dspark", {**kw, "lookup_drafts": False}
    if mode == "dspark-noahead":  # the next block drafted after the accept point is read back
        name = "dspark"
    from mlx_dspark.api import start
    from mlx_dspark.decode.drafting import DrafterProposer

    DrafterProposer.draft_ahead = mode != "dspark-noahead"

    return start(
        target, tok, None, prompt_ids=ids, mode=name, drafter=drafters.get(name), max_new_tokens=args.tokens, **kw
    )


def run_one(md, target, tok, ids, mode, drafters, args, prof: Profiler | None):
    tg = generation(md, target, tok, ids, mode, drafters, args)
    if prof is None:
        return tg.run(), None
    instrument(prof, tg.generation, target)
    try:
        res = tg.run()
    finally:
        prof.restore()
    return res, tg.generation.res.decode_s


def ms(x: float) -> str:
    return f"{x * 1e3:.3f}"


def mode_report(mode: str, data: dict, base_tps: float, ref_ms: float | None) -> list[str]:
    steps = data["steps"]
    tokens = sum(s["tokens"] for s in steps)
    n_prompts = data["prompts"]
    lines = [f"### {mode}", ""]
    if not steps:
        return lines + ["(no decode steps)", ""]
    tps = data["tps"]
    vs = f", x{tps / base_tps:.3f} baseline" if base_tps else ""
    vs += f", x{tps * ref_ms / 1e3:.3f} mlx_lm" if ref_ms else ""
    inst = sum(data["decode_s"])
    bare = sum(data["bare_decode_s"])
    lines.append(
        f"{len(steps)} decode steps over {n_prompts} prompts, {tokens} tokens ({tokens / len(steps):.2f} per step); "
        f"bare decode {tps:.1f} tok/s{vs}; the timers' overhead: instrumented decode {inst:.3f} s vs bare "
        f"{bare:.3f} s (x{inst / max(bare, 1e-9):.3f}); tokens identical to baseline: {data['same']} of {n_prompts}"
    )
    lines += ["", "ms (and host syncs) per step, by step kind; the last row per committed token:", ""]
    lines.append("| step kind | n | tokens/step | syncs | " + " | ".join(PHASES) + " | sum |")
    lines.append("|---|---:|---:|---:|" + "---:|" * (len(PHASES) + 1))

    def phases(group):
        tot = [0.0] * len(PHASES)
        for s in group:
            for label, t in s["t"].items():
                tot[PHASE_OF[label]] += t
        return tot

    def row(name, group, per):
        ph = phases(group)
        toks = sum(s["tokens"] for s in group)
        sy = sum(s["syncs"] for s in group)
        d = per(group)
        cells = [ms(x / d) for x in ph] + [ms(sum(ph) / d)]
        return f"| {name} | {len(group)} | {toks / len(group):.2f} | {sy / d:.2f} | " + " | ".join(cells) + " |"

    by = defaultdict(list)
    for s in steps:
        by[s["kind"]].append(s)
    for k in KINDS:
        if by[k]:
            lines.append(row(k, by[k], len))
    lines.append(row("**all steps, per step**", steps, len))
    lines.append(row("**all steps, per token**", steps, lambda g: max(sum(s["tokens"] for s in g), 1)))
    idx = sum(s["t"].get("lookup index", 0.0) for s in steps)
    lines += [
        "",
        "- step kinds: "
        + ", ".join(f"{k} {100 * len(by[k]) / len(steps):.0f}%" for k in KINDS if by[k])
        + f"; of phase 1, the lookup index (NgramIndex.sync + match): {ms(idx / len(steps))} ms per step",
    ]
    widths = Counter(w for s in steps for w in s["widths"])
    lines.append("- verify widths (forwards per width): " + ", ".join(f"w{w}: {n}" for w, n in sorted(widths.items())))
    for k in ("drafter round", "lookup round"):
        if by[k]:
            wk = Counter(w for s in by[k] for w in s["widths"])
            lines.append(f"  in {k}s: " + ", ".join(f"w{w}: {n}" for w, n in sorted(wk.items())))
    for k in ("drafter round", "lookup round"):
        if by[k]:
            acc = Counter(s["tokens"] for s in by[k])
            lines.append(
                f"- {k}s: committed tokens per round " + ", ".join(f"{t}: {n}" for t, n in sorted(acc.items()))
            )
    passes = sum(s.get("drafter passes", 0) for s in steps)
    if passes:
        chunks = sum(s.get("ingest chunks", 0) for s in steps)
        compiled = sum(s.get("compiled passes", 0) for s in steps)
        lines.append(
            f"- drafter passes: {passes} ({passes / len(steps):.2f} per step; {compiled} compiled), "
            f"context ingest chunks {chunks}"
        )
    if data["drafter_ops"]:
        whole, backbone = data["drafter_ops"][-1]
        head = whole - backbone
        (n, nv), (nb, nbv), (nh, nhv) = launches(whole), launches(backbone), launches(head)
        lines.append(
            f"- graph ops per drafter pass, exported before its eval (not views in brackets): {n} ({nv}) = "
            f"context fusion + backbone {nb} ({nbv}) + lm_head, Markov chain and token stack {nh} ({nhv})"
        )
        lines.append("  backbone's most common: " + ", ".join(f"{k} {c}" for k, c in backbone.most_common(8)))
        lines.append("  head + Markov's most common: " + ", ".join(f"{k} {c}" for k, c in head.most_common(8)))
    wide = defaultdict(list)
    for s in steps:
        if s["widths"] and s["kind"] != "end":
            wide[(max(s["widths"]), s["kind"])].append(s)
    if len(wide) > 1:
        lines += ["", "| verify width | step kind | n | tokens/step | 4 verify build | 5 verify eval+accept | step |"]
        lines.append("|---:|---|---:|---:|---:|---:|---:|")
        for (w, k), group in sorted(wide.items()):
            ph = phases(group)
            toks = sum(s["tokens"] for s in group) / len(group)
            lines.append(
                f"| {w} | {k} | {len(group)} | {toks:.2f} | {ms(ph[3] / len(group))} | {ms(ph[4] / len(group))} "
                f"| {ms(sum(ph) / len(group))} |"
            )
        lines.append("")
    if data["verify_ops"]:
        parts = [f"w{w}: {launches(c)[0]} ({launches(c)[1]})" for w, c in sorted(data["verify_ops"].items())]
        lines.append("- graph ops per target forward (not views in brackets): " + ", ".join(parts))
        first = data["verify_ops"][min(data["verify_ops"])]
        lines.append("  most common at the narrowest: " + ", ".join(f"{k} {n}" for k, n in first.most_common(8)))
    return lines + [""]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="default: the demo model")
    ap.add_argument("--precision", default="bf16", choices=_package.PRECISIONS)
    ap.add_argument("--prompts", default="/work/shared/data/prompts/eval")
    ap.add_argument("--n", type=int, default=5, help="eval prompts (first rows of each file, in turn)")
    ap.add_argument("--files", default=",".join(FILES), help="the eval files to take prompts from, in turn")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--modes", default="baseline,lookup,dspark,dspark-nolookup")
    ap.add_argument("--max-draft", default=None, help="unset = the Python API's default (full block), auto, or N")
    ap.add_argument("--drafter-bits", type=int, default=None, help="default: the product's default")
    ap.add_argument("--confidence-threshold", type=float, default=0.0)
    ap.add_argument("--no-mlx-lm", action="store_true", help="skip the mlx_lm reference")
    ap.add_argument(
        "--budget-s", type=float, default=None, help="start no new prompt after this many seconds (report what ran)"
    )
    ap.add_argument("--out")
    args = ap.parse_args()

    import mlx.core as mx

    import mlx_dspark as md
    from mlx_dspark import benchmark as bm
    from mlx_dspark.api import drafter_for
    from mlx_dspark.kernels import invariant, invariant_linear
    from mlx_dspark.models import invariance

    t0 = time.perf_counter()
    target, tok, model = _package.load_precision(args.model, args.precision)
    modes = [m for m in args.modes.split(",") if m]
    if "baseline" not in modes:
        modes.insert(0, "baseline")
    drafters = {}
    if any(m.startswith("dspark") for m in modes):
        drafters["dspark"] = drafter_for(target, "dspark", None, bits=args.drafter_bits)
    load_s = time.perf_counter() - t0
    prompts = pick_prompts(Path(args.prompts), args.n, [f for f in args.files.split(",") if f])

    path = invariance.path_of(target)
    attention = invariant.attention_path() if path != "native" else "MLX's own"
    linears = invariant_linear.linear_path() if path == "kernels" else "MLX's own"
    try:
        from mlx_dspark.blas import loaded_blas

        blas = loaded_blas() or "bundled"
    except Exception:
        blas = "?"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    d = drafters.get("dspark")
    dinfo = f"; drafter {d.source} {d.bits}-bit, block {d.block_drafts}" if d is not None else ""
    head = [
        f"## Round profile: {Path(model).name} {args.precision}, {len(prompts)} eval prompts x {args.tokens} tokens "
        f"greedy, max draft {args.max_draft or 'the API default (full block; lookup drafts up to 32)'}",
        "",
        f"`{' '.join(sys.argv)}` at {time.strftime('%Y-%m-%d %H:%M %Z')}",
        f"machine: {bm.device_stamp()}; {platform.node()}, {os.cpu_count()} cores, load average {load:.1f} at start; "
        f"BLAS {blas}; LD_PRELOAD={os.environ.get('LD_PRELOAD', '')}",
        f"target path: invariance={target.invariance} (decode path {path}), linears={linears}, attention={attention}"
        f"{dinfo}; load {load_s:.1f} s",
        "",
    ]
    print("\n".join(head), flush=True)

    data = {
        m: {
            "steps": [],
            "prompts": 0,
            "decode_s": [],
            "bare_decode_s": [],
            "bare_tokens": 0,
            "same": 0,
            "drafter_ops": [],
            "verify_ops": {},
        }
        for m in modes
    }
    ref = []
    done = 0
    for i, (label, text) in enumerate(prompts):
        if args.budget_s is not None and time.perf_counter() - t0 > args.budget_s:
            print(f"  --budget-s {args.budget_s:g} spent: {i} of {len(prompts)} prompts ran", flush=True)
            break
        done += 1
        ids = md.encode_prompt(tok, text)
        base_tokens = None
        for m in modes:
            print(f"  [{i + 1}/{len(prompts)}] {label} ({len(ids)} prompt tokens): {m}", file=sys.stderr, flush=True)
            dm = data[m]
            warm = Profiler(count_ops=True)
            run_one(md, target, tok, ids, m, drafters, args, warm)
            if not dm["drafter_ops"]:
                dm["drafter_ops"] = warm.drafter_ops
            for w, c in warm.verify_ops.items():
                dm["verify_ops"].setdefault(w, c)
            prof = Profiler(count_ops=False)
            res, dec = run_one(md, target, tok, ids, m, drafters, args, prof)
            dm["steps"] += prof.steps
            dm["decode_s"].append(dec)
            bare, _ = run_one(md, target, tok, ids, m, drafters, args, None)
            dm["bare_decode_s"].append(bare.decode_s)
            dm["bare_tokens"] += max(len(bare.tokens) - 1, 0)
            dm["prompts"] += 1
            if m == "baseline":
                base_tokens = bare.tokens
            same = bare.tokens == base_tokens and res.tokens == base_tokens
            dm["same"] += int(same)
            if not same:
                print(f"  {m}: tokens DIFFER from baseline on {label}", flush=True)
        if not args.no_mlx_lm:
            bm.mlx_lm_decode(target, ids, min(args.tokens, 8))  # warm
            r = bm.mlx_lm_decode(target, ids, args.tokens)
            if r.decode_tps > 0:
                ref.append(1e3 / r.decode_tps)
        mx.clear_cache()

    for m in modes:  # bare tok/s, timed as the product does (decode_s: after the prefill)
        dm = data[m]
        dm["tps"] = dm["bare_tokens"] / max(sum(dm["bare_decode_s"]), 1e-9)
    ref_ms = statistics.mean(ref) if ref else None
    base_tps = data["baseline"]["tps"]
    lines = list(head)
    if done < len(prompts):
        lines += [f"(--budget-s {args.budget_s:g}: {done} of {len(prompts)} prompts ran)", ""]
    lines.append("### summary: ms per committed token (timed run), by phase")
    lines.append("")
    lines.append("| mode | tok/s (bare) | x baseline | tokens/step | syncs/token | " + " | ".join(PHASES) + " | sum |")
    lines.append("|---|---:|---:|---:|---:|" + "---:|" * (len(PHASES) + 1))
    for m in modes:
        steps = data[m]["steps"]
        toks = max(sum(s["tokens"] for s in steps), 1)
        ph = [0.0] * len(PHASES)
        for s in steps:
            for label, t in s["t"].items():
                ph[PHASE_OF[label]] += t
        syncs = sum(s["syncs"] for s in steps)
        lines.append(
            f"| {m} | {data[m]['tps']:.1f} | {data[m]['tps'] / max(base_tps, 1e-9):.3f} | "
            f"{toks / max(len(steps), 1):.2f} | {syncs / toks:.2f} | "
            + " | ".join(ms(x / toks) for x in ph)
            + f" | {ms(sum(ph) / toks)} |"
        )
    if ref_ms:
        lines += [
            "",
            f"mlx_lm generate_step (target.model, MLX's own ops, greedy): {ref_ms:.3f} ms per token "
            f"({1e3 / ref_ms:.1f} tok/s), mean over {len(ref)} prompts, after the first token",
        ]
    lines.append("")
    for m in modes:
        lines += mode_report(m, data[m], base_tps if m != "baseline" else 0.0, ref_ms)
    bm.emit("\n".join(lines), args.out)
    return 0 if all(data[m]["same"] == data[m]["prompts"] for m in modes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
