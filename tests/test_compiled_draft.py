"""A block drafter's compiled greedy pass (models/compiled_draft.py): what it drafts equals the
op-by-op pass (float32, CPU), the generations that use it equal baseline in ids and text, one
trace serves every round of a buffer block, and a changed head drops the traces.

MLX_DSPARK_COMPILE=on makes the CPU compile (auto compiles on a GPU only)."""

from __future__ import annotations

import weakref

import mlx.core as mx
import pytest
from drafter_fixtures import workspace

import mlx_dspark as md
from mlx_dspark.models import compiled_decode, compiled_draft
from mlx_dspark.models.drafters import load_drafter

PROMPT = [5, 9, 23, 41, 7, 12]


def pair(tkey, dkey, monkeypatch, compile_="on"):
    monkeypatch.setenv("MLX_DSPARK_INVARIANT", "kernels")
    monkeypatch.setenv("MLX_DSPARK_COMPILE", compile_)
    monkeypatch.setattr(compiled_draft, "EAGER_PASSES", 0)  # the compiled pass from the first call
    ws = workspace()
    target, tok = md.load_target(str(ws[tkey]), dtype="float32")
    return target, tok, load_drafter(str(ws[dkey]), target, bits=16)


@pytest.mark.parametrize("dkey", ["dspark_qwen3", "dflash_zlab", "dflash_deepspec"])
@pytest.mark.parametrize("with_conf", [False, True])
def test_the_compiled_pass_drafts_what_the_op_by_op_pass_drafts(dkey, with_conf, monkeypatch):
    from mlx_dspark.models.compiled_draft import _greedy

    _, _, d = pair("target_qwen3", dkey, monkeypatch)
    ctx = mx.random.normal((37, d.spec.backbone.context_dim), key=mx.random.key(3))
    eager_state, state = d.new_state(), d.new_state()
    d.ingest(ctx[:30], eager_state)
    d.ingest(ctx[:30], state)
    toks, conf = d.greedy_block(77, ctx[30:], state, with_conf)  # ingests the 7 new rows first
    h = d.block_hidden(77, ctx[30:], eager_state)
    want, _, want_conf = d.sample(h, 77, _greedy, with_conf)
    assert toks.tolist() == mx.stack(want).tolist()
    assert (conf is None) == (want_conf is None)
    if conf is not None:
        assert mx.allclose(conf, want_conf, atol=1e-4).item()
    assert state[0].offset == eager_state[0].offset == 37
    assert state[0].keys.shape[2] % compiled_decode.CAPACITY_STEP == 0


@pytest.mark.parametrize("dkey", ["dspark_qwen3", "dflash_zlab", "dflash_deepspec"])
@pytest.mark.parametrize("vocab", ["full", "subset"])
def test_every_rows_chain_at_once_drafts_what_each_row_drafts_alone(dkey, vocab, monkeypatch):
    """greedy_rows (the chain of B rows as ops over all rows, the batched compiled pass) drafts
    each row's tokens as sample() does for the row alone, with confidences to rounding, over the
    full vocabulary and a draft vocabulary; the native chain is off so both run MLX's ops."""
    from mlx_dspark.models.compiled_draft import _greedy

    _, _, d = pair("target_qwen3", dkey, monkeypatch)
    if vocab == "subset":
        d.restrict_vocab(range(0, d.spec.vocab_size, 3))
    if hasattr(d, "_native_chain"):
        monkeypatch.setattr(d, "_native_chain", lambda U, prev: None)
    B, k, H = 3, d.block_drafts, d.spec.backbone.hidden_size
    hidden = mx.random.normal((B, k, H), key=mx.random.key(11)) * 4
    anchors = mx.array([5, 77, 301], dtype=mx.int32)
    toks, conf = d.greedy_rows(hidden, anchors, with_conf=True)
    assert toks.shape == (B, k) and toks.dtype == mx.int32
    for b in range(B):
        want, _, want_conf = d.sample(hidden[b], anchors[b], _greedy, True)
        assert toks[b].tolist() == mx.stack(want).tolist()
        assert (conf is None) == (want_conf is None)
        if conf is not None:
            assert mx.allclose(conf[b], want_conf, atol=1e-4).item()
    if vocab == "subset":
        assert set(toks.reshape(-1).tolist()) <= set(d.vocab_ids.tolist())


