"""The batching server (serve --max-batch): a short request that joins two long ones is delivered
first, every batched answer equals the request run alone, requests that cannot batch run
serially and say why in x_mlx_dspark, and the KV budget queues what does not fit now and refuses
what never fits."""

from __future__ import annotations

import time

from drafter_fixtures import target, workspace

from mlx_dspark.api import generate
from mlx_dspark.decode.sampling import SamplingParams
from mlx_dspark.serve.engine import Engine, GenRequest, x_block
from mlx_dspark.serve.validate import ApiError


def _perm():
    return target(workspace()["target_perm"])


def _wait(job, timeout=120.0):
    """The Job's final event, with the text it streamed."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        ev = job.next_event(0.5)
        if ev is None:
            continue
        if ev[0] == "text":
            text += ev[1]
            continue
        return ev, text
    raise AssertionError("the job did not finish")


def _solo(t, tok, ids, n, **kw):
    return generate(t, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=n, **kw)


def test_short_request_joining_two_long_ones_returns_first():
    t, tok = _perm()
    longs = [[7, 8, 9], [11, 12, 13, 14]]
    short = [21, 22]
    solo = [_solo(t, tok, p, 160) for p in longs] + [_solo(t, tok, short, 6)]
    eng = Engine(t, tok, mode="baseline", max_batch=4).start()
    try:
        jobs = [eng.submit(GenRequest(prompt_ids=p, max_tokens=160)) for p in longs]
        deadline = time.monotonic() + 60
        while not all(j.commits >= 3 for j in jobs):  # both long ones are decoding
            assert time.monotonic() < deadline
            time.sleep(0.002)
        late = eng.submit(GenRequest(prompt_ids=short, max_tokens=6))
        finals = [_wait(j) for j in jobs + [late]]
    finally:
        eng.stop()
    for (ev, text), s in zip(finals, solo):
        assert ev[0] == "done"
        res = ev[1].result
        assert res.tokens == s.tokens and res.text == s.text.rstrip("\ufffd") == text
    assert late.t_done < min(j.t_done for j in jobs)
    assert all(j.commits > 0 for j in jobs) and jobs[0].t_done > late.t_done
    blk = x_block(eng, late)
    assert blk["batched"] is True and "batch_reason" not in blk


def test_seeded_sampled_request_batches_and_equals_solo():
    t, tok = _perm()
    solo = _solo(t, tok, [5, 6, 7], 12, sampling=SamplingParams(temperature=0.8, seed=3))
    eng = Engine(t, tok, mode="baseline", max_batch=4).start()
    try:
        other = eng.submit(GenRequest(prompt_ids=[9, 10], max_tokens=40))
        job = eng.submit(
            GenRequest(prompt_ids=[5, 6, 7], max_tokens=12, sampling=SamplingParams(temperature=0.8, seed=3))
        )
        (ev, text), _ = _wait(job), _wait(other)
    finally:
        eng.stop()
    assert ev[0] == "done" and ev[1].result.tokens == solo.tokens and text == solo.text.rstrip("\ufffd")
    assert x_block(eng, job)["batched"] is True


def test_what_cannot_batch_runs_serially_and_says_why():
    from mlx_dspark.api import generate as real_generate

    t, tok = _perm()
    calls = []

    def custom(*a, **kw):
        calls.append(1)
        return real_generate(*a, **kw)

    eng = Engine(t, tok, mode="baseline", max_batch=4, generate_fn=custom).start()
    try:
        job = eng.submit(GenRequest(prompt_ids=[5, 6, 7], max_tokens=5))
        ev, text = _wait(job)
    finally:
        eng.stop()
    assert ev[0] == "done" and ev[1].result.tokens == _solo(t, tok, [5, 6, 7], 5).tokens
    assert calls == [1]  # the serial path ran it through the engine's own generate function
    blk = x_block(eng, job)
    assert blk["batched"] is False and "custom generate" in blk["batch_reason"]


def test_max_batch_1_says_so():
    t, tok = _perm()
    eng = Engine(t, tok, mode="baseline", max_batch=1).start()
    try:
        job = eng.submit(GenRequest(prompt_ids=[5, 6, 7], max_tokens=3))
        ev, _ = _wait(job)
    finally:
        eng.stop()
    assert ev[0] == "done"
    blk = x_block(eng, job)
    assert blk["batched"] is False and "--max-batch 1" in blk["batch_reason"]


def test_kv_budget_queues_what_does_not_fit_and_refuses_what_never_fits():
    t, tok = _perm()
    probe = Engine(t, tok, mode="baseline", max_batch=4)
    need = probe.kv_need_mb(probe.submit(GenRequest(prompt_ids=[1, 2, 3], max_tokens=100)))
    eng = Engine(t, tok, mode="baseline", max_batch=4, max_kv_mb=need * 1.5).start()
    try:
        a = eng.submit(GenRequest(prompt_ids=[1, 2, 3], max_tokens=100))
        b = eng.submit(GenRequest(prompt_ids=[4, 5, 6], max_tokens=100))
        huge = eng.submit(GenRequest(prompt_ids=[7, 8], max_tokens=100_000))
        ra, rb, rh = _wait(a), _wait(b), _wait(huge)
    finally:
        eng.stop()
    assert ra[0][0] == rb[0][0] == "done"
    assert b.t_start >= a.t_done  # b waited for a's KV to be given back
    assert rb[0][1].result.tokens == _solo(t, tok, [4, 5, 6], 100).tokens
    assert rh[0][0] == "error" and isinstance(rh[0][1], ApiError) and "--max-kv-mb" in str(rh[0][1])


def test_serve_flags(capsys):
    import pytest

    from mlx_dspark.cli.main import build_parser, main

    args = build_parser().parse_args(["serve"])
    assert args.max_batch == 4 and args.max_kv_mb is None
    args = build_parser().parse_args(["serve", "--max-batch", "2", "--max-kv-mb", "512"])
    assert (args.max_batch, args.max_kv_mb) == (2, 512.0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-batch", "0"])
    assert main(["serve", "--max-kv-mb", "0", "--model", str(workspace()["target_perm"])]) != 0
    err = capsys.readouterr().err
    assert "--max-kv-mb must be positive" in err and "Traceback" not in err
