"""The never-slower check, as a user gets it: one fresh `mlx-dspark generate` process per run.

  python bench/bench_auto_cli.py [--blas both|openblas|reference|asis] [--classes chat,code,math,copy]
                                 [--prompts 1] [--reps 3] [--max-new-tokens 96] [--out bench/results/auto-cli-cpu.md]

For each BLAS setting (reference = MLX_DSPARK_OPENBLAS=0, the new user's machine; openblas = what
the CLI preloads; asis = the environment untouched, for a GPU machine) and each content class
(the first `--prompts` prompts of its benchmark.PROMPT_SETS entry; 0 = all of them), it runs
`--mode auto` (the default) and `--mode baseline` in alternation, `--reps` times each, every run a
new process with `--json`, and reports the ratio of the median decode tok/s (and of the median
end-to-end wall time of the process) per prompt; a class's ratio is the geometric mean of its
prompts' ratios. Both sides decode the same tokens and text (checked). The first auto
run of each BLAS setting pays the one-time calibration (decode/costs.py): it is timed and
reported, and not counted. The calibration cache is a fresh folder (MLX_DSPARK_CACHE), never ~/.cache.

Bar: auto >= 0.97x baseline in every class, on both BLAS settings.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import _package  # noqa: F401  (the installed mlx_dspark, else python/)

from mlx_dspark import benchmark as bm  # noqa: E402
from mlx_dspark.benchmark import cpu_name, emit  # noqa: E402


def one_run(mode: str, prompt: str, n: int, env: dict) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "mlx_dspark",
        "generate",
        "--mode",
        mode,
        "--max-new-tokens",
        str(n),
        "--prompt",
        prompt,
        "--json",
    ]
    t = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    wall = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:6])} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    line = next(l for l in reversed(out.stdout.splitlines()) if l.startswith("{"))
    d = json.loads(line)
    return {
        "mode": d["mode"],
        "tps": d["timings"]["decode_tps"],
        "wall": wall,
        "tokens": d["tokens"],
        "text": d["text"],
        "accept": d.get("mean_accept_len"),
        "stats": d.get("stats", {}),
        "notice": [l for l in out.stderr.splitlines() if "cannot pay" in l],
        "warm_up_s": d.get("stats", {}).get("warm_up_s", 0.0),
    }


def compare(prompt: str, a, env: dict, tag: str) -> dict:
    """Alternate baseline and auto runs of one prompt, --reps each; the table row and the ratios."""
    runs = {"baseline": [], "auto": []}
    for r in range(a.reps):
        for mode in ("baseline", "auto") if r % 2 == 0 else ("auto", "baseline"):
            runs[mode].append(one_run(mode, prompt, a.max_new_tokens, env))
            print(f"  {tag} {mode} {runs[mode][-1]['tps']:.2f} tok/s", file=sys.stderr, flush=True)
    b, x = runs["baseline"], runs["auto"]
    mb, mx_ = statistics.median(r["tps"] for r in b), statistics.median(r["tps"] for r in x)
    wb, wx = statistics.median(r["wall"] for r in b), statistics.median(r["wall"] for r in x)
    same = all(r["tokens"] == b[0]["tokens"] and r["text"] == b[0]["text"] for r in b + x)
    warm = statistics.median(r["warm_up_s"] for r in x)
    line = (
        f"{mb:.2f} | {mx_:.2f} | {mx_ / mb:.3f}x | {wb / wx:.3f}x | {x[0]['mode']} | "
        f"{x[0]['accept']:.2f} | {warm:.2f} | {'yes' if same else 'NO'} |"
    )
    return {"decode": mx_ / mb, "wall": wb / wx, "line": line}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blas", default="both", choices=["both", "openblas", "reference", "asis"])
    ap.add_argument("--classes", default="chat,code,math,copy")
    ap.add_argument("--prompts", type=int, default=1, help="prompts per class (0 = every prompt of the set)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out")
    a = ap.parse_args()
    classes = a.classes.split(",")
    settings = ["reference", "openblas"] if a.blas == "both" else [a.blas]
    load = os.getloadavg()[0]
    import mlx.core as mx

    from mlx_dspark.models.precision import default_dtype

    gpu = mx.default_device() == mx.gpu
    machine = f"{mx.device_info().get('device_name', 'GPU')} (MLX {mx.__version__})" if gpu else cpu_name()
    emit(
        f"\n## bench_auto_cli.py, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n"
        f"`python bench/bench_auto_cli.py --blas {a.blas} --classes {a.classes} --prompts {a.prompts} --reps {a.reps} "
        f"--max-new-tokens {a.max_new_tokens}`; {machine}, {os.cpu_count()} cores, shared with other "
        f"jobs (load average {load:.1f} at the start); demo model, {default_dtype()}; modes alternate run by run.\n",
        a.out,
    )
    for setting in settings:
        cache = tempfile.mkdtemp(prefix="mlx-dspark-bench-cache-")
        atexit.register(shutil.rmtree, cache, True)  # a converted demo model: ~600 MB
        env = dict(os.environ, MLX_DSPARK_CACHE=cache)
        if setting != "asis":
            env.pop("LD_PRELOAD", None)
            env.pop("MLX_DSPARK_OPENBLAS_REEXEC", None)
        if setting == "reference":
            env["MLX_DSPARK_OPENBLAS"] = "0"
        t = time.perf_counter()
        first = one_run("auto", bm.PROMPT_SETS[classes[0]][0], 8, env)
        emit(
            f"### {'as it is' if setting == 'asis' else setting + ' BLAS'}\n\n"
            f"first auto run (calibration included): {time.perf_counter() - t:.1f} s wall, "
            f"ran {first['mode']}" + (f"; it said: `{first['notice'][0]}`" if first["notice"] else "") + "\n",
            a.out,
        )
        emit(
            "| class | baseline tok/s (median) | auto tok/s (median) | ratio decode | ratio wall | auto ran | "
            "accept | auto warm-up s | same tokens and text |\n|---|---|---|---|---|---|---|---|---|",
            a.out,
        )
        for cls in classes:
            prompts = bm.PROMPT_SETS[cls][: a.prompts or None]
            ratios, walls = [], []
            for i, prompt in enumerate(prompts):
                row = compare(prompt, a, env, f"{setting} {cls} {i + 1}")
                ratios.append(row["decode"])
                walls.append(row["wall"])
                label = cls if len(prompts) == 1 else f"{cls} {i + 1}"
                emit(f"| {label} | {row['line']}", a.out)
            if len(prompts) > 1:
                emit(
                    f"| **{cls}, geometric mean of {len(prompts)}** | | | **{bm.geomean(ratios):.3f}x** | "
                    f"{bm.geomean(walls):.3f}x | | | | |",
                    a.out,
                )
        emit("", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
