"""The shipped DFlash drafter of the demo target, run as a user runs it: `--mode dflash` on the CLI
with no --model or --drafter, and the Python API's load_dflash_pair / dflash_generate with the
registry. Each run must equal plain greedy decoding in tokens and in text, and actually draft."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mlx_dspark.models.demo import find_demo_gguf
from mlx_dspark.models.registry import SMOLLM2_DFLASH, SMOLLM2_DSPARK, pairs_for

DEMO = find_demo_gguf()
needs_demo = pytest.mark.skipif(
    DEMO is None, reason="the demo GGUF is not here: run `python -m mlx_dspark.models.demo fetch` (CI does)"
)
PROMPT = "Write a Python function that returns the n-th Fibonacci number."
# Auto's verdict on whether drafting pays is the calibration's (tests/test_policy.py); here the
# drafter must run, so the measured cap is off and each mode drafts as asked.
ENV = {**os.environ, "MLX_DSPARK_CALIBRATION": "off"}


def _generate(*args) -> dict:
    r = subprocess.run(
        [sys.executable, "-m", "mlx_dspark", "generate", "--prompt", PROMPT, "--max-new-tokens", "40", "--json", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@needs_demo
def test_mode_dflash_on_the_demo_runs_the_shipped_drafter_losslessly():
    base = _generate("--mode", "baseline")
    flash = _generate("--mode", "dflash")
    assert flash["mode"] == "dflash" and flash["drafter"] == SMOLLM2_DFLASH
    assert flash["tokens"] == base["tokens"] and flash["text"] == base["text"]
    # It drafts and the target keeps some of it: fewer rounds than tokens.
    assert flash["stats"]["drafter_accepted"] > 0 and flash["rounds"] < len(flash["tokens"])


@needs_demo
def test_auto_on_the_demo_keeps_dspark_first():
    auto = _generate()
    assert auto["mode"] == "dspark" and auto["drafter"] == SMOLLM2_DSPARK


@needs_demo
def test_load_dflash_pair_and_dflash_generate_use_the_registry(monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_CALIBRATION", "off")
    from mlx_dspark.api import generate
    from mlx_dspark.pairs import dflash_generate, load_dflash_pair

    target, tok, drafter, cfg = load_dflash_pair(str(DEMO[0]), dtype="float32")
    assert drafter.kind == "dflash" and drafter.source == SMOLLM2_DFLASH
    assert cfg["mode"] == "dflash" and cfg["drafter"] == SMOLLM2_DFLASH
    [pair] = pairs_for(target, "dflash")
    assert pair.drafter == SMOLLM2_DFLASH and pair.measured and pair.reproduce and dict(pair.accept)["mbpp"] > 2
    res = dflash_generate(target, tok, drafter, PROMPT, max_new_tokens=40)
    base = generate(target, tok, PROMPT, mode="baseline", max_new_tokens=40)
    assert res.mode == "dflash" and res.tokens == base.tokens and res.text == base.text
    assert max(res.accept_lengths) > 1


def test_models_lists_the_demo_dflash_drafter_as_measured():
    r = subprocess.run([sys.executable, "-m", "mlx_dspark", "models", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["pairs"]
    [row] = [x for x in rows if x["mode"] == "dflash" and x["target"] == "smollm2-135m-instruct"]
    assert "dflash-smollm2-135m-instruct" in row["drafter"]
    assert row["measured"].startswith("CPU float32") and "bench_dflash.py" in row["reproduce"]
