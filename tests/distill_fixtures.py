"""Shared by the distill tests: the tiny target's shape, fast CLI settings and a short run's options."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, tie=False, scale=1.0)
# Small, fast settings shared by the DSpark and DFlash runs (greedy answers: deterministic data).
FAST_SHARED = [
    "--answer-tokens",
    "64",
    "--batch-size",
    "4",
    "--anchors",
    "16",
    "--layers",
    "1",
    "--temperature",
    "0",
    "--lr",
    "2e-3",
    "--eval-samples",
    "4",
    "--eval-max-tokens",
    "48",
    "--save-every",
    "0",
]
FAST = [*FAST_SHARED, "--markov-rank", "32"]  # DSpark


def cli(args: list[str], timeout: int = 300, cmd: str = "distill") -> subprocess.CompletedProcess:
    """`python -m mlx_dspark <cmd> <args>` in a subprocess, as a user runs it."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "mlx_dspark", cmd, *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def accept(out: Path) -> dict:
    """The mean acceptance per domain that a run's evaluation wrote."""
    res = json.loads((out / "eval.json").read_text())["result"]
    return {d: r["mean_accept"] for d, r in res.items()}


def small_run(tiny, out, *, steps, save_every, prompts, answer_tokens, kind=None, **kw):
    """DistillOptions of a short, deterministic run (greedy answers) on the tiny target; `kind`
    "dflash" for a DFlash drafter (no Markov head), else DSpark."""
    from mlx_dspark.train.data import GenConfig
    from mlx_dspark.train.pipeline import DistillOptions
    from mlx_dspark.train.trainer import DistillConfig

    cfg = DistillConfig(
        kind=kind,
        layers=1,
        markov_rank=None if kind == "dflash" else 16,
        steps=steps,
        batch_size=2,
        anchors=4,
        save_every=save_every,
        lr=2e-3,
        gen=GenConfig(max_new_tokens=answer_tokens, batch_size=16),
    )
    return DistillOptions(
        model=str(tiny), out=str(out), max_train_prompts=prompts, evaluate=False, temperature=0.0, train=cfg, **kw
    )


def assert_same_trained_weights(a_dir: Path, b_dir: Path) -> None:
    a = mx.load(str(a_dir / "train_state" / "trainable.safetensors"))
    b = mx.load(str(b_dir / "train_state" / "trainable.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert np.allclose(np.array(a[k]), np.array(b[k]), atol=1e-6), k


def quiet(s: str) -> None:
    pass


def distill_main(args: list[str]) -> int:
    from mlx_dspark.cli.main import main

    return main(["distill", *args])
