"""Continuous batching: aggregate throughput of B concurrent streams, batched against serial.

What the server runs (serve/engine.py's Engine, in process, no HTTP): per mode (baseline;
dspark: the drafter's full block every round, the Python API's default; auto: `serve`'s
defaults, --mode auto --max-draft auto, each row under its own cost policy and the batch's draft
gate) one engine with --max-batch 1 (the serial path) and one with --max-batch max(B)
(serve/batch.py), same target, same drafter. For B = 1, 2, 4, 8: B chat requests (`--tokens`
each, greedy) are submitted at once; aggregate tok/s = all completion tokens / wall time from the
first submit to the last delivery (prefill included), and the same per CPU second of this process
(the figure that other load on a shared machine disturbs least). The serial engine runs the
max(B) requests once, one after another, each timed alone; serial(B) is the sum over the first B
(what B requests submitted at once take on it). Every batched answer is compared with the serial
one, token ids AND text (mismatches must be 0). The lone request (B = 1) is timed --repeat times
on each engine, alternately; the ratio of the best times is printed (target >= 0.98), with the
scheduler's own time per step of a lone row (measured on a stub generation).

One run prints every figure of the issue's bars: batched / serial per mode and B, batched
dspark and auto / batched baseline per B, the lone request, mismatches. `--budget-s S` keeps the whole run
(load and warm-up included: MLX CUDA JIT-compiles on first use) under S seconds: after the
warm-up it measures each mode's serial speed, then cuts --repeat, then --tokens (never below
16), so that the planned work fits, and says so; a phase that would still end past the budget
is skipped and named. Phases run serial (every mode), then batched B = 4 first, each B for every
mode before the next, then the lone request, so a short budget keeps the bars' figures. Each
batched run goes once untimed first (`--warm-batched 1`, the default): where decode steps are
compiled graphs (the GPU) the batch engine builds one per rows x width x KV-block shape the first
time it meets it, which a server pays once and a steady-state figure must not include.
`--out F` appends the report (markdown) to F, line by line.

    PYTHONPATH=python python bench/bench_batch.py [--model M] [--dtype float32] [--tokens 128]
        [--batches 1,2,4,8] [--modes baseline,dspark,auto] [--repeat 3] [--budget-s S] [--out F]

CPU: LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 --dtype float32.
CUDA (bench/h200_invariance.sh batch): --dtype bfloat16, MLX_DSPARK_DEMO_GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf
MLX_DSPARK_OFFLINE=1 (no network).
"""

from __future__ import annotations

import time

T_START = time.perf_counter()  # the budget counts from here: imports, load and warm-up included

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

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
MIN_TOKENS = 16
SLACK = 1.25  # planned seconds = measured cost x SLACK (prefills, thread hand-offs, noise)


def _engine(target, tok, mode, drafter, max_batch):
    """Mode `auto` is what `mlx-dspark serve` runs unless told otherwise (its CLI defaults)."""
    from mlx_dspark.serve.engine import Engine

    max_draft = "auto" if mode == "auto" else None
    eng = Engine(target, tok, mode=mode, drafter=drafter, max_draft=max_draft, max_batch=max_batch, max_queue=64)
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


def _text(job) -> str:
    return job.outcome.result.text


def scheduler_overhead_us(steps: int = 2000) -> float:
    """The batch scheduler's own time per step of a lone row (microseconds): its admit/step/after-step loop
    around a stub generation whose step() does nothing."""
    import queue

    from mlx_dspark.serve.batch import BatchScheduler, _Row

    class Gen:
        prefilled, done, n = True, False, 0

        def step(self):
            self.n += 1
            self.done = self.n >= steps

    class Run:
        generation, cancel_check = Gen(), staticmethod(lambda: False)

    class Eng:
        _queue, max_batch, metrics, max_kv_mb, running = queue.Queue(), 8, None, None, []

    sched = BatchScheduler(Eng())
    row = _Row(None, Run(), [""], 0.0)
    sched.rows.append(row)
    sched._deliver = lambda r: None  # the stub has nothing to deliver
    t0 = time.perf_counter()
    while sched.rows:
        sched._admit()
        sched._step()
    return (time.perf_counter() - t0) / steps * 1e6