@pytest.mark.parametrize(
    "tkey,dkey",
    [("target_perm", "perm_dspark"), ("target_perm", "perm_dspark_noisy"), ("target_qwen3", "dflash_zlab")],
)
def test_generations_through_compiled_passes_equal_baseline(tkey, dkey, monkeypatch):
    target, tok, d = pair(tkey, dkey, monkeypatch)
    base = md.generate(target, tok, None, prompt_ids=PROMPT, mode="baseline", max_new_tokens=60)
    spec = md.generate(target, tok, None, prompt_ids=PROMPT, mode="auto", drafter=d, max_new_tokens=60)
    assert spec.tokens == base.tokens and spec.text == base.text
    assert spec.rounds > 1 and d._compiled_draft.traces == 1  # one trace for every round of the block
    if dkey == "perm_dspark":  # the agreeing drafter: as many tokens a round as the op-by-op pass
        monkeypatch.setenv("MLX_DSPARK_COMPILE", "off")
        eager = md.generate(target, tok, None, prompt_ids=PROMPT, mode="auto", drafter=d, max_new_tokens=60)
        assert eager.accept_lengths == spec.accept_lengths and d._compiled_draft.traces == 1


def test_a_process_drafts_its_first_passes_op_by_op_then_compiles(monkeypatch):
    """A drafter's first EAGER_PASSES solo passes in a process run op by op, the later ones
    compiled: a generation's warm-up (decode/warmup.py) runs them all, and the trace, before its
    prefill, so every pass of its decode is compiled; the output is plain decoding's."""
    from mlx_dspark.decode import warmup

    target, tok, d = pair("target_perm", "perm_dspark_noisy", monkeypatch)
    monkeypatch.setattr(compiled_draft, "EAGER_PASSES", 3)
    monkeypatch.setattr(warmup, "_warm", weakref.WeakKeyDictionary())
    base = md.generate(target, tok, None, prompt_ids=PROMPT, mode="baseline", max_new_tokens=40)
    traces = []
    real = compiled_draft.CompiledDraft.rows
    monkeypatch.setattr(
        compiled_draft.CompiledDraft, "rows", lambda self, *a: traces.append(self.eager) or real(self, *a)
    )
    spec = md.generate(target, tok, None, prompt_ids=PROMPT, mode="dspark", drafter=d, max_new_tokens=40)
    assert spec.tokens == base.tokens and spec.text == base.text
    assert spec.stats["drafter_rounds"] > 3 + 1
    assert d._compiled_draft.eager == 3 and traces and set(traces) == {3}  # passes 4, 5, ...: compiled
    assert d._compiled_draft.traces == 1
    # the warm-up's compiled pass, then every pass: compiled, or compiled ahead (drafting.py's before_accept)
    assert spec.stats["ahead_rounds"] > 0
    assert len(traces) + spec.stats["ahead_rounds"] == 1 + spec.stats["drafter_rounds"]
    again = md.generate(target, tok, None, prompt_ids=PROMPT, mode="dspark", drafter=d, max_new_tokens=40)
    assert again.tokens == base.tokens  # the next generation's passes are all compiled
    passes = spec.stats["drafter_rounds"] + again.stats["drafter_rounds"]
    assert len(traces) + spec.stats["ahead_rounds"] + again.stats["ahead_rounds"] == 1 + passes


def test_sampled_drafts_and_auto_on_the_cpu_take_the_op_by_op_pass(monkeypatch):
    target, tok, d = pair("target_perm", "perm_dspark_noisy", monkeypatch, compile_="auto")
    assert d.greedy_block(5, None, d.new_state()) is None  # the CPU: not compiled
    monkeypatch.setenv("MLX_DSPARK_COMPILE", "on")
    sampling = md.SamplingParams(temperature=0.8, seed=1)
    md.generate(target, tok, None, prompt_ids=PROMPT, mode="auto", drafter=d, max_new_tokens=24, sampling=sampling)
    assert d._compiled_draft is None or d._compiled_draft.traces == 0


def test_a_new_head_drops_the_traces(monkeypatch):
    _, _, d = pair("target_qwen3", "dspark_qwen3", monkeypatch)
    state = d.new_state()
    d.ingest(mx.random.normal((9, d.spec.backbone.context_dim), key=mx.random.key(1)), state)
    mx.eval(d.greedy_block(3, None, state)[0])
    assert d._compiled_draft.traces == 1
    d.restrict_vocab(range(0, 300))
    assert d._compiled_draft is None
    toks, _ = d.greedy_block(3, None, state)
    assert all(0 <= t < 300 for t in toks.tolist()) and d._compiled_draft.traces == 1


