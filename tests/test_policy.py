"""The draft policy (decode/policy.py) and the measured cost curves (decode/costs.py)."""

from __future__ import annotations

import json
import time

import pytest
from drafter_fixtures import perm_chain, target, workspace

from mlx_dspark.api import generate
from mlx_dspark.decode import costs as cost_curves
from mlx_dspark.decode import modes
from mlx_dspark.decode import policy as pol
from mlx_dspark.decode.costs import Costs
from mlx_dspark.decode.lookup import LookupProposer
from mlx_dspark.models.drafters import load_drafter


def _perm_pair(seed: int):
    """The perm fixture target, its noisy 16-bit DSpark drafter, and a prompt of its chain."""
    ws = workspace()
    tgt, tok = target(ws["target_perm"])
    return tgt, tok, load_drafter(str(ws["perm_dspark_noisy"]), tgt, bits=16), [int(t) for t in perm_chain(seed, 6)]


FLAT = Costs([1, 2, 4, 8, 16, 32], [0.010, 0.0105, 0.011, 0.012, 0.014, 0.018], t_draft=0.002, origin="given")
LINEAR = Costs([1, 2, 4], [0.010, 0.020, 0.040], t_draft=0.006, origin="given")


def test_costs_interpolate_and_extrapolate():
    c = Costs([1, 2, 4], [1.0, 2.0, 3.0])
    assert c.verify(1) == 1.0 and c.verify(3) == 2.5 and c.verify(4) == 3.0
    assert c.verify(6) == pytest.approx(4.0)  # the last slope, (3 - 2) / (4 - 2) per width
    assert Costs([1], [0.5]).verify(4) == 2.0  # one point: linear, the pessimistic guess
    noisy = Costs([1, 2], [1.0, 0.8])  # a busy machine made w2 look cheaper than w1
    assert noisy.verify(2) == 1.0 and noisy.verify(12) == pytest.approx(1.0 + 10 * cost_curves.MIN_SLOPE)


def test_cost_policy_drafts_long_where_verify_is_flat_and_acceptance_high():
    p = pol.CostPolicy(FLAT, cap=32)
    for n in range(0, 400, 8):
        p.result("drafter", 7, 7, n)  # every draft accepted
    assert p.length("drafter", 7, 400) == 7
    assert p.worth_trying("drafter", 7, 400)


def test_cost_policy_parks_a_losing_source_then_probes_with_doubling_gaps():
    p = pol.CostPolicy(LINEAR, cap=32)
    assert p.length("drafter", 7, 100) == 0  # a linear curve never pays
    assert not p.ready("drafter", 100 + pol.PROBE_MIN - 1)
    assert p.ready("drafter", 100 + pol.PROBE_MIN)
    n = 100 + pol.PROBE_MIN
    assert p.worth_trying("drafter", 7, n)
    k = p.length("drafter", 7, n)  # a probe: two rounds in a row for a drafter
    assert k >= 1 and p.counts["probe_rounds"] == 1
    p.result("drafter", k, 0, n + 1)
    assert p.ready("drafter", n + 1) and p.length("drafter", 7, n + 1) >= 1  # its second round
    p.result("drafter", k, 0, n + 2)  # the probe lost: the next gap doubles
    assert p.counts["probe_rounds"] == 1
    assert not p.ready("drafter", n + 2 + 2 * pol.PROBE_MIN - 1)
    assert p.ready("drafter", n + 2 + 2 * pol.PROBE_MIN)


def test_cost_policy_parks_a_losing_source_when_asked_whether_to_try_it():
    """No round is planned only to be declined (that costs a synchronous plain step): a losing
    source is parked by worth_trying itself, and is let through again only for its probe."""
    p = pol.CostPolicy(LINEAR, cap=32)
    assert not p.worth_trying("drafter", 7, 100)
    assert not p.ready("drafter", 100 + pol.PROBE_MIN - 1)
    n = 100 + pol.PROBE_MIN
    assert p.worth_trying("drafter", 7, n) and p.length("drafter", 7, n) >= 1  # the probe
    assert p.counts["probe_rounds"] == 1
    f = pol.CostPolicy(FLAT, cap=32)  # a winning source is let through and drafts
    assert f.worth_trying("drafter", 7, 100) and f.length("drafter", 7, 100) > 0


