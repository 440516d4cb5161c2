"""Continuous batching: aggregate throughput of B concurrent streams, batched against serial.

What the server runs (serve/engine.py's Engine, in process, no HTTP): one engine with
--max-batch 1 (the serial path) and one with --max-batch 8 (serve/batch.py), same target, same
drafter. For baseline and DSpark, and B = 1, 2, 4, 8: B chat requests (`--tokens` each, greedy)
are submitted at once; aggregate tok/s = all completion tokens / wall time from the first submit
to the last delivery (prefill included), and the same per CPU second of this process (the figure
that other load on a shared machine disturbs least). The serial engine runs the 8 requests once,
one after another, each timed alone; serial(B) is the sum over the first B (what B requests
submitted at once take on it). Every batched answer is compared token for token with the serial
one (mismatches must be 0). The lone request (B = 1) is timed --repeat times on each engine,
alternately; the ratio of the best times is printed (target >= 0.98).

    PYTHONPATH=python python bench/bench_batch.py [--model M] [--dtype float32] [--tokens 128]
        [--batches 1,2,4,8] [--modes baseline,dspark] [--repeat 3]

CPU: LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 --dtype float32.
CUDA: MLX_DSPARK_DEMO_GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf MLX_DSPARK_OFFLINE=1 (no network).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _package  # noqa: E402,F401  (the installed mlx_dspark, else python/)

from mlx_dspark.benchmark import device_stamp, load_bench_target  # noqa: E402

PROMPTS = [
    "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a refrigerator works, step by step, for a curious teenager.",
    "Write a Python function that parses a CSV file and computes the average of each column, with comments.",
    "Describe the history of the printing press and its effects on Europe, in several paragraphs.",
    "Give a detailed weekly plan for learning to cook, with recipes for each day.",
    "Write a long letter from a traveller describing a journey across the mountains.",
    "Explain the rules of chess to a beginner, covering every piece and special move.",
    "Write an essay on why sleep matters for health, with practical advice.",
]


def _engine(target, tok, mode, drafter, max_batch):
    from mlx_dspark.serve.engine import Engine

    eng = Engine(target, tok, mode=mode, drafter=drafter, max_batch=max_batch, max_queue=64)
    eng.start()
    eng.warmup()
    return eng


def _run(eng, prompts, tokens):
    """Submit all at once; (wall s, CPU s of this process, [Job]) once every one is delivered."""
    from mlx_dspark.serve.engine import GenRequest

    t0, c0 = time.perf_counter(), time.process_time()
    jobs = [eng.submit(GenRequest(prompt_ids=p, max_tokens=tokens)) for p in prompts]
    for j in jobs:
        while True:
            ev = j.next_event(1.0)
            if ev is not None and ev[0] in ("done", "error", "cancelled"):
                if ev[0] != "done":
                    raise RuntimeError(f"request failed: {ev}")
                break
    return time.perf_counter() - t0, time.process_time() - c0, jobs


def _tokens(job) -> list[int]:
    return list(job.outcome.result.tokens)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--modes", default="baseline,dspark")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    T0 = time.perf_counter()
    model, target, tok = load_bench_target(args.model, args.dtype)
    from mlx_dspark.api import drafter_for, encode_prompt
    from mlx_dspark.decode import batch

    prompts = [encode_prompt(tok, p) for p in PROMPTS][: max(batches)]
    print(f"# bench_batch: {model} ({args.dtype or 'default dtype'}); {device_stamp()}")
    print(f"# decode path {target.invariance}; batch check: {batch.check(target, max(batches), 17) or 'rows equal'}")
    lens = f"{min(map(len, prompts))}-{max(map(len, prompts))}"
    print(f"# {len(prompts)} chat prompts of {lens} tokens, {args.tokens} tokens each")
    print("| mode | B | serial tok/s | batched tok/s | batched / serial (wall) | (CPU time) | mismatches |")
    print("|---|---|---|---|---|---|---|")
    lone = {}
    for mode in args.modes.split(","):
        drafter = drafter_for(target, mode) if mode in ("dspark", "dflash") else None
        serial = _engine(target, tok, mode, drafter, 1)
        batched = _engine(target, tok, mode, drafter, max(batches))
        _run(serial, prompts[:2], 8)  # untimed: first-use costs (kernel compiles, new widths)
        _run(batched, prompts, 8)
        runs = [_run(serial, [p], args.tokens) for p in prompts]  # each request alone, one after another
        sjobs = [r[2][0] for r in runs]
        for B in batches:
            wall, cpu, bjobs = _run(batched, prompts[:B], args.tokens)
            n = sum(len(_tokens(j)) for j in bjobs)
            mism = sum(_tokens(a) != _tokens(b) for a, b in zip(bjobs, sjobs[:B]))
            s_wall, s_cpu = sum(r[0] for r in runs[:B]), sum(r[1] for r in runs[:B])
            print(
                f"| {mode} | {B} | {n / s_wall:.1f} | {n / wall:.1f} | {s_wall / wall:.2f}x | "
                f"{s_cpu / cpu:.2f}x | {mism} |",
                flush=True,
            )
        best = {"serial": ([], []), "batched": ([], [])}
        for _ in range(max(args.repeat, 1)):  # the lone request, alternately on each engine
            for name, eng in (("serial", serial), ("batched", batched)):
                wall, cpu, _ = _run(eng, prompts[:1], args.tokens)
                best[name][0].append(wall)
                best[name][1].append(cpu)
        lone[mode] = [min(best["serial"][i]) / min(best["batched"][i]) for i in (0, 1)]
        serial.stop()
        batched.stop()
    for mode, (rw, rc) in lone.items():
        print(
            f"# lone request, {mode}: batched engine / serial engine speed = {rw:.3f}x wall, {rc:.3f}x CPU time "
            f"(best of {args.repeat} each)"
        )
    print(f"# total {time.perf_counter() - T0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