def test_a_pass_that_cannot_run_here_falls_back_to_the_op_by_op_pass(monkeypatch):
    """A backend on which the compiled pass fails (a stand-in raises in its trace): that round's
    drafts come from the op-by-op pass over the rows already ingested, a warning says so, later
    rounds draft op by op, and the generation equals baseline with the drafter's context in step."""
    target, tok, d = pair("target_perm", "perm_dspark", monkeypatch)
    base = md.generate(target, tok, None, prompt_ids=PROMPT, mode="baseline", max_new_tokens=40)

    def broken(self, k, v, keep):
        raise RuntimeError("no such kernel here")

    monkeypatch.setattr(compiled_draft._BlockKV, "write", broken)
    with pytest.warns(UserWarning, match="compiled drafter pass failed here"):
        spec = md.generate(target, tok, None, prompt_ids=PROMPT, mode="auto", drafter=d, max_new_tokens=40)
    assert spec.tokens == base.tokens and spec.text == base.text
    assert d._compiled_draft.failed and compiled_draft.for_drafter(d) is None
    monkeypatch.setenv("MLX_DSPARK_COMPILE", "off")
    eager = md.generate(target, tok, None, prompt_ids=PROMPT, mode="auto", drafter=d, max_new_tokens=40)
    assert spec.accept_lengths == eager.accept_lengths  # the same drafts as the op-by-op pass


@pytest.mark.parametrize("dkey", ["perm_dspark", "perm_dspark_noisy"])
def test_compiled_drafts_stay_on_the_device_until_the_accept_point(dkey, monkeypatch):
    """A compiled greedy draft goes into the verify forward unread: propose() makes no host sync
    (the round's one sync reads the draft with the accept point), and ids, text and tokens per
    round equal the drafts read back first (device_drafts False) and baseline."""
    from mlx_dspark.api import start
    from mlx_dspark.decode.loop import Generation

    target, tok, d = pair("target_perm", dkey, monkeypatch)
    base = md.generate(target, tok, None, prompt_ids=PROMPT, mode="baseline", max_new_tokens=60)
    real_eval, real_plan = mx.eval, Generation.plan_draft

    def run(device: bool):
        tg = start(
            target, tok, None, prompt_ids=PROMPT, mode="dspark", drafter=d, max_new_tokens=60, lookup_drafts=False
        )
        g = tg.generation
        g.proposer.device_drafts = device
        seen = {"device": 0, "host": 0, "evals in propose": 0}
        real_propose = g.proposer.propose

        def propose(*a, **k):
            n = len(evals)
            try:
                return real_propose(*a, **k)
            finally:
                seen["evals in propose"] += len(evals) - n

        def plan_draft(self, draft):
            if draft.size:
                seen["device" if draft.device is not None else "host"] += 1
            return real_plan(self, draft)

        evals = []
        monkeypatch.setattr(mx, "eval", lambda *a, **k: (evals.append(1), real_eval(*a, **k))[1])
        monkeypatch.setattr(Generation, "plan_draft", plan_draft)
        g.proposer.propose = propose
        try:
            res = tg.run()
        finally:
            monkeypatch.setattr(mx, "eval", real_eval)
            monkeypatch.setattr(Generation, "plan_draft", real_plan)
        return res, seen

    off, seen_off = run(False)  # first: it traces the pass, whose first run syncs once
    on, seen_on = run(True)
    assert on.tokens == off.tokens == base.tokens and on.text == off.text == base.text
    assert on.accept_lengths == off.accept_lengths and on.rounds > 1
    assert seen_on["device"] > 0 and seen_on["host"] == 0 and seen_on["evals in propose"] == 0
    assert seen_off["device"] == 0 and seen_off["host"] == seen_on["device"]
    assert seen_off["evals in propose"] >= seen_off["host"]


def test_the_warm_up_traces_the_drafter_pass_before_the_decode(monkeypatch):
    """decode/warmup.py: a process's first generation with a drafter whose pass compiles runs its
    op-by-op passes (EAGER_PASSES) and the pass's trace in a scratch generation at start; the
    decode then traces nothing, neither the drafter's pass nor a verify width, and equals
    baseline in ids and text."""
    from mlx_dspark.api import start
    from mlx_dspark.decode import warmup

    target, tok, d = pair("target_perm", "perm_dspark", monkeypatch)
    monkeypatch.setattr(compiled_draft, "EAGER_PASSES", 2)
    monkeypatch.setattr(warmup, "_warm", weakref.WeakKeyDictionary())
    base = md.generate(target, tok, None, prompt_ids=PROMPT, mode="baseline", max_new_tokens=60)
    run = start(target, tok, None, prompt_ids=PROMPT, mode="dspark", drafter=d, max_new_tokens=60)
    compiled = d._compiled_draft
    assert compiled.traces == 1 and compiled.eager == 2  # two op-by-op passes, then the traced one
    widths = target.compiled_decode.traces
    res = run.run()
    assert compiled.traces == 1 and target.compiled_decode.traces == widths
    assert res.stats["warm_up_s"] > 0 and res.stats["drafter_rounds"] > 1
    assert res.tokens == base.tokens and res.text == base.text
    again = md.generate(target, tok, None, prompt_ids=PROMPT, mode="dspark", drafter=d, max_new_tokens=60)
    assert "warm_up_s" not in again.stats and again.tokens == base.tokens
