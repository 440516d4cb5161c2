"""Each mode on bench_batch.py's prompts, run directly and through a serial serve engine.

  python bench/diag_engine_modes.py [--model GGUF] [--dtype bfloat16] [--tokens 128] [--reps 2]
                                    [--modes baseline,dspark,auto] [--prompts 8]

On the H100 (bench/results/batch-h200.md, thirtieth session) the serial auto engine ran at
0.67-0.96x the serial baseline engine over bench_batch.py's first 1-8 prompts, below the serial
DSpark engine (the full block every round, 0.78-1.29x) everywhere. This separates the two
candidates: the prompts (auto is below the full block on chat in direct generation too,
diag_auto_steps.py), or the engine. Per mode and prompt, after one untimed pass of every prompt:
decode tok/s of a direct generation (api.start, stepped to its end) and of the same request
through serve/engine.py's Engine with --max-batch 1 (decode tok/s from its result; wall tok/s
from submit to delivery), best of `--reps`, with the rounds, tokens a round and plain steps of
the last direct run. Ratios are to baseline's of the same path. Every mode's ids and text equal
baseline's on both paths (checked).
"""

from __future__ import annotations

import argparse
import statistics

import _package  # noqa: F401  (the installed mlx_dspark, else python/)
from bench_batch import PROMPTS, _engine, _run

from mlx_dspark.benchmark import device_stamp, load_bench_target


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--modes", default="baseline,dspark,auto")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    args = ap.parse_args()
    from mlx_dspark.api import drafter_for, encode_prompt, start

    model, target, tok = load_bench_target(args.model, args.dtype)
    modes = args.modes.split(",")
    if modes[0] != "baseline":
        raise SystemExit("--modes must start with baseline (the ratios' reference)")
    drafters = {m: drafter_for(target, m) if m in ("dspark", "auto") else None for m in modes}
    engines = {m: _engine(target, tok, m, drafters[m], 1) for m in modes}
    prompts = [encode_prompt(tok, p) for p in PROMPTS[: args.prompts]]

    def direct(mode, ids):
        kw = {"mode": mode, "drafter": drafters[mode]}
        if mode == "auto":
            kw["max_draft"] = "auto"
        g = start(target, tok, None, prompt_ids=ids, max_new_tokens=args.tokens, **kw).generation
        text = []
        while not g.done:
            text.append(g.step().text)
        return g.res.decode_s, g.res, "".join(text)

    def served(mode, ids):
        wall, _, jobs = _run(engines[mode], [ids], args.tokens)
        return wall, jobs[0].outcome.result

    print(f"## diag_engine_modes: {model} ({args.dtype or 'default dtype'}); {device_stamp()}")
    print(
        f"{len(prompts)} prompts of bench_batch.py, {args.tokens} tokens, best of {args.reps} after one untimed pass\n"
    )
    for mode in modes:  # the untimed pass: first-use costs of every shape these prompts meet
        for ids in prompts:
            direct(mode, ids)
            served(mode, ids)
    print(
        "| prompt | mode | direct tok/s | x | engine decode tok/s | x | engine wall tok/s | x "
        "| rounds | a round | plain |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ratios: dict = {(m, p): [] for m in modes for p in ("direct", "engine", "wall")}
    for i, ids in enumerate(prompts):
        ref = {}
        base_ids = base_texts = None
        for mode in modes:
            d_best = e_best = w_best = 0.0
            for _ in range(args.reps):
                s, res, text = direct(mode, ids)
                d_best = max(d_best, len(res.tokens) / s)
                wall, eres = served(mode, ids)
                e_best = max(e_best, eres.decode_tps)
                w_best = max(w_best, len(eres.tokens) / wall)
            if mode == "baseline":
                base_ids, base_texts = list(res.tokens), (text, eres.text)
                ref = {"d": d_best, "e": e_best, "w": w_best}
            if list(res.tokens) != base_ids or list(eres.tokens) != base_ids or (text, eres.text) != base_texts:
                raise SystemExit(f"{mode} on prompt {i + 1}: not baseline's ids and text")
            rounds = [a for a, k in zip(res.accept_lengths, res.drafted) if k > 0]  # the direct run's
            plain = sum(1 for k in res.drafted if k == 0)
            xs = (d_best / ref["d"], e_best / ref["e"], w_best / ref["w"])
            for key, x in zip(("direct", "engine", "wall"), xs):
                ratios[mode, key].append(x)
            per = f"{sum(rounds) / len(rounds):.2f}" if rounds else "-"
            print(
                f"| {i + 1} | {mode} | {d_best:.1f} | {xs[0]:.2f}x | {e_best:.1f} | {xs[1]:.2f}x | {w_best:.1f} | "
                f"{xs[2]:.2f}x | {len(rounds)} | {per} | {plain} |",
                flush=True,
            )
    print()
    for mode in modes[1:]:
        g = {k: statistics.geometric_mean(ratios[mode, k]) for k in ("direct", "engine", "wall")}
        print(
            f"{mode} / baseline, geometric mean over the prompts: direct {g['direct']:.3f}x, "
            f"engine decode {g['engine']:.3f}x, engine wall {g['wall']:.3f}x"
        )
    for eng in engines.values():
        eng.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
