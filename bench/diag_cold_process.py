"""What a fresh process pays the first time each verify width runs, and which switch removes it.

  python bench/diag_cold_process.py [--model M] [--precision bf16] [--widths 1,2,3,4,6,8,12,17]
                                    [--taps 1,8,14,20,27] [--variants default,default,nographs,nocompile]
                                    [--out FILE.md]

Why: on the H200 the first DSpark (or lookup) generate of a process took 7-10 s for 128 tokens,
the next one 0.2-0.3 s, and a plain-decoding generate 0.5 s first; so `mlx-dspark generate`, one
process per call, ran DSpark at 10-17 tok/s against baseline's 200-290 (bench/results/
auto-h200.md). That is paid once per process, in the verify path (lookup pays it too), and most
likely once per width bucket (models/compiled_decode.py BUCKETS).

Each variant runs in a fresh child process: the target loads, a 64-token prompt is prefilled,
then for each width w (in order) one verify-shaped forward (target.forward, the loop's own) runs
and is trimmed away, twice. Per width it reports the host time of the first call (building or
tracing the graph), the first call's whole time, and the second call's. Variants:
  default     as users run it (run it twice: the second process shows what disk caches keep)
  nographs    MLX_USE_CUDA_GRAPHS=0 (MLX's CUDA graph capture off)
  nocompile   MLX_DSPARK_COMPILE=off (the op-by-op kernel path: no mx.compile traces)
  nocudnn     MLX_CUDA_USE_CUDNN_SDPA=0
  buckets     MLX_DSPARK_BUCKETS=1,8,17,33 (4 traced widths instead of 10: widths 2-8 share one)
Read: a per-width first cost that a variant removes is what that switch controls.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VARIANTS = {
    "default": {},
    "nographs": {"MLX_USE_CUDA_GRAPHS": "0"},
    "nocompile": {"MLX_DSPARK_COMPILE": "off"},
    "nocudnn": {"MLX_CUDA_USE_CUDNN_SDPA": "0"},
    "buckets": {"MLX_DSPARK_BUCKETS": "1,8,17,33"},
}


def child(a) -> None:
    t0 = time.perf_counter()
    import _package
    import mlx.core as mx

    from mlx_dspark.decode.loop import prefill_chunk

    target, _, _ = _package.load_precision(a.model, a.precision)
    load_s = time.perf_counter() - t0
    taps = tuple(int(t) for t in a.taps.split(",")) if a.taps else ()
    vocab = target.vocab_size
    ids = mx.array([[(37 * i + 11) % vocab for i in range(64 + 64)]], dtype=mx.int32)
    cache = target.make_cache()
    t = time.perf_counter()
    prefill_chunk(target, cache, ids[:, :64], taps)
    mx.eval([c.state for c in cache])
    prefill_s = time.perf_counter() - t

    def once(w: int) -> tuple[float, float]:
        t = time.perf_counter()
        out = target.forward(ids[:, 64 : 64 + w], cache, taps=taps)
        host = time.perf_counter() - t
        mx.eval(out.logits, out.hidden if out.hidden is not None else [])
        total = time.perf_counter() - t
        target.trim(cache, w)
        return host * 1e3, total * 1e3

    rows = []
    for w in (int(x) for x in a.widths.split(",")):
        h1, t1 = once(w)
        _, t2 = once(w)
        rows.append({"w": w, "host_first_ms": h1, "first_ms": t1, "again_ms": t2})
    print(json.dumps({"load_s": load_s, "prefill_s": prefill_s, "rows": rows}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--widths", default="1,2,3,4,6,8,12,17")
    ap.add_argument("--taps", default="1,8,14,20,27", help="tapped layers (the demo drafter's); '' for none")
    ap.add_argument("--variants", default="default,default,nographs,nocompile")
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return 0
    args = ["--precision", a.precision, "--widths", a.widths, "--taps", a.taps]
    if a.model:
        args += ["--model", a.model]
    lines = [
        f"## verify widths in a fresh process: {a.precision}, widths {a.widths}, taps {a.taps or 'none'}",
        f"`python bench/diag_cold_process.py --precision {a.precision} --widths {a.widths} --variants {a.variants}`",
        "",
        "| variant (process) | load s | prefill s | per width: first call host ms / first ms / again ms |",
        "|---|---|---|---|",
    ]
    for k, name in enumerate(a.variants.split(",")):
        env = dict(os.environ, **VARIANTS[name])
        t = time.perf_counter()
        p = subprocess.run(
            [sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env, timeout=a.timeout
        )
        wall = time.perf_counter() - t
        try:
            r = json.loads(p.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            lines.append(f"| {name} ({k + 1}) | failed rc {p.returncode}: {p.stderr.strip()[-300:]!r} | | |")
            continue
        cells = ", ".join(
            f"w{x['w']}: {x['host_first_ms']:.0f} / {x['first_ms']:.0f} / {x['again_ms']:.1f}" for x in r["rows"]
        )
        first = sum(x["first_ms"] - x["again_ms"] for x in r["rows"]) / 1e3
        lines.append(
            f"| {name} ({k + 1}; {wall:.1f} s wall; widths' first-call excess {first:.2f} s) | {r['load_s']:.1f} "
            f"| {r['prefill_s']:.2f} | {cells} |"
        )
        print(lines[-1], flush=True)
    import _package  # noqa: F401  (the installed mlx_dspark, else python/)

    from mlx_dspark import benchmark as bm

    bm.emit("\n".join(lines) + "\n", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
