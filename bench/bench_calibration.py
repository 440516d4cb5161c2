"""The calibration (decode/costs.py): how long it takes, what it measures, and its reuse from disk.

  python bench/bench_calibration.py [--model M] [--busy N] [--out bench/results/auto-cpu.md]

Run it as the CLI would (with and without OpenBLAS preloaded: LD_PRELOAD=... or not). It measures
the demo target with its drafter and without, in a fresh cache folder (never ~/.cache), then reads
both back from disk in a second process. Bar: <= 5 s each, reused on the next start.

`--busy N`: N processes spin on the CPUs through the first start (a user's first run during a
build): its curves must come out unsettled, and the second (quiet) start must measure them again
and settle them; a third start then reads them from disk.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import _package  # noqa: F401  (the installed mlx_dspark, else python/)

CHILD = """
import json, time, argparse
from mlx_dspark.cli.common import load_from_args
from mlx_dspark.decode import costs, modes
from mlx_dspark.blas import active_blas
ns = argparse.Namespace(model={model!r}, dtype=None, quantize=None, kv_bits=None, mode="auto", drafter=None,
                        drafter_bits=None, draft_vocab="auto")
target, tok, drafter = load_from_args(ns)
out = {{"blas": active_blas()["name"]}}
for name, d in (("with drafter", drafter), ("lookup only", None)):
    t = time.perf_counter()
    c = costs.costs_for(target, d)
    out[name] = {{"s": round(time.perf_counter() - t, 3), "origin": c.origin, "summary": c.summary(),
                 "verdict": modes.auto_verdict(c, d), "settled": c.settled, "others": c.others_share}}
print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--busy", type=int, default=0, help="processes spinning through the first start")
    ap.add_argument("--out")
    a = ap.parse_args()
    from mlx_dspark.benchmark import cpu_name, emit

    cache = tempfile.mkdtemp(prefix="mlx-dspark-calib-")
    atexit.register(shutil.rmtree, cache, True)  # a converted model: ~600 MB
    env = dict(os.environ, MLX_DSPARK_CACHE=cache, MLX_DSPARK_CALIBRATION="auto")
    runs = []
    spin = "import time\nwhile True: pass"
    for i in range(3 if a.busy else 2):
        spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(a.busy if i == 0 else 0)]
        try:
            p = subprocess.run(
                [sys.executable, "-c", CHILD.format(model=a.model)],
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
        finally:
            for sp in spinners:
                sp.kill()
                sp.wait()
        if p.returncode:
            raise SystemExit(p.stderr[-2000:])
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    lines = [
        f"\n### bench_calibration.py, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: BLAS "
        f"{runs[0]['blas']}, LD_PRELOAD={os.environ.get('LD_PRELOAD', '-')}; {cpu_name()}, {os.cpu_count()} "
        f"cores, shared (load average {os.getloadavg()[0]:.1f})"
        + (f"; {a.busy} processes spinning through the first start" if a.busy else "")
        + "\n",
        "| pair | start | s | others' CPU share | curve | --mode auto runs |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("with drafter", "lookup only"):
        for i, r in enumerate(runs):
            f = r[name]
            runs_mode, said = f["verdict"]
            verdict = runs_mode + (f": {said}" if said else "")
            share = "-" if f["others"] is None else f"{f['others']:.2f}"
            lines.append(f"| {name} | {i + 1} | {f['s']:.3f} | {share} | {f['summary']} | {verdict} |")
    emit("\n".join(lines), a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
