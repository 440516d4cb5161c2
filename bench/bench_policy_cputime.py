"""Throughput in tokens per process-CPU-second (robust to a shared machine): baseline, the fixed
full block, and --max-draft auto with a given quiet cost curve (Q below, measured on this machine
alone: w1 57 ms ... w32 145 ms, drafter pass 13 ms), best of 2, in one process.

  OPENBLAS_NUM_THREADS=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
    python bench/bench_policy_cputime.py 0.25 chat,code      # ALPHA, classes
"""

import argparse
import sys
import time

import _package  # noqa: F401,E402

from mlx_dspark import benchmark as bm
from mlx_dspark.api import encode_prompt, generate
from mlx_dspark.cli.common import load_from_args
from mlx_dspark.decode import costs, policy
from mlx_dspark.decode.costs import Costs

if len(sys.argv) > 1:
    policy.ALPHA = float(sys.argv[1])
Q = Costs([1, 2, 4, 8, 16, 32], [0.057, 0.066, 0.073, 0.080, 0.101, 0.145], t_draft=0.013, origin="given")
costs.costs_for = lambda t, d=None: Q
ns = argparse.Namespace(
    model=None,
    dtype=None,
    quantize=None,
    kv_bits=None,
    mode="auto",
    drafter=None,
    drafter_bits=None,
    draft_vocab="auto",
)
target, tok, drafter = load_from_args(ns)
for cls in sys.argv[2].split(","):
    ids = encode_prompt(tok, bm.PROMPT_SETS[cls][0])
    out = {}
    for rep in range(2):
        for name, kw in (
            ("base", dict(mode="baseline")),
            ("fixed", dict(mode="auto", max_draft=None)),
            ("auto", dict(mode="auto", max_draft="auto")),
        ):
            t = time.process_time()
            r = generate(target, tok, None, prompt_ids=ids, drafter=drafter, max_new_tokens=128, **kw)
            dt = time.process_time() - t
            out.setdefault(name, []).append(len(r.tokens) / dt)
    b = min(out["base"]) if False else sorted(out["base"])[-1]
    print(cls, {k: round(max(v) / max(out["base"]), 3) for k, v in out.items()}, flush=True)
