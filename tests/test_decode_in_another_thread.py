"""A pair loaded in one thread decodes in another, as `serve` does (the model loads in the main
thread, its engine thread decodes). MLX keeps a stream per thread, so an array left lazy at load
(or cached lazily by a kernel) cannot be evaluated by the engine thread: on the H200 a DSpark
request through the server's engine failed so ("There is no Stream(gpu, 0) in current thread"; a
draft vocabulary's head held a lazy transpose). The CPU's non-native path (MLX_DSPARK_KERNELS=
reference) runs the products a GPU or Metal runs through MLX there, so the same failure shows on
the CPU: there every request of the engine failed, warm-up included."""

from __future__ import annotations

import json
import shutil
import threading

import mlx.core as mx
import numpy as np
import pytest
from drafter_fixtures import perm_chain, target, workspace

from mlx_dspark.api import generate
from mlx_dspark.kernels.gpu_source import host_zeros
from mlx_dspark.models import draft_vocab as dv
from mlx_dspark.models.drafters import load_drafter


def _in_thread(fn):
    got: dict = {}

    def run():
        try:
            got["value"] = fn()
        except Exception as e:  # reported to the test thread
            got["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in got:
        raise got["error"]
    return got["value"]


def test_mlx_cannot_evaluate_another_threads_lazy_array_but_host_zeros_travel():
    """What the fix rests on (if MLX changes this, the test says so)."""
    lazy, host = mx.zeros((4,), dtype=mx.bfloat16), host_zeros((4,), mx.bfloat16)
    with pytest.raises(RuntimeError, match="Stream"):
        _in_thread(lambda: mx.eval(lazy + 1))
    assert _in_thread(lambda: (host + 1).tolist()) == [1.0] * 4


def _pair_with_draft_vocab(key, tmp_path, n):
    """The perm target, the drafter of `key` with a draft vocabulary (the chain's tokens), loaded
    in this thread, and a prompt of the chain."""
    ws = workspace()
    tgt, tok = target(ws["target_perm"])
    prompt = [int(t) for t in np.flatnonzero(ws["perm"] >= 0)][:3]
    folder = tmp_path / key
    shutil.copytree(ws[key], folder)
    ranked = [int(t) for t in perm_chain(prompt[-1], n + 4)]
    (folder / dv.FILE).write_text(json.dumps({"ids": ranked, "counts": [1] * len(ranked), "tokens": len(ranked)}))
    d = load_drafter(str(folder), tgt, bits=16, draft_vocab="auto")
    assert d.describe()["draft_vocab"] < tgt.vocab_size
    return tgt, tok, d, prompt


@pytest.mark.parametrize("key", ["perm_dspark", "perm_dflash_zlab"])
@pytest.mark.parametrize("kernels", ["native", "reference"])
def test_a_drafter_with_a_draft_vocabulary_loaded_here_decodes_in_another_thread(key, kernels, tmp_path, monkeypatch):
    if kernels == "reference":
        monkeypatch.setenv("MLX_DSPARK_KERNELS", "reference")
    n = 40
    tgt, tok, d, prompt = _pair_with_draft_vocab(key, tmp_path, n)
    kind = "dspark" if "dspark" in key else "dflash"
    want = generate(tgt, tok, None, prompt_ids=prompt, mode="baseline", max_new_tokens=n)
    got = _in_thread(lambda: generate(tgt, tok, None, prompt_ids=prompt, mode=kind, drafter=d, max_new_tokens=n))
    assert got.tokens == want.tokens and got.text == want.text
    assert got.stats.get("drafter_rounds", 0) > 0


@pytest.mark.parametrize("max_batch", [1, 2])
def test_the_servers_engine_runs_a_drafter_loaded_in_the_main_thread(max_batch, tmp_path, monkeypatch):
    """`serve` as it runs: load here, warm up and decode in the engine thread (the serial path and
    the batch scheduler), on the non-native path; every request equals plain decoding."""
    from mlx_dspark.serve.engine import Engine, GenRequest

    monkeypatch.setenv("MLX_DSPARK_KERNELS", "reference")
    n = 24
    tgt, tok, d, prompt = _pair_with_draft_vocab("perm_dspark", tmp_path, n)
    want = generate(tgt, tok, None, prompt_ids=prompt, mode="baseline", max_new_tokens=n)
    eng = Engine(tgt, tok, mode="dspark", drafter=d, max_batch=max_batch).start()
    try:
        eng.warmup()
        jobs = [eng.submit(GenRequest(prompt_ids=list(prompt), max_tokens=n)) for _ in range(max_batch)]
        for job in jobs:
            ev = None
            while ev is None or ev[0] not in ("done", "error", "cancelled"):
                ev = job.next_event(5.0)
            assert ev[0] == "done", ev
            assert job.outcome.result.tokens == want.tokens and job.outcome.result.text == want.text
    finally:
        eng.stop()
