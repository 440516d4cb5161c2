"""bench/sim_draft_policy.py: the premise it rests on (greedy acceptance depends on the anchor's
position alone: a recorded trace replays a real run's rounds), and its loop around the real policy
(a perfect drafter runs every round, a useless one parks)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from drafter_fixtures import perm_noisy_pair

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import sim_draft_policy as sim  # noqa: E402

from mlx_dspark.api import generate  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return perm_noisy_pair(tmp_path_factory.mktemp("sim-policy"), 5)


def test_a_recorded_trace_replays_the_rounds_of_a_real_run(pair):
    """The rounds a full-block run takes (accepted drafts per round) are the ones the trace of the
    baseline answer predicts, round for round: acceptance depends on the position alone."""
    tgt, tok, d, prompt = pair
    n = 60
    base = generate(tgt, tok, None, prompt_ids=prompt, mode="baseline", max_new_tokens=n)
    L = sim.accept_trace(tgt, d, prompt, base.tokens)
    assert len(L) == len(base.tokens) - 1 and 0 < sum(L) < d.block_drafts * len(L)  # neither all nor nothing
    run = generate(tgt, tok, None, prompt_ids=prompt, mode="dspark", drafter=d, max_new_tokens=n, lookup_drafts=False)
    assert run.tokens == base.tokens and run.text == base.text
    predicted = [a + 1 for a in sim.rounds_of(L, d.block_drafts)]
    real = list(run.accept_lengths)
    assert len(real) > 5
    assert real[:-1] == predicted[: len(real) - 1]  # the last round may be cut by max_new_tokens


def test_the_loop_around_the_policy_runs_a_perfect_drafter_and_parks_a_useless_one():
    costs = sim.CURVES["h100"]
    truth = sim.Truth(costs, 1.8e-3, 1.6e-3)
    perfect, useless = [7] * 200, [0] * 200
    k7 = sim.simulate(perfect, 7, truth, None, True)
    assert k7["rounds"] == 25 and k7["plain"] == 0  # 8 tokens a round
    # every round after the first drafted ahead: one round after plain steps, 24 steady ones
    assert k7["speed"] == pytest.approx(
        200 * costs.plain / (truth.round(7, True, False) + 24 * truth.round(7, False, True))
    )
    auto = sim.simulate(perfect, 7, truth, sim.new_policy(costs, 7, 3.2), True)
    assert auto["speed"] >= 0.95 * k7["speed"] and auto["probes"] == 0
    lost = sim.simulate(useless, 7, truth, sim.new_policy(costs, 7, 3.2), True)
    assert sim.simulate(useless, 7, truth, None, True)["speed"] < 0.5
    assert lost["speed"] > 0.9 and lost["plain"] > 150 and lost["probes"] >= 2


def test_set_overrides_a_policy_constant_for_the_run_and_refuses_what_is_not_one(monkeypatch):
    """`--set NAME=VALUE` reaches the policy's decisions (PROBE_MIN included: a park reads it when
    made), keeps the constant's type, and refuses a name that is not a numeric constant."""
    pol = sim.pol
    for name in ("PROBE_MIN", "ALPHA"):
        monkeypatch.setattr(pol, name, getattr(pol, name))  # restored after the test
    costs, truth = sim.CURVES["h100"], sim.Truth(sim.CURVES["h100"], 1.8e-3, 1.6e-3)
    useless = [0] * 400
    before = sim.simulate(useless, 7, truth, sim.new_policy(costs, 7, 3.2), True)
    assert sim.set_constants(["PROBE_MIN=64", "ALPHA=0.5"]) == {"PROBE_MIN": 64, "ALPHA": 0.5}
    assert pol.PROBE_MIN == 64 and isinstance(pol.PROBE_MIN, int)
    after = sim.simulate(useless, 7, truth, sim.new_policy(costs, 7, 3.2), True)
    assert after["probes"] < before["probes"]  # parks start 64 tokens long: fewer probes in 400 tokens
    for bad in ("PRIOR=0.5", "alpha=0.1", "ALPHA", "ALPHA=fast", "NO_SUCH=1"):
        with pytest.raises(SystemExit):
            sim.set_constants([bad])