def test_auto_draft_on_a_losing_machine_never_takes_a_synchronous_plain_step(monkeypatch):
    """Where no round pays (a linear verify curve), the policy declines before the loop reads the
    pending token back: no plain step is a synchronous one after a read-back (the steps right
    after a round feed its known bonus token, and are the only synchronous ones)."""
    from mlx_dspark.decode import loop

    monkeypatch.setattr(cost_curves, "costs_for", lambda target, drafter=None: LINEAR)
    synced = []
    real = loop.Generation._finish_sync

    def finish_sync(self, out, anchor, first):
        synced.append(len(first.tokens))  # > 0: the pending token was read back, then no draft came
        return real(self, out, anchor, first)

    monkeypatch.setattr(loop.Generation, "_finish_sync", finish_sync)
    tgt, tok, d, prompt = _perm_pair(3)
    base = generate(tgt, tok, None, prompt_ids=prompt, mode="baseline", max_new_tokens=60)
    res = generate(tgt, tok, None, prompt_ids=prompt, mode="dspark", drafter=d, max_new_tokens=60, max_draft="auto")
    assert res.tokens == base.tokens and res.text == base.text
    assert res.stats.get("policy") == "cost" and res.stats.get("probe_rounds", 0) >= 1
    assert synced and not any(synced)


# The demo pair's curve on this project's 2-core AMD EPYC with OpenBLAS (float32; 2026-12-05)
OPENBLAS = Costs(
    [1, 2, 3, 4, 6, 8, 12, 16, 24, 32],
    [0.0513, 0.0600, 0.0594, 0.0654, 0.0653, 0.0787, 0.0989, 0.0983, 0.1332, 0.1795],
    t_draft=0.0228,
    origin="given",
    t_plain=0.0421,
)


def test_one_lucky_probe_does_not_resume_a_losing_drafter():
    """A chat prompt the demo drafter cannot draft (auto-cpu.md, fifteenth session): its first round
    lost all 5 drafts. A drafter's probe is two rounds in a row: a lucky first round (3 of 5) and a
    losing second one (0 of 5) leave it below the resume margin, so it stays parked (the gap
    doubles) rather than resume and lose round after round. A probe whose rounds get every draft
    right resumes it."""
    p = pol.CostPolicy(OPENBLAS, cap=32)
    assert p.worth_trying("drafter", 7, 42) and p.length("drafter", 7, 42) == 5  # the prior's round
    p.result("drafter", 5, 0, 43)
    assert not p.worth_trying("drafter", 7, 44)  # parked
    n = 44 + pol.PROBE_MIN
    assert p.worth_trying("drafter", 7, n) and p.length("drafter", 7, n) >= 1
    p.result("drafter", 5, 3, n + 4)  # lucky
    assert p.ready("drafter", n + 4) and p.length("drafter", 7, n + 4) >= 1  # the probe's second round
    p.result("drafter", 5, 0, n + 5)
    _, r = p.best("drafter", 7, steady=True)
    assert r < pol.RESUME_MARGIN * p.plain_rate  # not a win, even priced as a run of rounds
    assert not p.ready("drafter", n + 5 + 2 * pol.PROBE_MIN - 1)  # still parked, its gap doubled
    m = n + 5 + 2 * pol.PROBE_MIN
    assert p.worth_trying("drafter", 7, m) and p.length("drafter", 7, m) >= 1  # the next probe
    p.result("drafter", 5, 5, m + 6)
    assert p.length("drafter", 7, m + 6) >= 1
    p.result("drafter", 5, 5, m + 12)
    assert p.worth_trying("drafter", 7, m + 13) and p.length("drafter", 7, m + 13) > 0  # resumed
    assert p.counts["probe_rounds"] == 2


def test_a_drafter_probe_is_judged_as_the_run_of_rounds_it_would_start():
    """On a launch-bound curve (a large bubble), a drafter that wins its runs of rounds loses its
    lone round among plain steps. Judged on its probe's first round with that round's bubble it
    would stay parked; judged after the probe's second round as a run (no bubble, and a bubble
    less where that round drafted ahead), it resumes."""
    c = Costs(
        [1, 2, 4, 8, 16], [0.0035, 0.0036, 0.0038, 0.0045, 0.0070], t_draft=0.0025, origin="given", t_plain=0.0025
    )
    p = pol.CostPolicy(c, cap=16)
    assert not p.worth_trying("drafter", 7, 10)  # the prior's rate, with the bubble: parked
    n = 10 + pol.PROBE_MIN
    k = p.length("drafter", 7, n)
    assert k >= 1
    p.result("drafter", k, 4, n + 5)
    _, lone = p.best("drafter", 7)  # priced as a round among plain steps
    assert lone < pol.RESUME_MARGIN * p.plain_rate
    p.timed(k + 1, c.t_draft + c.verify(k + 1) + c.bubble)
    assert p.length("drafter", 7, n + 5) >= 1  # the probe's second round
    p.drafted_ahead()
    p.result("drafter", k, 4, n + 10)
    assert p.ready("drafter", n + 11) and p.length("drafter", 7, n + 11) > 0  # resumed
    assert p.counts["probe_rounds"] == 1


