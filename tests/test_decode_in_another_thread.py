"""A pair loaded in one thread decodes in another, as `serve` does (the model loads in the main
thread, its engine thread decodes). MLX keeps a stream per thread, so an array left lazy at load
(or cached lazily by a kernel) cannot be evaluated by the engine thread: on the H200 every DSpark
request through the server failed so ("There is no Stream(gpu, 0) in current thread"; a draft
vocabulary's head held a lazy transpose). The CPU's non-native path (MLX_DSPARK_KERNELS=reference)
runs the products a GPU or Metal runs through MLX there, so the same failure shows on the CPU."""

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


@pytest.mark.parametrize("key", ["perm_dspark", "perm_dflash_zlab"])
@pytest.mark.parametrize("kernels", ["native", "reference"])
def test_a_drafter_with_a_draft_vocabulary_loaded_here_decodes_in_another_thread(key, kernels, tmp_path, monkeypatch):
    if kernels == "reference":
        monkeypatch.setenv("MLX_DSPARK_KERNELS", "reference")
    ws = workspace()
    tgt, tok = target(ws["target_perm"])
    normal = [int(t) for t in np.flatnonzero(ws["perm"] >= 0)]
    prompt, n = normal[:3], 40
    folder = tmp_path / key
    shutil.copytree(ws[key], folder)
    ranked = [int(t) for t in perm_chain(prompt[-1], n + 4)]
    (folder / dv.FILE).write_text(json.dumps({"ids": ranked, "counts": [1] * len(ranked), "tokens": len(ranked)}))
    kind = "dspark" if "dspark" in key else "dflash"
    d = load_drafter(str(folder), tgt, bits=16, draft_vocab="auto")  # loaded in this thread
    assert d.describe()["draft_vocab"] < tgt.vocab_size
    want = generate(tgt, tok, None, prompt_ids=prompt, mode="baseline", max_new_tokens=n)
    got = _in_thread(lambda: generate(tgt, tok, None, prompt_ids=prompt, mode=kind, drafter=d, max_new_tokens=n))
    assert got.tokens == want.tokens and got.text == want.text
    assert got.stats.get("drafter_rounds", 0) > 0
