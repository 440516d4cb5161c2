"""Continuous batching under --max-draft auto: the batch's draft switch (decode/batch.DraftGate)
picks drafting or plain batched steps by measured throughput, and output never depends on it
(token ids and text equal the request run alone, CPU float32, real tiny checkpoints)."""

from __future__ import annotations

import pytest
from drafter_fixtures import perm_chain, target, workspace

from mlx_dspark.api import generate, start
from mlx_dspark.decode import batch
from mlx_dspark.decode import costs as cost_curves
from mlx_dspark.decode.costs import Costs
from mlx_dspark.models.drafters import load_drafter

W = batch.DraftGate.WINDOW
FLAT = Costs([1, 2, 4, 8, 16, 32], [0.010, 0.0105, 0.011, 0.012, 0.014, 0.018], t_draft=0.002, origin="given")


def _feed(gate: batch.DraftGate, rows: int, steps: int, rate: dict) -> list[bool]:
    """`steps` steps of a batch of `rows`, each committing at rate[mode] tokens a second (1 s a step)."""
    modes = []
    for _ in range(steps):
        m = gate.drafts(rows)
        modes.append(m)
        gate.record(int(rate[m]), 1.0)
    return modes


def test_gate_measures_both_modes_then_keeps_the_faster_and_holds_longer_while_it_wins():
    gate = batch.DraftGate()
    modes = _feed(gate, 4, 2 * W + 1, {True: 7, False: 8})
    # drafts first (the rows' policies decide), then plain: its first step pays the switch, uncounted
    assert modes == [True] * W + [False] * (W + 1)
    assert gate.mode is False and gate.rate == {True: 7.0, False: 8.0} and gate.hold == gate.HOLD_MIN
    modes = _feed(gate, 4, gate.HOLD_MIN + W + 1, {True: 7, False: 8})
    assert modes == [False] * gate.HOLD_MIN + [True] * (W + 1)  # the hold, then drafts measured again
    assert gate.mode is False and gate.hold == 2 * gate.HOLD_MIN  # plain won again: a longer hold
    # acceptance rose (say, the rows reached code): drafts measured after the hold win, and stay
    modes = _feed(gate, 4, 2 * gate.HOLD_MIN + W + 2, {True: 16, False: 8})
    assert modes == [False] * (2 * gate.HOLD_MIN + 1) + [True] * (W + 1)  # the switch's step, the hold
    assert gate.mode is True and gate.hold == gate.HOLD_MIN