def test_cost_policy_learns_acceptance_per_slot():
    p = pol.CostPolicy(FLAT, cap=32)
    for n in range(50):
        p.result("drafter", 7, 2, n)  # slots 1-2 always right, slot 3 always wrong
    s = p.slots["drafter"]
    assert s.get(0) > 0.95 and s.get(1) > 0.95 and s.get(2) < 0.05
    assert p.length("drafter", 7, 60) == 2  # drafting past slot 2 buys nothing


def test_plain_reason_says_why_only_where_speculation_cannot_pay():
    why = pol.plain_reason(LINEAR, 16, drafter=True)
    assert why and "cannot pay" in why and "2.00x" in why
    assert pol.plain_reason(FLAT, 16, drafter=True) is None


def test_slot_acceptance_inverts_tau():
    for p, k in ((0.3, 6), (0.72, 7), (0.9, 15)):
        assert pol.slot_acceptance(pol._Slots(p).tau(k), k) == pytest.approx(p, abs=1e-6)
    assert pol.slot_acceptance(9.0, 7) == 1.0  # more than k + 1 tokens per round: every slot


# A drafter pass costing ~3x a plain step, a verify curve that grows slowly: measured on a quiet
# 2-core AMD EPYC with MLX's reference BLAS (bench/results/auto-cpu.md, fourteenth session).
REFERENCE_BLAS = Costs(
    [1, 2, 3, 4, 6, 8, 16, 32],
    [0.0484, 0.0537, 0.0689, 0.0566, 0.0778, 0.0694, 0.1016, 0.1998],
    t_draft=0.1424,
    t_plain=0.0564,
    origin="given",
)


def test_a_measured_drafter_is_judged_on_what_it_earns_not_on_the_best_case():
    """On a marginal curve the best case (0.9 per slot) says a 7-draft drafter may pay; the
    demo drafter's registered acceptance (3.20 on its typical domain) says it cannot, so auto drops it
    (for lookup): the verdict no longer flips on calibration noise. A drafter measured to earn
    much more, or where verifies are cheap, still passes."""
    assert pol.plain_reason(REFERENCE_BLAS, 7, drafter=True) is None
    why = pol.plain_reason(REFERENCE_BLAS, 7, drafter=True, measured_tau=3.20)
    assert why and "cannot pay" in why
    assert pol.plain_reason(REFERENCE_BLAS, 7, drafter=True, measured_tau=7.5) is None
    assert pol.plain_reason(FLAT, 7, drafter=True, measured_tau=3.20) is None
    assert pol.plain_reason(REFERENCE_BLAS, 32, drafter=False, measured_tau=1.0) is None  # lookup: not a drafter


def test_auto_runs_lookup_where_the_registered_drafter_cannot_pay():
    """modes.auto_verdict (what --mode auto and bench_calibration.py decide): the demo drafter on
    the reference-BLAS curve gives way to lookup and says why; an unmeasured drafter of the same
    shape keeps the best case and runs; where verifies are cheap the demo drafter runs."""
    from types import SimpleNamespace

    from mlx_dspark.models import registry

    demo = SimpleNamespace(source=registry.SMOLLM2_DSPARK, block_drafts=7, kind="dspark")
    runs, said = modes.auto_verdict(REFERENCE_BLAS, demo)
    assert runs == "lookup" and "the drafter cannot pay" in said and "runs lookup" in said
    assert modes.auto_verdict(REFERENCE_BLAS, demo, lookup_drafts=False)[0] == "baseline"
    other = SimpleNamespace(source="/nowhere/unmeasured-drafter", block_drafts=7, kind="dspark")
    assert modes.auto_verdict(REFERENCE_BLAS, other) == ("dspark", None)
    assert modes.auto_verdict(FLAT, demo) == ("dspark", None)


# The demo pair in bf16 on an H100 (auto-h200.md, 22nd session: `generate`'s calibration): a
# drafter pass costs 1.84 plain steps (launch-bound), a verify of 8 tokens 1.48. There the drafter's
# full block lost to plain decoding even on code (3.1 tokens a round) and won only on copy-edits.
H100_BF16 = Costs(
    [1, 2, 3, 4, 6, 8, 12, 16, 24, 32],
    [0.0031, 0.00347, 0.00378, 0.00375, 0.00412, 0.00431, 0.00515, 0.00623, 0.00719, 0.00924],
    t_draft=0.00534,
    t_plain=0.00291,
    origin="given",
)


