"""DSpark with one of its switches off and on, against plain decoding, alternating in one process.

  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
      python bench/bench_confidence_cut.py [--switch cut|panels] [--classes chat,code,math,copy] \
                                           [--trials 3] [--tokens 128] [--out bench/results/....md]

`--switch cut` (the default): the cost model with and without its per-round confidence cut
(decode/policy.py, CostPolicy.cut; `CostPolicy.cuts_by_confidence = False` turns it off).
`--switch panels`: the drafter's products from float32 weights or from float16 panels
(kernels/draft_linear.py; MLX_DSPARK_DRAFT_PANELS, read at each product, and each setting has its
own calibration on disk).

One process, the demo pair (the registered DSpark drafter, as `--mode dspark` loads it), every
prompt of benchmark.PROMPT_SETS per class. Per prompt a warm-up run of each side, then `--trials`
rounds in which three sides alternate: plain decoding, DSpark with the switch off, and DSpark with
it on (the default). Per prompt the median decode tok/s of each side, by
wall time and by the process's CPU time over the whole call (a shared VM's steal time moves the
first, not the second); per class the geometric mean of the per-prompt ratios to plain
decoding. Every run must decode the same tokens and text as plain decoding (checked).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import _package  # noqa: F401  (the installed mlx_dspark, else python/)

from mlx_dspark import benchmark as bm  # noqa: E402
from mlx_dspark.api import drafter_for, encode_prompt, generate  # noqa: E402
from mlx_dspark.blas import active_blas  # noqa: E402
from mlx_dspark.decode import policy as pol  # noqa: E402

SWITCHES = {"cut": ("plain", "no cut", "cut"), "panels": ("plain", "float32", "panels")}


def one(target, tok, drafter, ids, side: str, n: int):
    """(result, tokens per CPU second of the whole call)."""
    pol.CostPolicy.cuts_by_confidence = side != "no cut"
    os.environ["MLX_DSPARK_DRAFT_PANELS"] = "off" if side == "float32" else "on"
    try:
        mode = "baseline" if side == "plain" else "dspark"
        c0 = time.process_time()
        r = generate(
            target,
            tok,
            None,
            prompt_ids=ids,
            mode=mode,
            drafter=drafter if mode == "dspark" else None,
            max_new_tokens=n,
            max_draft="auto",
        )
        return r, len(r.tokens) / max(time.process_time() - c0, 1e-9)
    finally:
        pol.CostPolicy.cuts_by_confidence = True
        os.environ.pop("MLX_DSPARK_DRAFT_PANELS", None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switch", choices=sorted(SWITCHES), default="cut")
    ap.add_argument("--model", default=None, help="target (default: the demo model)")
    ap.add_argument("--classes", default="chat,code,math,copy")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out")
    args = ap.parse_args()
    sides = SWITCHES[args.switch]
    plain_side, off_side, on_side = sides
    t0 = time.perf_counter()
    model, target, tok = bm.load_bench_target(args.model)
    drafter = drafter_for(target, "dspark")
    rows, lines = {}, []
    for cls in args.classes.split(","):
        for i, prompt in enumerate(bm.PROMPT_SETS[cls]):
            ids = encode_prompt(tok, prompt)
            tps = {s: [] for s in sides}
            cpu = {s: [] for s in sides}
            cut_slots = []
            ref = None
            for trial in range(args.trials + 1):  # trial 0: the warm-up
                for side in sides:
                    r, per_cpu_s = one(target, tok, drafter, ids, side, args.tokens)
                    ref = ref or (r.tokens, r.text)
                    if (r.tokens, r.text) != ref:
                        raise SystemExit(f"{cls} {i}: {side} decoded other tokens or text than plain decoding")
                    if trial:
                        tps[side].append(r.decode_tps)
                        cpu[side].append(per_cpu_s)
                        if side == on_side:
                            cut_slots.append(r.stats.get("cut_slots", 0))
            med = {s: statistics.median(v) for s, v in tps.items()}
            med.update({f"cpu {s}": statistics.median(v) for s, v in cpu.items()})
            rows[(cls, i)] = med
            plain, off, on = med[plain_side], med[off_side], med[on_side]
            c_plain, c_off, c_on = med[f"cpu {plain_side}"], med[f"cpu {off_side}"], med[f"cpu {on_side}"]
            lines.append(
                f"| {cls} {i + 1} | {prompt[:40]} | {plain:.1f} | {off / plain:.3f}x | {on / plain:.3f}x "
                f"| {on / off:.3f}x | {c_off / c_plain:.3f}x | {c_on / c_plain:.3f}x | {c_on / c_off:.3f}x "
                f"| {statistics.median(cut_slots):.0f} |"
            )
            print(lines[-1], flush=True)
    out = [
        f"### DSpark, {off_side} / {on_side}: {model} (float32), {bm.device_stamp()}",
        f"`bench/bench_confidence_cut.py --switch {args.switch} --classes {args.classes} --trials {args.trials} "
        f"--tokens {args.tokens}` "
        f"at {time.strftime('%Y-%m-%d %H:%M')}; BLAS {active_blas()['name']}",
        "",
        f"{args.tokens} new tokens, greedy, median of {args.trials} alternating trials per prompt after a warm-up; "
        "every run decoded plain decoding's tokens and text.",
        "",
        f"| prompt | text | plain tok/s | {off_side} | {on_side} | {on_side} / {off_side} | CPU time: {off_side} "
        f"| {on_side} | {on_side} / {off_side} | slots cut |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *lines,
        "",
    ]
    for cls in args.classes.split(","):
        got = [v for (c, _), v in rows.items() if c == cls]

        def g(side, base="plain", got=got):
            return bm.geomean([r[side] / r[base] for r in got])

        off, on = g(off_side), g(on_side)
        c_off, c_on = g(f"cpu {off_side}", "cpu plain"), g(f"cpu {on_side}", "cpu plain")
        out.append(
            f"- {cls}: wall: {off_side} **{off:.3f}x**, {on_side} **{on:.3f}x** plain decoding ({on / off:.3f}x); "
            f"CPU time: {c_off:.3f}x, {c_on:.3f}x ({c_on / c_off:.3f}x)"
        )
    out.append(f"- whole run {time.perf_counter() - t0:.0f} s")
    bm.emit("\n".join(out), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
