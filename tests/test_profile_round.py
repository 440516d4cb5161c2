"""bench/profile_round.py's instrumentation: it changes nothing, adds no sync, restores every
method, and its phases add up to the step (a tiny perm target and its noisy DSpark drafter)."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import pytest
from drafter_fixtures import perm_noisy_pair

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import profile_round as pr  # noqa: E402

from mlx_dspark.api import generate, start  # noqa: E402
from mlx_dspark.decode.lookup import NgramIndex  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tgt, tok, drafter, prompt = perm_noisy_pair(tmp_path_factory.mktemp("profile-round"), 1)
    return tgt, tok, drafter, prompt + prompt  # a repeat: lookup drafts have something to match


@pytest.mark.parametrize("mode", ["baseline", "lookup", "dspark", "dspark-nolookup"])
def test_instrumented_generation(pair, mode):
    tgt, tok, drafter, prompt = pair
    n = 40
    want = generate(tgt, tok, None, prompt_ids=prompt, mode="baseline", max_new_tokens=n).tokens
    kw = {"drafter": drafter} if mode.startswith("dspark") else {}
    if mode == "dspark-nolookup":
        kw["lookup_drafts"] = False
    # a bare run first, as the script's warm-up: once-per-process work (a kernel's self-check) is paid
    assert generate(tgt, tok, None, prompt_ids=prompt, mode=mode.split("-")[0], max_new_tokens=n, **kw).tokens == want
    tg = start(tgt, tok, None, prompt_ids=prompt, mode=mode.split("-")[0], max_new_tokens=n, **kw)
    g = tg.generation
    real_eval, real_sync = mx.eval, NgramIndex.__dict__["sync"]
    prof = pr.Profiler(count_ops=True)
    pr.instrument(prof, g, tgt)
    try:
        res = tg.run()
    finally:
        prof.restore()
    assert res.tokens == want  # the wrappers change no token
    # every wrapper is gone: instance attributes deleted, class / module ones put back
    assert not {"step", "plan_begin", "_commit", "_finish_plain"} & set(vars(g))
    assert "forward" not in vars(tgt) and "block_hidden" not in vars(drafter)
    assert mx.eval is real_eval and NgramIndex.__dict__["sync"] is real_sync
    steps = prof.steps
    assert sum(s["tokens"] for s in steps) == len(res.tokens)
    # exclusive times add up to the steps; the product's own decode_s runs inside our step timer
    total = sum(sum(s["t"].values()) for s in steps)
    assert res.decode_s <= total + 1e-6 and total - res.decode_s < 0.1 * total + 0.05
    kinds = {s["kind"] for s in steps}
    rounds = [s for s in steps if s["kind"] == "drafter round"]
    if mode.startswith("dspark"):
        assert rounds and "plain (pipelined)" not in kinds  # the fixed policy drafts every step
        # the drafter's eval and the accept's eval (and the .item() of a pending token, after the prefill)
        assert all(s["syncs"] == 2 + s.get("pending reads", 0) for s in rounds)
        assert any(s["syncs"] == 2 for s in rounds)
        assert all(s["drafter passes"] == 1 and max(s["widths"]) <= drafter.block_drafts + 1 for s in rounds)
        whole, backbone = prof.drafter_ops[0]
        assert 0 < pr.launches(backbone)[1] < pr.launches(whole)[1]  # the head and Markov chain come on top
    else:
        assert not rounds
    if mode == "dspark-nolookup":
        assert kinds <= {"drafter round", "plain (sync)", "end"}
    if mode == "baseline":
        assert kinds <= {"plain (pipelined)", "end"} and all(s["widths"] in ([1], []) for s in steps)
    assert prof.verify_ops and all(pr.launches(c)[0] > 0 for c in prof.verify_ops.values())
    data = {
        "steps": steps,
        "prompts": 1,
        "decode_s": [res.decode_s],
        "bare_decode_s": [res.decode_s],
        "same": 1,
        "tps": 1.0,
        "drafter_ops": prof.drafter_ops,
        "verify_ops": prof.verify_ops,
    }
    text = "\n".join(pr.mode_report(mode, data, 1.0, None))
    assert "**all steps, per token**" in text and "verify widths" in text
