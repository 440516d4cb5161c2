"""Where a batched plain step's time goes, per row count: the host's Python against MLX's evaluation.

  python bench/profile_batch_step.py [--model GGUF] [--dtype bfloat16] [--rows 1,4,8] [--steps 48] [--top 18]
                                      [--mode baseline|dspark|auto] [--out F.md]

Issue 18's bar (B = 4 batched baseline >= 2.5x serial on the H200) asks a step of 4 rows to cost
at most 1.6 steps of one. For each row count B: B generations of the same chat prompts in
baseline mode, prefilled, then `--steps` steps of decode/batch.step_rows timed after a warm-up
(B = 1 is the solo pipelined step). Per B: ms per step and per token (best of two runs), then a
cProfile of a third run: the functions with the most own time (the host's Python, by where it
went) and the own time of the steps' finishes (loop.py's _finish_*), which holds MLX's evaluation
of the step: its C++ launches of every kernel and the wait for the device (MLX's calls are
nanobind functions, invisible to cProfile; it cannot split the two). Output and ids are never
compared here (bench_batch.py does): this only times.

`--mode dspark` steps DSpark generations instead (the demo drafter's full block every round):
each step is a batched round, and ms a token counts the tokens the rows committed. `--mode auto`
steps auto generations (--max-draft auto) under a batch draft gate, as `serve` does; the gate's
choices are printed.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import _package  # noqa: F401  (the installed mlx_dspark, else python/)

PROMPTS = (
    "Explain in a few sentences why the sky is blue.",
    "Give me three tips for sleeping better, one sentence each.",
    "What is the difference between a virus and a bacterium?",
    "Describe a quiet morning in a small coastal town.",
    "Write a short note thanking a colleague for their help.",
    "What are the main causes of inflation?",
    "Summarize the plot of a heist story in four sentences.",
    "How do plants make their food?",
)


def _gen(target, tok, i: int, tokens: int, mode: str, drafter):
    """A prefilled generation of prompt i in `mode` (its prefill run here, untimed)."""
    import mlx_dspark as md
    from mlx_dspark.api import start

    ids = md.encode_prompt(tok, PROMPTS[i % len(PROMPTS)])
    extra = {"max_draft": "auto"} if mode == "auto" else {}
    g = start(target, tok, None, prompt_ids=ids, max_new_tokens=tokens, mode=mode, drafter=drafter, **extra).generation
    g.step()
    return g


def _run(target, tok, rows: int, steps: int, warm: int, profile, mode="baseline", drafter=None, gate=None):
    """(seconds of `steps` timed step_rows calls over `rows` rows, the tokens they committed, and
    with a draft gate the timed steps by its choice: {kind: [seconds, tokens, steps]}); a row whose
    answer ends is replaced by a fresh prefilled one between steps, untimed (and unprofiled)."""
    from mlx_dspark.decode import batch

    n = 0
    gens = [_gen(target, tok, (n := n + 1), 256, mode, drafter) for _ in range(rows)]
    total, tokens = 0.0, 0
    kinds: dict[str, list] = {}
    last = None
    for k in range(warm + steps):
        for j, g in enumerate(gens):
            if g.done:
                gens[j] = _gen(target, tok, (n := n + 1), 256, mode, drafter)
        timed = k >= warm
        if timed and profile is not None:
            profile.enable()
        before = dict(gate.steps) if gate is not None else None
        t0 = time.perf_counter()
        commits = batch.step_rows(gens, gate)
        dt = time.perf_counter() - t0
        if timed and profile is not None:
            profile.disable()
        got = sum(len(c.tokens) for c in commits)
        if timed:
            total += dt
            tokens += got
        if gate is not None:
            drafts = gate.steps[True] != before[True]
            kind = ("drafts" if drafts else "plain") + (" (first after a switch)" if last not in (None, drafts) else "")
            last = drafts
            if timed:
                acc = kinds.setdefault(kind, [0.0, 0, 0])
                acc[0], acc[1], acc[2] = acc[0] + dt, acc[1] + got, acc[2] + 1
    return total, tokens, kinds


def _top(profile: cProfile.Profile, steps: int, n: int) -> tuple[list[str], float]:
    """The functions with the most own time, µs per step; and the own time of the steps' finishes
    (loop.py's _finish_*), µs per step: MLX's evaluation (kernel launches) and the wait for the
    device, since MLX's calls (async_eval, item) are invisible to cProfile."""
    s = io.StringIO()
    st = pstats.Stats(profile, stream=s)
    rows, wait = [], 0.0
    for (file, line, name), (_, calls, own, cum, _) in st.stats.items():
        where = f"{file.rsplit('/', 1)[-1]}:{line}({name})" if line else name
        rows.append((own, cum, calls, where))
        if file.endswith("loop.py") and name.startswith("_finish"):
            wait += own
    rows.sort(reverse=True)
    lines = [
        f"| {where} | {own / steps * 1e6:.0f} | {cum / steps * 1e6:.0f} | {calls / steps:.1f} |"
        for own, cum, calls, where in rows[:n]
    ]
    return lines, wait / steps * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--warm", type=int, default=8)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--mode", default="baseline", choices=("baseline", "dspark", "auto"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from mlx_dspark import benchmark as bm
    from mlx_dspark.benchmark import device_stamp
    from mlx_dspark.decode import batch

    model, target, tok = bm.load_bench_target(args.model, args.dtype)
    drafter = None
    if args.mode != "baseline":
        from mlx_dspark.api import drafter_for

        drafter = drafter_for(target, args.mode)
    out = [
        f"## profile_batch_step: {model} ({args.dtype or 'default dtype'}); {device_stamp()}",
        f"decode path {target.invariance}; compiled rows: {getattr(target, 'compiled_decode', None) is not None}; "
        f"{args.steps} timed steps after {args.warm}, {args.mode} mode",
        "",
    ]
    solo = None
    for rows in [int(x) for x in args.rows.split(",")]:
        gates = [batch.DraftGate() if args.mode == "auto" else None for _ in range(3)]
        runs = [_run(target, tok, rows, args.steps, args.warm, None, args.mode, drafter, gates[i]) for i in range(2)]
        plain, tokens, kinds = min(runs, key=lambda r: r[0])
        prof = cProfile.Profile()
        profiled, _, _ = _run(target, tok, rows, args.steps, args.warm, prof, args.mode, drafter, gates[2])
        ms, ms_token = plain / args.steps * 1e3, plain / max(tokens, 1) * 1e3
        solo = solo if solo is not None else ((ms, ms_token) if rows == 1 else None)
        top, wait = _top(prof, args.steps, args.top)
        vs = f"; {ms / solo[0]:.2f}x the B = 1 step ({solo[1] / ms_token:.2f}x its throughput)" if solo else ""
        section = len(out)
        out += [
            f"### B = {rows}: {ms:.2f} ms a step, {ms_token:.2f} ms a token, {tokens / args.steps:.2f} tokens a step "
            f"(best of 2){vs}",
            f"profiled: {profiled / args.steps * 1e3:.2f} ms a step; the finishes' own time (MLX's evaluation: "
            f"its kernel launches and the wait for the device): {wait / 1e3:.2f} ms a step",
            *(
                [f"draft gate (steps with drafts allowed / plain), per run: {[tuple(g.steps.values()) for g in gates]}"]
                + [
                    f"  {kind}: {n} steps, {sec / n * 1e3:.2f} ms a step, {sec / max(got, 1) * 1e3:.2f} ms a token"
                    for kind, (sec, got, n) in sorted(kinds.items())  # the faster run's steps
                ]
                if args.mode == "auto"
                else []
            ),
            "",
            "| function | own µs/step | cumulative µs/step | calls/step |",
            "|---|---:|---:|---:|",
            *top,
            "",
        ]
        print("\n".join(out[section:]), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
