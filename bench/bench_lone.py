"""A lone request on the batching engine against the serial engine, each in a process of its own.

  python bench/bench_lone.py [--model M] [--dtype float32] [--modes baseline,dspark] [--tokens 128]
                             [--procs 2] [--repeat 3] [--max-batch 4] [--control | --one-process]
                             [--budget-s S] [--out FILE.md]

Why: issue 18's bar "a lone request is no slower than today's serial path (>= 0.98x)". Inside
bench_batch.py both engines share one process and one target, and there the engine created second
read 0.90x on the CPU even when both ran the identical serial code (batch-cpu.md), while the same
engines in a small script read 1.00x. Here every process loads the target, builds ONE engine
(`--max-batch 1`: the serial path, or `--max-batch N`: the batching engine), warms it up (the same
request, untimed) and times the lone request `--repeat` times. The processes alternate
serial / batched, `--procs` of each; a side's figure is its best wall time over all its runs, and
the ratio is serial best / batched best (>= 0.98 is the bar). The answers of both engines must be
the same tokens and text. `--control` runs the serial engine in both columns (the same
alternation, separate processes): the ratio identical code reads, to judge a bar of 2% against.
`--one-process` puts both engines in one process, warmed, alternating: medians of their own cost.
On Linux CPU preload OpenBLAS (LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROMPT = "Write an essay on why sleep matters for health, with practical advice."


def child(a) -> None:
    import _package  # noqa: F401  (the installed mlx_dspark, else python/)
    from bench_batch import _run  # submit, wait for delivery: the same request path bench_batch times

    from mlx_dspark.api import drafter_for, encode_prompt
    from mlx_dspark.benchmark import load_bench_target
    from mlx_dspark.serve.engine import Engine

    _, target, tok = load_bench_target(a.model, a.dtype)
    drafter = drafter_for(target, a.mode) if a.mode in ("dspark", "dflash") else None
    eng = Engine(target, tok, mode=a.mode, drafter=drafter, max_batch=a.max_batch, max_queue=8)
    eng.start()
    eng.warmup()
    ids = encode_prompt(tok, PROMPT)

    def once():
        wall, _, jobs = _run(eng, [ids], a.tokens)
        return wall, jobs[0].outcome.result

    once()  # untimed: first-use costs of this request's shapes
    runs = [once() for _ in range(a.repeat)]
    eng.stop()
    r = runs[0][1]
    print(json.dumps({"walls": [w for w, _ in runs], "tokens": list(r.tokens), "text": r.text}))


def one_process(a) -> list[str]:
    """Both engines in ONE process, both warmed, lone requests alternating (--repeat each, per mode):
    the engines' own cost side by side, without the process-to-process spread."""
    import statistics

    import _package  # noqa: F401
    from bench_batch import _run

    from mlx_dspark.api import drafter_for, encode_prompt
    from mlx_dspark.benchmark import load_bench_target
    from mlx_dspark.serve.engine import Engine

    _, target, tok = load_bench_target(a.model, a.dtype)
    ids = encode_prompt(tok, PROMPT)
    lines = [
        "one process, both engines warmed, lone requests alternating\n",
        "| mode | serial s (median, min) | batched s (median, min) | batched / serial (median) | runs each | same |",
        "|---|---|---|---|---|---|",
    ]
    for mode in a.modes.split(","):
        drafter = drafter_for(target, mode) if mode in ("dspark", "dflash") else None
        engs = {
            mb: Engine(target, tok, mode=mode, drafter=drafter, max_batch=mb, max_queue=8) for mb in (1, a.max_batch)
        }
        for e in engs.values():
            e.start()
            e.warmup()
            _run(e, [ids], a.tokens)  # untimed: first-use costs of this request's shapes
        walls: dict = {mb: [] for mb in engs}
        answers = set()
        for i in range(a.repeat):
            for mb in (1, a.max_batch) if i % 2 == 0 else (a.max_batch, 1):
                wall, _, jobs = _run(engs[mb], [ids], a.tokens)
                walls[mb].append(wall)
                answers.add((tuple(jobs[0].outcome.result.tokens), jobs[0].outcome.result.text))
        for e in engs.values():
            e.stop()
        s, b = walls[1], walls[a.max_batch]
        ms, mb_ = statistics.median(s), statistics.median(b)
        lines.append(
            f"| {mode} | {ms:.3f}, {min(s):.3f} | {mb_:.3f}, {min(b):.3f} | **{ms / mb_:.3f}x** | {len(s)} | "
            f"{'yes' if len(answers) == 1 else 'NO'} |"
        )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--dtype")
    ap.add_argument("--modes", default="baseline,dspark")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--procs", type=int, default=2, help="processes per engine and mode")
    ap.add_argument("--repeat", type=int, default=3, help="timed lone requests per process")
    ap.add_argument("--max-batch", type=int, default=4, help="the batching engine's --max-batch")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no new process past this many seconds; the table then holds what ran (and says so)",
    )
    ap.add_argument(
        "--control",
        action="store_true",
        help="both columns run the serial engine (separate processes, the same alternation): the spread of "
        "identical code between processes, to read the ratio against",
    )
    ap.add_argument(
        "--one-process",
        action="store_true",
        help="both engines in one process, alternating: their own cost side by side (medians)",
    )
    ap.add_argument("--out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return 0
    if a.one_process:
        out = [f"## bench_lone --one-process ({a.dtype or 'default dtype'})", *one_process(a)]
        from mlx_dspark import benchmark as bm

        bm.emit("\n".join(out) + "\n", a.out)
        return 0
    common = ["--tokens", str(a.tokens), "--repeat", str(a.repeat)]
    common += ["--model", a.model] if a.model else []
    common += ["--dtype", a.dtype] if a.dtype else []
    lines = [
        f"## bench_lone: a lone request, each engine in its own process ({a.dtype or 'default dtype'})",
        f"`python bench/bench_lone.py {' '.join(sys.argv[1:])}` at {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        ("control: both columns run the serial engine\n\n" if a.control else "")
        + "| mode | serial best s | batched best s | batched / serial speed | runs each | same tokens and text |",
        "|---|---|---|---|---|---|",
    ]
    bad, t0, cut = 0, time.monotonic(), False
    for mode in a.modes.split(","):
        walls: dict = {"S": [], "B": []}
        answers = []
        for k in range(2 * a.procs):
            if a.budget_s is not None and time.monotonic() - t0 > a.budget_s:
                cut = True
                break
            side = ("S", "B")[k % 2] if (k // 2) % 2 == 0 else ("B", "S")[k % 2]  # S B B S S B ...
            mb = 1 if side == "S" or a.control else a.max_batch
            p = subprocess.run(
                [sys.executable, __file__, "--child", "--mode", mode, "--max-batch", str(mb), *common],
                capture_output=True,
                text=True,
                timeout=a.timeout,
                env=dict(os.environ),
            )
            try:
                r = json.loads(p.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                print(p.stderr[-2000:], file=sys.stderr)
                return 2
            walls[side] += r["walls"]
            answers.append((r["tokens"], r["text"]))
            print(f"  {mode} {side} max_batch={mb}: {min(r['walls']):.3f} s best", file=sys.stderr, flush=True)
        same = all(x == answers[0] for x in answers)
        bad += not same
        if walls["S"] and walls["B"]:
            s, b = min(walls["S"]), min(walls["B"])
            lines.append(
                f"| {mode} | {s:.3f} | {b:.3f} | **{s / b:.3f}x** | {len(walls['S'])}, {len(walls['B'])} | "
                f"{'yes' if same else 'NO'} |"
            )
        if cut:
            lines.append(f"\ncut by --budget-s {a.budget_s:g} during {mode}: the modes after it did not run")
            break
    import _package  # noqa: F401  (the installed mlx_dspark, else python/)

    from mlx_dspark import benchmark as bm

    bm.emit("\n".join(lines) + "\n", a.out)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