def test_gate_wants_drafts_to_win_by_its_margin_and_ends_a_window_early_when_far_behind():
    gate = batch.DraftGate()
    _feed(gate, 2, 2 * W + 1, {True: 100, False: 99})  # 1% faster: not enough
    assert gate.mode is False
    gate = batch.DraftGate()
    _feed(gate, 2, 2 * W + 1, {True: 110, False: 100})
    assert gate.mode is True
    # plain measured again after the hold, at half drafting's rate: half a window tells
    modes = _feed(gate, 2, gate.HOLD_MIN + 2 + W // 2, {True: 110, False: 50})
    assert modes == [True] * (gate.HOLD_MIN + 1) + [False] * (1 + W // 2)
    assert gate.mode is True and gate.hold == 2 * gate.HOLD_MIN


def test_a_new_row_count_forgets_the_rates_keeps_the_mode_and_cuts_a_long_hold():
    gate = batch.DraftGate()
    rate = {True: 7, False: 8}
    _feed(gate, 4, 2 * W + 1, rate)
    _feed(gate, 4, gate.HOLD_MIN + W + 1, rate)
    _feed(gate, 4, 2 * W, rate)  # the hold doubled; 2 W steps into it
    assert gate.mode is False and gate.hold == 2 * gate.HOLD_MIN
    modes = _feed(gate, 3, gate.HOLD_MIN + W + 1, {True: 15, False: 16})  # a row left
    assert gate.rate == {True: 15.0, False: 16.0}  # both measured again at 3 rows
    assert modes == [False] * gate.HOLD_MIN + [True] * (W + 1) and gate.mode is False


def _perm(seed):
    ws = workspace()
    tgt, tok = target(ws["target_perm"])
    d = load_drafter(str(ws["perm_dspark_noisy"]), tgt, bits=16)
    return tgt, tok, d, [int(t) for t in perm_chain(seed, 6)]


class _Forced(batch.DraftGate):
    """A gate held in one mode, counting the steps it measured."""

    def __init__(self, mode: bool):
        super().__init__()
        self.mode, self.seen = mode, 0

    def drafts(self, rows):
        return self.mode

    def record(self, tokens, seconds):
        self.seen += 1


@pytest.mark.parametrize("drafts", [False, True], ids=["plain", "drafts"])
def test_rows_under_auto_equal_solo_runs_whatever_the_gate_says(drafts, monkeypatch):
    monkeypatch.setattr(cost_curves, "costs_for", lambda target, drafter=None: FLAT)
    tgt, tok, d, _ = _perm(3)
    prompts = [[int(t) for t in perm_chain(s, 6)] for s in (3, 4, 5)]
    budgets = [30, 22, 26]
    solo = [
        generate(tgt, tok, None, prompt_ids=p, mode="dspark", drafter=d, max_new_tokens=n, max_draft="auto")
        for p, n in zip(prompts, budgets)
    ]
    runs = [
        start(tgt, tok, None, prompt_ids=p, mode="dspark", drafter=d, max_new_tokens=n, max_draft="auto")
        for p, n in zip(prompts, budgets)
    ]
    for r in runs:
        r.generation.step()  # the prefill
    gate, most = _Forced(drafts), 0
    while any(not r.generation.done for r in runs):
        live = [r.generation for r in runs if not r.generation.done]
        commits = batch.step_rows(live, gate if len(live) > 1 else None)
        if len(live) > 1:
            most = max(most, max(len(c.tokens) for c in commits))
    for r, s in zip(runs, solo):
        got = r.result()
        assert got.tokens == s.tokens and got.text == s.text
    assert gate.seen > 0 and gate.steps[drafts] == gate.seen
    if drafts:
        assert most > 1  # rounds committed several tokens (the perm drafter is good)
    else:
        assert most == 1  # plain steps only while rows shared a step, one token a row


def test_rows_with_a_fixed_draft_length_ignore_the_gate(monkeypatch):
    tgt, tok, d, _ = _perm(3)
    prompts = [[int(t) for t in perm_chain(s, 6)] for s in (3, 4)]
    runs = [start(tgt, tok, None, prompt_ids=p, mode="dspark", drafter=d, max_new_tokens=24) for p in prompts]
    for r in runs:
        r.generation.step()
    gate, most = _Forced(False), 0
    while all(not r.generation.done for r in runs):
        most = max(most, max(len(c.tokens) for c in batch.step_rows([r.generation for r in runs], gate)))
    assert gate.seen == 0 and most > 1  # asked for the full block every round: they draft
    assert gate.steps == {True: 0, False: 0}  # steps the gate did not decide are not its to count


def test_the_server_counts_its_batched_steps_by_whether_rows_could_draft(monkeypatch):
    """/metrics' mlx_dspark_batched_steps_total: every step two requests shared, drafts allowed or
    not; each answer still equals the request run alone."""
    from mlx_dspark.serve.engine import Engine, GenRequest
    from mlx_dspark.serve.metrics import Metrics

    monkeypatch.setattr(cost_curves, "costs_for", lambda target, drafter=None: FLAT)
    tgt, tok, d, _ = _perm(3)
    prompts = [[int(t) for t in perm_chain(s, 6)] for s in (3, 4)]
    solo = [
        generate(tgt, tok, None, prompt_ids=p, mode="dspark", drafter=d, max_new_tokens=40, max_draft="auto")
        for p in prompts
    ]
    eng = Engine(tgt, tok, mode="dspark", drafter=d, max_draft="auto", max_batch=2).start()
    assert Engine(tgt, tok, mode="dspark", drafter=d).batch_steps() is None  # no batching, no figure
    try:
        jobs = [eng.submit(GenRequest(prompt_ids=p, max_tokens=40)) for p in prompts]
        for job, s in zip(jobs, solo):
            ev = None
            while ev is None or ev[0] not in ("done", "error", "cancelled"):
                ev = job.next_event(5.0)
            assert ev[0] == "done", ev
            res = job.outcome.result  # (the server holds back a split character at the end)
            assert res.tokens == s.tokens and res.text == s.text.rstrip("\ufffd")
        steps = eng.batch_steps()
    finally:
        eng.stop()
    assert steps["drafts"] + steps["plain"] > 0
    text = Metrics().render(busy=False, queue_depth=0, batch=steps)
    assert f'mlx_dspark_batched_steps_total{{drafts="allowed"}} {steps["drafts"]}' in text
    assert f'mlx_dspark_batched_steps_total{{drafts="off"}} {steps["plain"]}' in text
