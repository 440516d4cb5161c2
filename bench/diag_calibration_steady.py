"""Does the calibration's cost curve match what the decode loop pays once it runs? (issue 20)

  python bench/diag_calibration_steady.py [--model M] [--dtype bfloat16] [--steps 96] [--out FILE]

In one process, on the target as the CLI loads it (with the registered drafter's taps):
  1. decode/costs.measure() twice in a row (the first is what a fresh process stores);
  2. the steady state after it: `--steps` pipelined plain steps timed one by one (as the loop
     takes them), and a synchronised forward of each width (the calibration's verify), 16 each;
  3. a round's marginal cost inside a pipelined run: the same number of plain steps with one
     synchronised width-w forward every 8 steps, against plain steps alone (the loop's round:
     the pending token is read, the round is built and run, its result read back).
Prints each figure in ms and as a multiple of the steady pipelined plain step, which the cost
model (decode/policy.py) compares every round against.
"""

from __future__ import annotations

import argparse
import statistics
import time

import _package  # noqa: F401  (the installed mlx_dspark, else python/)
import mlx.core as mx

from mlx_dspark import benchmark as bm
from mlx_dspark.api import drafter_for
from mlx_dspark.decode import costs

WIDTHS = (1, 2, 4, 8, 16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--out")
    args = ap.parse_args()
    _, target, _ = bm.load_bench_target(args.model, args.dtype)
    drafter = drafter_for(target, "auto")
    taps = tuple(drafter.taps) if drafter is not None else ()
    lines = [f"## diag_calibration_steady: {bm.device_stamp()}", ""]

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    for i in (1, 2):
        t = time.perf_counter()
        c = costs.measure(target, drafter)
        say(f"- measure() #{i} ({time.perf_counter() - t:.2f} s): {c.summary()}; t_plain {c.t_plain * 1e3:.2f} ms")

    vocab = int(target.vocab_size)
    ids = [(29 + 104729 * i) % (vocab - 1) + 1 for i in range(64)]
    cache = target.make_cache()
    mx.eval(target.forward(mx.array([ids[:16]]), cache, taps=taps, last_only=True).logits)

    def step(tok):
        o = target.forward(tok[None], cache, taps=taps)
        nxt = mx.argmax(o.logits[0, -1:], axis=-1).astype(mx.int32)
        mx.async_eval([nxt] + ([o.hidden] if o.hidden is not None else []))
        return nxt

    def synced(w: int) -> float:
        t = time.perf_counter()
        o = target.forward(mx.array([ids[:w]]), cache, taps=taps)
        mx.eval([o.logits] + ([o.hidden] if o.hidden is not None else []))
        dt = time.perf_counter() - t
        target.trim(cache, w)
        return dt

    def plain_run(n: int, round_w: int = 0) -> tuple[float, list[float]]:
        """n pipelined plain steps (with a synchronised width-round_w forward every 8): total s, per-step s."""
        per = []
        tok, prev = mx.array([ids[0]], dtype=mx.int32), None
        t0 = time.perf_counter()
        for j in range(n):
            t = time.perf_counter()
            if round_w and j % 8 == 7:
                if prev is not None:
                    prev.item()
                synced(round_w)
                prev = None
            nxt = step(tok)
            if prev is not None:
                prev.item()
            prev = tok = nxt
            per.append(time.perf_counter() - t)
        prev.item()
        return time.perf_counter() - t0, per

    for w in WIDTHS:  # first use of each width here: untimed
        synced(w)
    plain_run(16)
    tot, per = plain_run(args.steps)
    p_med, p_mean = statistics.median(per), tot / args.steps
    say(f"- steady pipelined plain step: median {p_med * 1e3:.2f} ms, mean {p_mean * 1e3:.2f} ms over {args.steps}")
    sync = {w: sorted(synced(w) for _ in range(16)) for w in WIDTHS}
    say(
        "- steady synchronised forward (median; min), ms and x the plain step's mean: "
        + ", ".join(
            f"w{w} {statistics.median(v) * 1e3:.2f} ({v[0] * 1e3:.2f}) {statistics.median(v) / p_mean:.2f}x"
            for w, v in sync.items()
        )
    )
    n = args.steps - args.steps % 8
    base, _ = plain_run(n)
    for w in (2, 4, 8):
        mixed, _ = plain_run(n, w)
        marginal = (mixed - base) / (n // 8)
        modeled = statistics.median(sync[w]) + max(0.0, statistics.median(sync[1]) - p_mean)
        say(
            f"- a width-{w} synchronised forward every 8 plain steps: {marginal * 1e3:.2f} ms more each, "
            f"{marginal / (base / n):.2f}x a plain step of that run ({base / n * 1e3:.2f} ms; the model's "
            f"round: t_verify({w}) + bubble = {modeled * 1e3:.2f} ms)"
        )
    say("")
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