def test_a_drafter_that_pays_only_on_its_best_domain_gives_way_to_lookup():
    """Auto weighs a measured drafter at what it earns on typical content (its median domain),
    not at a ceiling over its best one: on the H100's curve the demo drafter comes to ~0.97x plain
    decoding there, and auto runs lookup and says so; a ceiling (1.25x its best domain) would
    have sat at ~1.2-1.3x, where calibration noise flipped the verdict from one process to the
    next. On the CPU's curve it earns ~1.6x and runs."""
    from types import SimpleNamespace

    from mlx_dspark.models import registry

    why = pol.plain_reason(H100_BF16, 7, drafter=True, measured_tau=3.20)
    assert why and "a drafter pass 1.84x" in why and "at its typical 3.20 tokens a round 0.9" in why
    for t_draft in (0.0045, 0.0060):  # a noisy calibration (-16% / +12%) keeps the verdict
        noisy = Costs(H100_BF16.widths, H100_BF16.t_verify, t_draft=t_draft, t_plain=0.00291, origin="given")
        assert pol.plain_reason(noisy, 7, drafter=True, measured_tau=3.20)
    assert pol.plain_reason(H100_BF16, 7, drafter=True) is None  # unmeasured: the best case pays
    assert pol.plain_reason(H100_BF16, 32, drafter=False) is None  # lookup's drafts cost no pass
    demo = SimpleNamespace(source=registry.SMOLLM2_DSPARK, block_drafts=7, kind="dspark")
    runs, said = modes.auto_verdict(H100_BF16, demo)
    assert runs == "lookup" and "runs lookup" in said
    assert modes.auto_verdict(OPENBLAS, demo) == ("dspark", None)


def test_the_registry_records_what_the_demo_drafter_earns():
    from mlx_dspark.models import registry

    assert registry.typical_acceptance(registry.SMOLLM2_DSPARK) == 3.20  # the median of 2.32, 3.20, 3.51
    assert registry.typical_acceptance(registry.SMOLLM2_DSPARK + "/") == 3.20  # the same folder
    assert registry.typical_acceptance("deepseek-ai/dspark_qwen3_4b_block7") is None  # published, unmeasured
    row = next(r for r in registry.table() if r["drafter"] == registry.SMOLLM2_DSPARK)
    assert row["accept"] == {"humaneval": 3.20, "mbpp": 3.51, "mt-bench": 2.32}


def test_fixed_policy_keeps_the_lookup_parking_rules():
    p = pol.FixedPolicy()
    for i in range(pol.PARK_AFTER):
        assert p.ready("lookup", 10 + i)
        p.length("lookup", 8, 10 + i, depth=3)
        p.result("lookup", 8, 0, 10 + i)
    last = 10 + pol.PARK_AFTER - 1
    assert not p.ready("lookup", last + pol.PARK_MIN - 1) and p.ready("lookup", last + pol.PARK_MIN)
    assert p.length("lookup", 32, 0, depth=12) == 24  # a deep match earns 2x its depth (cap 32)


def test_fixed_policy_sizes_a_drafters_lookup_drafts_as_lookup_mode_does():
    """Lookup drafts inside a drafter take lookup mode's length rule, not the whole offer (a
    4-deep match verified 33 wide, ~3x a width-8 verify: bench/results/round-profile-cpu.md)."""
    p = pol.FixedPolicy(hybrid=True)
    assert not p.worth_trying("lookup", 8, 0, depth=pol.HYBRID_MIN_DEPTH - 1)
    assert p.length("lookup", 32, 0, depth=pol.HYBRID_MIN_DEPTH) == pol.SHORT_DRAFT
    assert p.length("lookup", 32, 0, depth=12) == 24
    p.result("lookup", 24, 3, 10)  # a long draft that did not earn its width
    assert p.length("lookup", 32, 20, depth=12) == pol.SHORT_DRAFT
    p.result("lookup", pol.SHORT_DRAFT, pol.SHORT_DRAFT, 30)  # all accepted: long drafts again
    assert p.length("lookup", 32, 40, depth=12) == 24