class Plan:
    """The budget: a deadline, and the tokens and repeats that fit it."""

    def __init__(self, budget_s: float, t0: float):
        self.deadline = t0 + budget_s if budget_s > 0 else float("inf")
        self.notes: list[str] = []

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def fit(
        self, tokens: int, repeat: int, n_serial: int, n_batched: float, tps: dict, warm: int = 1
    ) -> tuple[int, int]:
        """Tokens and repeats for which every mode's serial runs, batched runs (B rows costed as
        max(1, B / 2) serial requests; `warm` + 1 runs each) and lone repeats fit what is left of the budget."""
        warm = 1 + warm

        def cost(t, r):
            return SLACK * sum((n_serial + warm * n_batched + 2 * r) * t / max(v, 1e-6) for v in tps.values())

        t, r = tokens, repeat
        while r > 1 and cost(t, r) > self.left():
            r -= 1
        while t > MIN_TOKENS and cost(t, r) > self.left():
            t = max(MIN_TOKENS, int(t * 0.8))
        if (t, r) != (tokens, repeat):
            self.notes.append(
                f"budget: --tokens {tokens} -> {t}, --repeat {repeat} -> {r} to fit {self.left():.0f} s left "
                f"(serial {', '.join(f'{m} {v:.1f}' for m, v in tps.items())} tok/s after warm-up)"
            )
        return t, r

    def allows(self, what: str, est_s: float) -> bool:
        if time.perf_counter() + est_s <= self.deadline:
            return True
        self.notes.append(f"budget: skipped {what} (needs ~{est_s:.0f} s, {max(self.left(), 0):.0f} s left)")
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--modes", default="baseline,dspark,auto")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=0.0, help="the whole run's wall-clock budget (0: none)")
    ap.add_argument(
        "--warm-batched",
        type=int,
        default=1,
        help="1: each batched run goes once untimed first (a compiled path builds a graph per rows x width "
        "shape the first time it meets it: a server pays that once, a timed run must not); 0: time the first",
    )
    ap.add_argument("--out", default=None, help="append the report (markdown) to this file")
    args = ap.parse_args(argv)
    T0 = T_START
    plan = Plan(args.budget_s, T0)
    batches = sorted({int(b) for b in args.batches.split(",")})
    modes = [m for m in args.modes.split(",") if m]

    def say(line: str = "") -> None:
        print(line, flush=True)
        if args.out:  # line by line: a run cut short by a time limit keeps what it measured
            with open(args.out, "a") as f:
                f.write(line + "\n")

    model, target, tok = load_bench_target(args.model, args.dtype)
    from mlx_dspark.api import drafter_for, encode_prompt
    from mlx_dspark.decode import batch

    prompts = [encode_prompt(tok, p) for p in PROMPTS][: max(batches)]
    say(f"## bench_batch: {Path(str(model)).name} ({args.dtype or 'default dtype'}); {device_stamp()}")
    say(
        f"decode path {target.invariance}; batch check: {batch.check(target, max(batches), 17) or 'rows equal'}; "
        f"load {time.perf_counter() - T0:.1f} s"
    )

    engines, drafters = {}, {}
    for mode in modes:
        drafters[mode] = drafter_for(target, mode) if mode in ("dspark", "dflash", "auto") else None
        engines[mode] = (
            _engine(target, tok, mode, drafters[mode], 1),
            _engine(target, tok, mode, drafters[mode], max(batches)),
        )
    # Warm-up (untimed): first-use costs (kernel compiles, each batch width), then each mode's serial speed.
    tps = {}
    for mode, (serial, batched) in engines.items():
        _run(serial, prompts[:1], MIN_TOKENS)
        for B in batches:
            _run(batched, prompts[:B], MIN_TOKENS)
        wall, _, jobs = _run(serial, prompts[1:2] or prompts[:1], MIN_TOKENS)
        tps[mode] = sum(len(_tokens(j)) for j in jobs) / wall
    say(f"warm-up done at {time.perf_counter() - T0:.0f} s")
    n_batched = sum(max(1.0, B / 2) for B in batches)
    tokens, repeat = plan.fit(args.tokens, args.repeat, len(prompts), n_batched, tps, args.warm_batched)
    lens = f"{min(map(len, prompts))}-{max(map(len, prompts))}"
    say(f"{len(prompts)} chat prompts of {lens} tokens, {tokens} tokens each, greedy")
    say()
    say(
        "| mode | B | serial tok/s | batched tok/s | batched / serial (wall) | (CPU time) "
        "| token mismatches | text mismatches |"
    )
    say("|---|---|---|---|---|---|---|---|")
    agg: dict = {}  # (mode, B) -> batched tok/s
    gated: dict = {}  # B -> auto's batched steps in its timed run, by the draft gate's choice
    lone: dict = {}
    mismatches = 0
    serial_runs: dict = {}  # mode -> [(wall, cpu, [Job])], each request alone
    s_tps: dict = {}
    for mode, (serial, _) in engines.items():  # phase 1: the serial runs of every mode
        if plan.allows(f"{mode}: the serial runs", SLACK * len(prompts) * tokens / tps[mode]):
            runs = serial_runs[mode] = [_run(serial, [p], tokens) for p in prompts]
            s_tps[mode] = sum(len(_tokens(r[2][0])) for r in runs) / sum(r[0] for r in runs)
    # Phase 2: batched, B = 4 first (the bar), each B for every mode before the next B.
    for B in sorted(batches, key=lambda b: (b != 4, b)):
        for mode in serial_runs:
            if not plan.allows(f"{mode} B={B}", SLACK * (1 + args.warm_batched) * B * tokens / s_tps[mode]):
                continue
            runs = serial_runs[mode]
            sjobs = [r[2][0] for r in runs]
            if args.warm_batched:  # the same requests once untimed: every (rows, width) shape they meet is built
                _run(engines[mode][1], prompts[:B], tokens)
            before = engines[mode][1].batch_steps()
            wall, cpu, bjobs = _run(engines[mode][1], prompts[:B], tokens)
            after = engines[mode][1].batch_steps()
            if mode == "auto" and before is not None and after is not None:
                gated[B] = {k: after[k] - before[k] for k in after}
            n = sum(len(_tokens(j)) for j in bjobs)
            tok_bad = sum(_tokens(a) != _tokens(b) for a, b in zip(bjobs, sjobs[:B]))
            text_bad = sum(_text(a) != _text(b) for a, b in zip(bjobs, sjobs[:B]))
            mismatches += tok_bad + text_bad
            s_wall, s_cpu = sum(r[0] for r in runs[:B]), sum(r[1] for r in runs[:B])
            agg[mode, B] = n / wall
            say(
                f"| {mode} | {B} | {n / s_wall:.1f} | {n / wall:.1f} | {s_wall / wall:.2f}x | "
                f"{s_cpu / cpu:.2f}x | {tok_bad} | {text_bad} |"
            )
    for mode in serial_runs:  # phase 3: the lone request, alternately on each engine
        best = {"serial": ([], []), "batched": ([], [])}
        for i in range(max(repeat, 1)):
            if not plan.allows(f"{mode}: lone repeat {i + 1}", SLACK * 2 * tokens / s_tps[mode]):
                break
            pair = list(zip(("serial", "batched"), engines[mode]))
            for name, eng in pair if i % 2 == 0 else pair[::-1]:  # either engine first, in turn
                wall, cpu, _ = _run(eng, prompts[:1], tokens)
                best[name][0].append(wall)
                best[name][1].append(cpu)
        if best["batched"][0]:
            lone[mode] = [min(best["serial"][i]) / min(best["batched"][i]) for i in (0, 1)] + [len(best["serial"][0])]
    for serial, batched in engines.values():
        serial.stop()
        batched.stop()

    base = "baseline"
    for spec in [m for m in modes if m != base]:
        if not any((base, B) in agg and (spec, B) in agg for B in batches):
            continue
        say()
        say(f"| B | batched {base} tok/s | batched {spec} tok/s | batched {spec} / batched {base} |")
        say("|---|---|---|---|")
        for B in batches:
            if (base, B) in agg and (spec, B) in agg:
                say(f"| {B} | {agg[base, B]:.1f} | {agg[spec, B]:.1f} | {agg[spec, B] / agg[base, B]:.2f}x |")
    if gated:
        say()
        say(
            "auto's draft gate (decode/batch.DraftGate), the batched steps of each timed run by its choice: "
            + "; ".join(
                f"B = {B}: {g['drafts']} with drafts allowed, {g['plain']} plain" for B, g in sorted(gated.items())
            )
        )
    say()
    for mode, (rw, rc, n) in lone.items():
        say(
            f"lone request, {mode}: batched engine / serial engine speed = {rw:.3f}x wall, {rc:.3f}x CPU time "
            f"(best of {n} each; target >= 0.98)"
        )
    say(f"the scheduler's own time per step of a lone row: {scheduler_overhead_us():.1f} us")
    say(f"mismatches (token ids or text, batched against serial): {mismatches}")
    for note in plan.notes:
        say(note)
    say(f"total {time.perf_counter() - T0:.0f} s" + (f" (budget {args.budget_s:.0f} s)" if args.budget_s else ""))
    say()
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
