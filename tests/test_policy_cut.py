"""CostPolicy.cut (decode/policy.py): a DSpark block cut by its confidence head, per round."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from drafter_fixtures import perm_chain, target, workspace

from mlx_dspark.api import generate
from mlx_dspark.decode import costs as cost_curves
from mlx_dspark.decode import policy as pol
from mlx_dspark.decode.costs import Costs
from mlx_dspark.decode.drafting import DrafterProposer
from mlx_dspark.models.drafters import load_drafter

FLAT = Costs([1, 2, 4, 8, 16], [0.010, 0.0102, 0.0104, 0.0108, 0.0116], t_draft=0.002, origin="given")
# The demo pair's CPU curve (OpenBLAS, seconds): a first draft costs a third of a step, the next
# few are nearly free, past 4 each costs more again.
CPU = Costs(
    [1, 2, 3, 4, 6, 8, 12, 16],
    [0.0423, 0.0563, 0.0559, 0.0569, 0.0621, 0.0743, 0.0863, 0.0992],
    t_draft=0.0154,
    origin="given",
    t_plain=0.0454,
)


def test_a_sure_cheap_block_is_kept_whole_and_a_hopeless_one_cut_to_its_first_slot():
    assert pol.CostPolicy(FLAT, cap=16).cut("drafter", [0.97] * 7) == 7
    assert pol.CostPolicy(CPU, cap=16).cut("drafter", [0.97] * 7) == 7
    # The pass is paid for and a round of nothing would cost a synchronous plain step: one draft
    # (two on the CPU curve, whose width 3 measured no dearer than width 2: a free slot).
    assert pol.CostPolicy(FLAT, cap=16).cut("drafter", [0.005] * 7) == 1
    assert pol.CostPolicy(CPU, cap=16).cut("drafter", [0.05] * 7) == 2
    assert pol.CostPolicy(CPU, cap=16).cut("drafter", []) == 0
    # A shaky first slot and sure ones after it: worth a verify only because of what follows.
    assert pol.CostPolicy(CPU, cap=16).cut("drafter", [0.5, 0.95, 0.95, 0.02, 0.02, 0.02, 0.02]) == 3


def test_the_cut_follows_the_verify_curve():
    """The same confidences: cut shorter where each extra width costs more."""
    conf = [0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]
    flat = pol.CostPolicy(FLAT, cap=16).cut("drafter", conf)
    steep = pol.CostPolicy(Costs([1, 2, 8], [0.010, 0.016, 0.052], t_draft=0.002, origin="given"), cap=16)
    assert flat >= 6 and 0 < steep.cut("drafter", conf) < 3


@pytest.mark.parametrize("seed", range(40))
def test_slot_j_is_decided_by_the_confidences_up_to_j_only(seed):
    """What sampled drafts need to stay exact: the cut at k never reads a confidence past slot k,
    so any confidences after it leave the cut where it is; and more confidence never cuts shorter."""
    rng = random.Random(seed)
    conf = [rng.random() for _ in range(7)]
    k = pol.CostPolicy(CPU, cap=16).cut("drafter", conf)
    for _ in range(10):
        other = conf[: k + 1] + [rng.random() for _ in range(6 - k)]
        assert pol.CostPolicy(CPU, cap=16).cut("drafter", other) == k
    higher = [min(1.0, c + rng.random() * (1 - c)) for c in conf]
    assert pol.CostPolicy(CPU, cap=16).cut("drafter", higher) >= k


def _perm_pair(seed: int):
    ws = workspace()
    tgt, tok = target(ws["target_perm"])
    return tgt, tok, load_drafter(str(ws["perm_dspark_noisy"]), tgt, bits=16), [int(t) for t in perm_chain(seed, 6)]


def test_the_proposer_drafts_the_whole_block_where_the_head_is_sure():
    """The live per-slot averages alone would verify 1 or 2 drafts; the head (0.998 on every slot
    of this drafter) keeps the whole block."""
    tgt, tok, d, prompt = _perm_pair(3)
    p = pol.CostPolicy(CPU, cap=16)
    for n in range(40):
        p.result("drafter", 2, 1, n)  # slot 0 always right, slot 1 always wrong
    assert p.length("drafter", 7, 50) <= 2
    prop = DrafterProposer(d, lookup_drafts=False, policy=p)
    prop.begin(tgt, prompt[:-1], mx.zeros((len(prompt) - 1, d.spec.backbone.context_dim)))
    draft = prop.propose(prompt, 7, None)
    assert len(draft.tokens) == 7 and prop.counters["truncated_rounds"] == 0
    fixed = DrafterProposer(d, lookup_drafts=False, confidence_threshold=0.5, policy=pol.CostPolicy(CPU, cap=16))
    assert not fixed._cuts(None)  # an explicit threshold keeps DeepSpec's rule


def test_a_compiled_pass_that_keeps_its_drafts_on_the_device_is_not_cut(monkeypatch):
    """The GPU's greedy round reads its drafts with the accept point (one sync): no confidences
    on the host to cut with, so the block goes as the per-slot averages size it."""
    from mlx_dspark.models import compiled_draft

    tgt, _, d, _ = _perm_pair(3)
    prop = DrafterProposer(d, lookup_drafts=False, policy=pol.CostPolicy(CPU, cap=16))
    assert prop._cuts(None)
    monkeypatch.setattr(compiled_draft, "for_drafter", lambda drafter: object())
    assert not prop._cuts(None)


@pytest.mark.parametrize("costs", [CPU, FLAT], ids=["cpu", "flat"])
def test_cut_rounds_are_lossless_in_tokens_and_text(costs, monkeypatch):
    monkeypatch.setattr(cost_curves, "costs_for", lambda target, drafter=None: costs)
    tgt, tok, d, prompt = _perm_pair(5)
    base = generate(tgt, tok, None, prompt_ids=prompt, mode="baseline", max_new_tokens=48)
    res = generate(tgt, tok, None, prompt_ids=prompt, mode="dspark", drafter=d, max_new_tokens=48, max_draft="auto")
    assert res.tokens == base.tokens and res.text == base.text
    assert res.stats["policy"] == "cost" and res.stats["rounds"] > 0


def test_a_doubtful_head_cuts_every_round_and_the_output_stays_plain_decodings(tmp_path, monkeypatch):
    """The same agreeing drafter with a head that says 0.0025 on every slot: each round keeps
    only its first slot (and the free second one of the CPU curve), counted as truncated."""
    from drafter_fixtures import write_perm_dspark

    monkeypatch.setattr(cost_curves, "costs_for", lambda target, drafter=None: CPU)
    ws = workspace()
    tgt, tok = target(ws["target_perm"])
    d = load_drafter(str(write_perm_dspark(tmp_path / "doubtful", ws["target_perm"], ws["perm"], conf_bias=-6.0)), tgt)
    prompt = [int(t) for t in perm_chain(5, 6)]
    base = generate(tgt, tok, None, prompt_ids=prompt, mode="baseline", max_new_tokens=40)
    res = generate(tgt, tok, None, prompt_ids=prompt, mode="dspark", drafter=d, max_new_tokens=40, max_draft="auto")
    assert res.tokens == base.tokens and res.text == base.text
    rounds = res.stats["drafter_rounds"]
    assert rounds > 5 and res.stats["truncated_rounds"] >= rounds - 1  # the last block: capped by the tokens left
    assert res.stats["drafter_proposed"] <= 2 * rounds and res.stats["cut_slots"] > 0