def test_calibration_is_measured_once_stored_and_remeasured_when_the_key_changes(calibration_dir, monkeypatch):
    monkeypatch.setattr("mlx_dspark.machine.OthersShare.share", lambda self: 0.0)  # quiet (test_calibration.py)
    ws = workspace()
    tgt, _ = target(ws["target_qwen3"])
    c = cost_curves.costs_for(tgt)
    assert c.origin == "measured" and c.measured_s <= cost_curves.BUDGET_S + 1
    assert c.widths[:2] == [1, 2] and all(t > 0 for t in c.t_verify)
    assert c.t_plain > 0 and c.plain == min(c.t_plain, c.verify(1))  # pipelined plain steps, measured
    files = list(calibration_dir.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"]["mlx"]
    cost_curves._memo.clear()
    again = cost_curves.costs_for(tgt)
    assert again.origin == "disk" and again.t_verify == c.t_verify and again.t_plain == c.t_plain
    cost_curves._memo.clear()
    monkeypatch.setattr("mlx_dspark.blas.active_blas", lambda: {"name": "other-blas", "path": None, "fast": True})
    third = cost_curves.costs_for(tgt)  # another BLAS: measured again, stored beside the first
    assert third.origin == "measured" and len(list(calibration_dir.glob("*.json"))) == 2


def test_plain_rate_is_the_pipelined_step_where_it_is_cheaper_than_a_synced_forward():
    """On a launch-bound GPU a pipelined plain step costs less than a synchronised width-1 forward:
    rounds must beat that, so a policy that would draft against t_verify(1) parks against t_plain."""
    synced = Costs(FLAT.widths, FLAT.t_verify, t_draft=FLAT.t_draft, origin="given")
    pipelined = Costs(FLAT.widths, FLAT.t_verify, t_draft=FLAT.t_draft, origin="given", t_plain=0.004)
    assert synced.plain == FLAT.verify(1) and pipelined.plain == 0.004
    assert Costs([1], [0.01], t_plain=0.02).plain == 0.01  # never above the synced forward
    s1, s2 = pol.CostPolicy(synced, 8), pol.CostPolicy(pipelined, 8)
    assert s1.plain_rate == pytest.approx(100.0) and s2.plain_rate == pytest.approx(250.0)
    for s in (s1, s2):  # the same acceptance seen by both: half the drafted tokens
        for _ in range(20):
            s.result("drafter", 4, 2, 100)
    assert s1.length("drafter", 8, 200) > 0 and s2.length("drafter", 8, 200) == 0


def test_a_round_that_interrupts_plain_steps_pays_the_pipeline_bubble():
    """Plain decoding builds each step while the one before it runs; a round's synchronised forward
    and the step built after it do not overlap: t_verify(1) - t_plain more per run of rounds. A
    round that follows a round breaks no pipeline, and a curve without a pipelined figure has none."""
    launch_bound = Costs(FLAT.widths, FLAT.t_verify, t_draft=FLAT.t_draft, origin="given", t_plain=0.008)
    assert launch_bound.bubble == pytest.approx(0.002) and FLAT.bubble == 0.0
    assert Costs([1], [0.01], t_plain=0.02).bubble == 0.0  # never negative
    p = pol.CostPolicy(launch_bound, cap=8)
    p.timed(1, 0.008)
    after_plain = p.rate("drafter", 3)
    assert after_plain == pytest.approx(p.slots["drafter"].tau(3) / (0.002 + launch_bound.verify(4) + 0.002))
    p.timed(4, 0.002 + launch_bound.verify(4))
    assert p.rate("drafter", 3) > after_plain
    p.timed(1, 0.008)
    assert p.rate("drafter", 3) == pytest.approx(after_plain, rel=0.02)  # scales moved a little
    # plain_reason weighs the bubble too: the same drafter, the same acceptance, a wider gap
    assert pol.plain_reason(FLAT, 7, drafter=True, measured_tau=2.4) is None
    hidden = Costs(FLAT.widths, [t + 0.004 for t in FLAT.t_verify], t_draft=FLAT.t_draft, origin="given", t_plain=0.010)
    assert pol.plain_reason(hidden, 7, drafter=True, measured_tau=2.4)


def test_a_round_is_timed_from_the_read_back_of_the_token_before_it(monkeypatch):
    """The live correction compares a round with a synchronised forward: its time starts once the
    pending token is read back. Waiting for the plain step in flight is that step's cost (the
    pipelined steps measure it); charged to the round, every round after plain steps looked about
    one plain step dearer than it was."""
    monkeypatch.setattr(cost_curves, "costs_for", lambda target, drafter=None: FLAT)
    tgt, tok, d, prompt = _perm_pair(4)
    seen = []
    real = pol.CostPolicy.timed
    monkeypatch.setattr(pol.CostPolicy, "timed", lambda self, w, s: (seen.append((w, s)), real(self, w, s))[1])
    from mlx_dspark.api import start

    tg = start(tgt, tok, None, prompt_ids=prompt, mode="dspark", drafter=d, max_new_tokens=24, max_draft="auto")
    g = tg.generation
    g.step()  # the prefill: the first token is pending

    class SlowPending:  # the plain step in flight: its token takes 0.3 s to read back
        def __init__(self, arr):
            self.arr = arr

        def item(self):
            time.sleep(0.3)
            return self.arr.item()

        def reshape(self, *shape):
            return self.arr.reshape(*shape)

    g.pending = SlowPending(g.pending)
    t = time.perf_counter()
    g.step()
    assert time.perf_counter() - t >= 0.3
    assert seen and seen[0][0] > 1 and seen[0][1] < 0.3  # a round, timed without the wait


def test_calibration_off_keeps_the_fixed_rules(calibration_dir, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_CALIBRATION", "off")
    ws = workspace()
    tgt, tok = target(ws["target_qwen3"])
    assert cost_curves.costs_for(tgt) is None
    res = generate(
        tgt, tok, None, prompt_ids=[5, 6, 7, 5, 6, 7, 5, 6], mode="lookup", max_new_tokens=12, max_draft="auto"
    )
    assert "policy" not in res.stats and not calibration_dir.exists()


@pytest.mark.parametrize("costs", [FLAT, LINEAR], ids=["flat", "linear"])
def test_auto_draft_is_lossless_in_tokens_and_text(costs, monkeypatch):
    monkeypatch.setattr(cost_curves, "costs_for", lambda target, drafter=None: costs)
    tgt, tok, d, prompt = _perm_pair(3)
    base = generate(tgt, tok, None, prompt_ids=prompt, mode="baseline", max_new_tokens=40)
    for mode in ("dspark", "lookup"):
        res = generate(
            tgt,
            tok,
            None,
            prompt_ids=prompt,
            mode=mode,
            drafter=d if mode == "dspark" else None,
            max_new_tokens=40,
            max_draft="auto",
        )
        assert res.tokens == base.tokens and res.text == base.text, mode
        assert res.stats.get("policy") == "cost"


def test_auto_mode_runs_plain_where_speculation_cannot_pay_and_says_so_once(monkeypatch, capsys):
    monkeypatch.setattr(cost_curves, "costs_for", lambda target, drafter=None: LINEAR)
    modes._said.clear()
    tgt, tok, d, prompt = _perm_pair(5)
    base = generate(tgt, tok, None, prompt_ids=prompt, mode="baseline", max_new_tokens=20)
    for _ in range(2):
        res = generate(tgt, tok, None, prompt_ids=prompt, mode="auto", drafter=d, max_new_tokens=20, max_draft="auto")
        assert res.mode == "baseline" and res.tokens == base.tokens and res.text == base.text
    err = capsys.readouterr().err
    assert err.count("speculation cannot pay") == 1 and "runs plain decoding" in err
    # an explicit mode is obeyed (the policy parks it instead)
    res = generate(tgt, tok, None, prompt_ids=prompt, mode="dspark", drafter=d, max_new_tokens=20, max_draft="auto")
    assert res.mode == "dspark" and res.tokens == base.tokens


def test_lookup_proposer_uses_the_policy_it_is_given():
    p = LookupProposer(policy=pol.CostPolicy(LINEAR, cap=32))
    hist = [1, 2, 3, 4, 1, 2, 3]
    p.begin(None, hist, None)
    assert p.propose(hist, 16, None).tokens == []  # a linear curve: no round, even on a match


def test_auto_mode_falls_back_to_lookup_where_only_the_drafter_cannot_pay(monkeypatch, capsys):
    dear_drafter = Costs(FLAT.widths, FLAT.t_verify, t_draft=0.05, origin="given")  # 5 plain steps a pass
    monkeypatch.setattr(cost_curves, "costs_for", lambda target, drafter=None: dear_drafter)
    modes._said.clear()
    tgt, tok, d, prompt = _perm_pair(7)
    base = generate(tgt, tok, None, prompt_ids=prompt, mode="baseline", max_new_tokens=20)
    res = generate(tgt, tok, None, prompt_ids=prompt, mode="auto", drafter=d, max_new_tokens=20, max_draft="auto")
    assert res.mode == "lookup" and res.tokens == base.tokens and res.text == base.text
    assert "the drafter cannot pay" in capsys.readouterr().err


def test_live_step_times_correct_a_calibration_that_overcharges_rounds():
    """A calibration that measured rounds 30% dearer than they run parks a drafter that pays; the
    loop's timed steps (rounds at their real cost, plain steps at theirs) bring it back."""
    dear = Costs([1, 2, 4, 8], [0.013, 0.0135, 0.014, 0.016], t_draft=0.0026, origin="given", t_plain=0.010)
    p = pol.CostPolicy(dear, cap=8)
    for n in range(0, 200, 4):
        p.result("drafter", 3, (n // 4) % 2, n)  # the first draft accepted every other round: 1.5 a round
    assert p.length("drafter", 7, 200) == 0  # at the calibrated prices a round loses
    true_round = (0.0026 + 0.0135 + dear.bubble) / 1.3  # each round follows a plain step: it pays the bubble
    for i in range(60):
        p.timed(2, true_round)
        p.timed(1, 0.0105)
    n = 200 + pol.PROBE_MAX
    assert p.length("drafter", 7, n) == 1  # the probe
    p.result("drafter", 1, 1, n)
    assert p.ready("drafter", n + 1) and p.length("drafter", 7, n + 1) == 1  # resumed: it pays
    st = p.stats()
    assert st["live_round_scale"] == pytest.approx(1 / 1.3, rel=0.05) and st["live_plain_scale"] > 1.0
    p.timed(2, 100.0)  # a pause: one step moves the correction by at most its bounded share
    assert p.stats()["live_round_scale"] < 1 / 1.3 + pol.LIVE_ALPHA * pol.LIVE_RANGE[1]


def test_the_loop_reports_each_steps_time_to_an_adaptive_policy(monkeypatch):
    """Every decode step's wall time reaches the policy with its width (rounds wider than 1,
    plain steps 1); the output stays plain decoding's."""
    monkeypatch.setattr(cost_curves, "costs_for", lambda target, drafter=None: FLAT)
    tgt, tok, d, prompt = _perm_pair(3)
    seen = []
    real = pol.CostPolicy.timed
    monkeypatch.setattr(pol.CostPolicy, "timed", lambda self, w, s: (seen.append((w, s)), real(self, w, s))[1])
    base = generate(tgt, tok, None, prompt_ids=prompt, mode="baseline", max_new_tokens=32)
    res = generate(tgt, tok, None, prompt_ids=prompt, mode="dspark", drafter=d, max_new_tokens=32, max_draft="auto")
    assert res.tokens == base.tokens and res.text == base.text
    assert 0 < len(seen) <= res.rounds and all(s > 0 for _, s in seen)  # a round's synchronous next step: not timed
    assert sum(w > 1 for w, _ in seen) == res.stats["rounds"] > 0  # every round the policy counted
    assert res.stats["live_round_scale"] != 1.0


def test_rounds_are_priced_and_timed_by_what_came_before_them():
    """After plain steps a round pays the bubble; after a round, none; after a drafter round that
    drafted the next block ahead (drafting.py's before_accept), a drafter round pays a bubble less
    than its two synchronised parts (its verify's build and its pass's hide behind the device),
    lookup does not. The live correction compares each round with that price, so a round timed at
    exactly its price leaves the scale where it was (the bubble is never learnt as a scale)."""
    c = Costs(FLAT.widths, FLAT.t_verify, t_draft=FLAT.t_draft, origin="given", t_plain=FLAT.verify(1) - 0.002)
    b = c.bubble
    assert b == pytest.approx(0.002)
    p = pol.CostPolicy(c, cap=8)
    parts = c.t_draft + c.verify(4)
    p.timed(1, c.plain)
    assert p._round_cost("drafter", 3) == pytest.approx(parts + b)
    p.result("drafter", 3, 3, 10)
    p.timed(4, parts + b)  # a round after plain steps, at its price
    assert p.round_scale == pytest.approx(1.0)
    assert p._round_cost("drafter", 3) == pytest.approx(parts)
    p.drafted_ahead()
    p.result("drafter", 3, 3, 14)
    p.timed(4, parts)  # a round after a round, at its price; it drafted ahead
    assert p.round_scale == pytest.approx(1.0)
    assert p._round_cost("drafter", 3) == pytest.approx(parts - b)
    assert p._round_cost("lookup", 3) == pytest.approx(c.verify(4))
    p.result("drafter", 3, 3, 18)
    p.timed(4, parts - b)  # the round drafted ahead, at its price; this one did not draft ahead
    assert p.round_scale == pytest.approx(1.0) and p.steady_scale == pytest.approx(1.0)
    assert p._round_cost("drafter", 3) == pytest.approx(parts)


def test_a_run_of_rounds_has_its_own_live_scale():
    """Rounds that follow rounds and rounds that follow plain steps are corrected apart: a run
    whose rounds take 30% below their price (a block drafted ahead hides more than the model's
    bubble) teaches the steady scale, and a round among plain steps keeps its own price."""
    c = Costs(FLAT.widths, FLAT.t_verify, t_draft=FLAT.t_draft, origin="given", t_plain=FLAT.verify(1) - 0.002)
    p = pol.CostPolicy(c, cap=8)
    parts = c.t_draft + c.verify(4)
    p.timed(1, c.plain)
    p.result("drafter", 3, 3, 10)
    p.timed(4, parts + c.bubble)  # the run's first round, at its price
    for i in range(60):
        p.result("drafter", 3, 3, 14 + 4 * i)
        p.timed(4, 0.7 * parts)
    assert p.steady_scale == pytest.approx(0.7, rel=0.02) and p.round_scale == pytest.approx(1.0)
    assert p._round_cost("drafter", 3) == pytest.approx(0.7 * parts, rel=0.02)
    assert p.best("drafter", 3, steady=True)[1] == pytest.approx(4 / (0.7 * parts), rel=0.05)
    p.timed(1, c.plain)
    assert p._round_cost("drafter", 3) == pytest.approx(parts + c.bubble)
    assert p.stats()["live_steady_scale"] == pytest.approx(0.7, rel=0.02)


def test_the_next_round_is_expected_only_where_it_would_be_taken():
    """continues(), asked during a round before its result (decode/drafting.py drafts the next
    block ahead only on a yes): a drafter that wins, yes; one whose acceptance fell below what a
    run of rounds needs, no; a parked source, no; a probe's first round, yes (its second round
    follows); its last round, only if it would resume."""
    p = pol.CostPolicy(FLAT, cap=8)
    assert p.continues("drafter", 7)
    for n in range(30):
        p.result("drafter", 7, 0, n)
    assert not p.continues("drafter", 7)
    assert p.length("drafter", 7, 40) == 0  # parked
    assert not p.continues("drafter", 7)
    n = 40 + pol.PROBE_MIN
    assert p.length("drafter", 7, n) >= 1
    assert p.continues("drafter", 7)  # the probe's first round: its second follows
    p.result("drafter", 1, 0, n)
    assert p.length("drafter", 7, n + 1) >= 1
    assert not p.continues("drafter", 7)  # the probe's last round, and it would not resume
    p.result("drafter", 1, 0, n + 1)
    assert not p.ready("drafter", n + 2)


# A launch-bound GPU (an H100, bf16 demo pair, session 26's calibration): a plain step 2.49 ms,
# a synchronised verify of 1 token 3.27 ms (the bubble 0.78), 8 tokens 4.48, a drafter pass 2.74.
H100 = Costs(
    [1, 2, 4, 8, 16], [0.00327, 0.00345, 0.00375, 0.00448, 0.00700], t_draft=0.00274, origin="given", t_plain=0.00249
)


def test_a_drafter_known_to_pay_starts_with_a_run_of_rounds():
    """At the answer's start nothing is measured. With the generic prior the drafter starts
    parked on a launch-bound curve; with what the registry records it earns (3.20 tokens a round
    for the demo drafter, `slot_acceptance`) it starts drafting: its start is judged as the run of
    rounds it begins (drafted ahead: a bubble below its parts), and the round worth_trying lets
    in is the round length takes (no synchronous plain step declined after a read-back)."""
    generic = pol.CostPolicy(H100, cap=16, ahead=True)
    assert not generic.worth_trying("drafter", 7, 10)
    known = pol.CostPolicy(H100, cap=16, drafter_prior=pol.slot_acceptance(3.2, 7), ahead=True)
    assert known.best("drafter", 7)[1] < pol.MARGIN * known.plain_rate  # a lone round among plain steps loses
    assert known.worth_trying("drafter", 7, 10)
    assert known.length("drafter", 7, 10) >= 5


def test_auto_gives_the_policy_the_registered_acceptance_and_whether_it_drafts_ahead(monkeypatch):
    monkeypatch.setattr(cost_curves, "costs_for", lambda target, drafter=None: FLAT)
    tgt, tok, d, prompt = _perm_pair(3)
    prop = modes.make_proposer("dspark", drafter=d)
    monkeypatch.setattr(modes, "_measured_tau", lambda drafter: 3.2)
    monkeypatch.setattr(type(prop), "runs_ahead", lambda self: True)
    prop, _ = modes.apply_auto(tgt, prop, "dspark")
    assert prop.policy.slots["drafter"].prior == pytest.approx(pol.slot_acceptance(3.2, d.block_drafts))
    assert prop.policy._ahead_seen
    monkeypatch.setattr(modes, "_measured_tau", lambda drafter: None)
    prop, _ = modes.apply_auto(tgt, modes.make_proposer("dspark", drafter=d), "dspark")
    assert prop.policy.slots["drafter"].prior == pol.PRIOR["drafter"]


def test_a_drafter_that_drafts_ahead_is_judged_on_its_run_of_rounds():
    """plain_reason with `ahead`: each round of the run is priced a bubble below its synchronised
    parts instead of a bubble above them; on a launch-bound curve that turns the verdict."""
    hidden = Costs(FLAT.widths, [t + 0.004 for t in FLAT.t_verify], t_draft=FLAT.t_draft, origin="given", t_plain=0.010)
    assert pol.plain_reason(hidden, 7, drafter=True, measured_tau=2.4)
    assert pol.plain_reason(hidden, 7, drafter=True, measured_tau=2.4, ahead=True) is None
