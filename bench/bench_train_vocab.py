"""distill's training step over the draft vocabulary against the full vocabulary, in one run.

  python bench/bench_train_vocab.py [--model M] [--drafter DIR] [--train-vocab auto|N] [--batch 4]
                                    [--anchors 64] [--steps 6] [--out bench/results/train-vocab-cpu.md]

`--train-vocab auto` shrinks every vocabulary-wide tensor of the loss (draft logits, the two
distributions, their L1, the CE and all their gradients) to the draft vocabulary. This times the
real training step (`trainer.train`: target forward, drafter forward and backward, AdamW) both
ways on the same batches: the demo target and its shipped drafter (warm start), sequences drawn
from the drafter's answer-token ranking (draft_vocab.json; only their shape matters here).
Per-step wall time: the median of the steps after the first two (graph building, allocation).
On Linux CPU run it with OpenBLAS preloaded (the CLI does this by itself; a script does not):
  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python bench/bench_train_vocab.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
import _package  # noqa: E402,F401  (the installed mlx_dspark, else python/)

from mlx_dspark import benchmark as bm  # noqa: E402
from mlx_dspark.train import data as D  # noqa: E402
from mlx_dspark.train.trainer import DistillConfig, train  # noqa: E402

ASSET = ROOT / "python/mlx_dspark/assets/dspark-smollm2-135m-instruct"


def samples_from_ranking(drafter: Path, n: int, prompt_len: int, answer_len: int, seed: int) -> list[D.Sample]:
    rank = json.loads((drafter / "draft_vocab.json").read_text())
    ids, counts = np.array(rank["ids"]), np.array(rank["counts"], dtype=np.float64)
    rng = np.random.default_rng(seed)
    toks = rng.choice(ids, size=(n, prompt_len + answer_len), p=counts / counts.sum())
    return [D.Sample([int(t) for t in row], prompt_len, "bench") for row in toks]


def step_times(target, tok, samples, args, train_vocab) -> tuple[float, int]:
    cfg = DistillConfig(
        init_from=args.drafter,
        steps=args.steps,
        batch_size=args.batch,
        anchors=args.anchors,
        save_every=0,
        train_vocab=train_vocab,
        log_every=1000,
    )
    stamps: list[float] = []
    said: list[str] = []
    with tempfile.TemporaryDirectory() as d:
        train(target, tok, samples, cfg, Path(d), on_step=lambda s: stamps.append(time.perf_counter()), log=said.append)
    k = next((int(s.split()[4]) for s in said if "training on the" in s), target.vocab_size)
    dt = np.diff(stamps)[2:]
    return statistics.median(dt.tolist()), k


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="default: the demo model (SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--drafter", default=str(ASSET), help="warm start and answer-token ranking (draft_vocab.json)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--length", type=int, default=384, help="tokens per sequence (a quarter of them prompt)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--train-vocab", default="auto", help="the subset side: auto or a token count")
    ap.add_argument("--pool", type=int, default=2000, help="sequences drawn (their ranking picks the subset)")
    ap.add_argument("--out", help="append a markdown record here")
    args = ap.parse_args()
    model, target, tok = bm.load_bench_target(args.model, args.dtype)
    # Enough sequences that their answer-token ranking resembles the real one (the steps use a few).
    samples = samples_from_ranking(Path(args.drafter), args.pool, args.length // 4, args.length - args.length // 4, 0)
    t_full, _ = step_times(target, tok, samples, args, "full")
    t_sub, k = step_times(target, tok, samples, args, args.train_vocab)
    rows = args.batch * args.anchors * 7
    text = "\n".join(
        [
            f"## distill step, --train-vocab {args.train_vocab} vs full: {Path(model).name} ({args.dtype or 'default dtype'}), "  # noqa: E501
            f"{bm.device_stamp()}",
            f"`{' '.join(sys.argv)}` at {time.strftime('%Y-%m-%d %H:%M')}",
            "",
            f"{args.batch} sequences x {args.length} tokens, {args.anchors} blocks each ({rows} draft rows), warm start "  # noqa: E501
            f"from {Path(args.drafter).name}; median of steps 3..{args.steps}",
            "",
            "| train vocab | rows x columns of the loss | s/step | x |",
            "|---|---|---|---|",
            f"| full | {rows} x {target.vocab_size} | {t_full:.3f} | 1.00x |",
            f"| {args.train_vocab} | {rows} x {k} | {t_sub:.3f} | **{t_full / t_sub:.2f}x** |",
            "",
        ]
    )
    bm.emit(text, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
