"""Every draft-length decision of every proposer: how long a draft, and whether to draft at all.

A proposer holds one `DraftPolicy` and asks it, per round and per draft source ("drafter": a
DSpark/DFlash block; "lookup": a free n-gram continuation), whether a round may be spent and how
many of the offered tokens to verify. Two policies exist:

FixedPolicy (`max_draft` an integer, or the Python API's default None): the rules the proposers
  always had, kept here so that no proposer carries its own.
  * drafter: every round, the offered block (capped by max_draft).
  * lookup (the lookup mode): short matches (depth < LONG_DEPTH) are tried only while they pay
    (a running rate of short rounds that commit a draft; below SHORT_MIN_RATE one probe every
    SHORT_PROBE_EVERY tokens); after PARK_AFTER fruitless rounds in a row it parks for a while
    (doubling, PARK_MIN..PARK_MAX tokens); a long draft (depth >= LONG_DEPTH earns ~2x its depth)
    that was mostly rejected cuts back to the short length until one succeeds.
  * lookup inside a drafter (hybrid): a match at least HYBRID_MIN_DEPTH deep replaces the drafter
    pass, as long as lookup mode's rule says (short, or 2x a deep match's depth while long drafts
    earn their width); after HYBRID_PARK_AFTER rejected first tokens in a row it parks
    (HYBRID_PARK_MIN..MAX).

CostPolicy (`--max-draft auto`, the CLI default): the measured cost model (decode/costs.py)
  tok/s = tau(k) / (t_draft + t_verify(k + 1)), tau(k) = 1 + sum_{j<=k} prod_{i<=j} p_i,
  with p_i the live acceptance of draft slot i given slot i-1 was accepted (an exponential
  average per slot and per source, from a prior: for a drafter the registry has measured, the
  per-slot acceptance of what it earns on its typical domain). Each round takes the k that maximizes it,
  compared with plain decoding's 1 / t_plain (a pipelined step). A round that follows plain steps
  also pays `Costs.bubble`: the step after it is built while the device waits, which plain
  decoding hides (t_verify(1) - t_plain); a round that follows a round does not, and a drafter
  round whose block was drafted ahead (decode/drafting.py) pays a bubble less. Where no k beats
  plain by MARGIN, the source parks (a drafter at the answer's start, among plain steps, is judged
  on the run of rounds it would begin: the first round's bubble is paid once): the loop takes pipelined
  plain steps, and a probe every
  `park` tokens (doubling from PROBE_MIN to PROBE_MAX while probes lose, back to PROBE_MIN when one
  wins) keeps p_i live: one round for lookup, two in a row for a drafter (PROBE_ROUNDS), judged
  after the second as the run of rounds it would start (no bubble; a bubble less where the
  second drafted ahead), so a drafter that wins its runs is not kept parked by its probes' price.
  A probe "wins" only when it leaves the source RESUME_MARGIN ahead: one lucky draft must not
  resume a source that then loses several rounds in a row (hysteresis). The curve is corrected
  live: the loop reports each step's wall time (`timed`; a round's from the moment the token
  before it is read back, as the calibration times a synchronised forward), and an exponential
  average of measured over calibrated cost scales each side: plain steps, rounds after plain
  steps, and rounds after rounds (a run, where a block drafted ahead hides more than the bubble
  the model takes off). A round of a drafter that drafts ahead asks `continues` whether the next
  step will be a round of it; only then is the next block drafted ahead (a block no round uses
  holds the device in front of the plain step after it).
  Per round: a drafter with a confidence head whose drafts are read on the host drafts its whole
  block, and `cut` keeps the prefix worth verifying: the first slot (the pass is paid for), and
  slot j > 0 when some continuation from it, each later slot accepted with slot j's confidence
  c_j, gains more expected tokens than its extra verify width costs at plain decoding's rate R:
  sum_{j<=i<k2} prod_{l<=i} c_l > R * (t_verify(k2 + 1) - t_verify(j + 1)). Only confidences up
  to slot j decide slot j, so sampled drafts stay exact. Replayed on recorded rounds of the demo
  pair (bench/replay_draft_policy.py, the CPU's curve) it commits 5-10% more per unit of modeled
  time than the per-slot averages alone, over 20 eval prompts (a live calibration of the
  confidences measured worse; a rate taken from the averages, no better).

`plain_reason(costs)` says when speculation cannot pay on this machine at all, even with very high
acceptance at the best width (for a drafter whose acceptance the registry records: at what it
earns on its typical domain): auto mode then runs lookup or plain decoding and says so once.
The same decisions apply on any device: only the measured curve differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .costs import Costs

# FixedPolicy: lookup mode
SHORT_DRAFT = 8
LONG_DEPTH = 8
PARK_AFTER = 3
PARK_MIN, PARK_MAX = 8, 256
SHORT_MIN_RATE = 0.5
SHORT_PROBE_EVERY = 32
# FixedPolicy: lookup drafts inside a drafter
HYBRID_MIN_DEPTH = 4
HYBRID_PARK_AFTER = 2
HYBRID_PARK_MIN, HYBRID_PARK_MAX = 16, 512
# CostPolicy
# Lookup priors sit below what bench/bench_lookup_depth.py measured (auto-cpu.md): cautious.
PRIOR = {"drafter": 0.6, "lookup": 0.5, "lookup-long": 0.8}
ALPHA = 0.25
MARGIN = 1.03  # a round must beat plain decoding by 3% in expectation
RESUME_MARGIN = 1.10  # a parked source resumes when a probe leaves it 10% ahead (hysteresis)
LIVE_ALPHA = 0.1  # live cost correction: the weight of one timed step
LIVE_RANGE = (0.5, 2.0)  # bounds of a live correction (a step that hit a pause or a first-call cost)
PROBE_MIN, PROBE_MAX = 16, 256
# Rounds in a row per probe, by source. A drafter's probe is two rounds: the first follows plain
# steps (it pays the bubble and has no block drafted ahead), the second is priced as the run of
# rounds a resume would start; the resume is judged after it, on both rounds' acceptance.
PROBE_ROUNDS = {"drafter": 2}
CONF_MAX = 0.98  # a confidence is capped here: no slot is a sure thing
BEST_CASE_P = 0.9  # plain_reason: acceptance no real drafter beats, per slot
BEST_CASE_GAIN = 1.25  # plain_reason: what the best case must gain over plain decoding
TYPICAL_GAIN = 1.10  # plain_reason: what a measured drafter must gain at its typical acceptance


class DraftPolicy:
    """The interface the proposers use (all counts in tokens of history)."""

    adaptive = False

    def ready(self, source: str, n_hist: int) -> bool:
        """May `source` be asked for a round now (not parked)?"""
        return True

    def worth_trying(self, source: str, offered: int, n_hist: int, depth: int = 0) -> bool:
        """Would `length` take a round from this offer? (`wants_round` asks before the pending
        token is read back; CostPolicy parks a losing source here, so that no round is planned
        only to be declined.)"""
        return offered > 0 and self.ready(source, n_hist)

    def length(self, source: str, offered: int, n_hist: int, depth: int = 0) -> int:
        """How many of the `offered` draft tokens to verify (0: take a plain step instead)."""
        return offered

    def result(self, source: str, proposed: int, accepted: int, n_hist: int, depth: int = 0) -> None:
        """A verified round of `source` (a lookup match `depth` deep): `accepted` of `proposed`
        drafts survived."""

    def timed(self, width: int, seconds: float) -> None:
        """The loop's wall time of one step that verified `width` tokens (1: a plain step; more:
        the round of the last `result`, its drafter pass included)."""

    def continues(self, source: str, offered: int) -> bool:
        """Asked during a round of `source` (before its result): is the next step likely a round
        of it too? (decode/drafting.py drafts the next block ahead only then: a block no round
        uses holds the device in front of the plain step that follows.)"""
        return True

    def drafted_ahead(self) -> None:
        """The round in flight drafted the next block ahead (decode/drafting.py's before_accept)."""

    def prefer_lookup(self, lookup_len: int, depth: int, drafter_len: int) -> bool:
        """Hybrid proposers: spend this round on the free lookup draft rather than the drafter?"""
        return depth >= HYBRID_MIN_DEPTH

    # Cutting a drafted block by its confidences (a drafter with a confidence head, drafts read
    # on the host): `cuts_by_confidence` policies have `length` offer the whole block and `cut`
    # keep its worthwhile prefix.
    cuts_by_confidence = False

    def cut(self, source: str, confidences: list[float]) -> int:
        """How many leading slots of a drafted block to verify, from the drafter's confidences
        (sigmoid of the head's logits, one per drafted slot)."""
        return len(confidences)

    def stats(self) -> dict:
        return {}


# ---------------------------------------------------------------------------- fixed rules
class FixedPolicy(DraftPolicy):
    """The rules of a fixed cap (see the module docstring)."""

    def __init__(self, hybrid: bool = False, short_draft: int = SHORT_DRAFT, long_draft: int = 32):
        self.hybrid = hybrid
        self.short_draft, self.long_draft = short_draft, long_draft
        self.parked_until = 0
        self.park_len = HYBRID_PARK_MIN if hybrid else PARK_MIN
        self.misses = 0
        self.long_ok = True
        self.short_rate = 1.0
        self.next_short_probe = 0
        self._last_long = self._last_short = False

    def ready(self, source: str, n_hist: int) -> bool:
        return source == "drafter" or n_hist >= self.parked_until

    def worth_trying(self, source: str, offered: int, n_hist: int, depth: int = 0) -> bool:
        if offered <= 0 or not self.ready(source, n_hist):
            return False
        if source == "drafter":
            return True
        if self.hybrid:
            return depth >= HYBRID_MIN_DEPTH
        if depth >= LONG_DEPTH or self.short_rate >= SHORT_MIN_RATE:
            return True
        return n_hist >= self.next_short_probe

    def length(self, source: str, offered: int, n_hist: int, depth: int = 0) -> int:
        if source == "drafter":
            return offered
        # lookup drafts, alone or inside a drafter: short unless the match is deep (a hybrid's
        # lookup round took the whole offer, 32 wide for any 4-deep match: 3x a width-8 verify)
        k = self.short_draft
        self._last_long, self._last_short = False, depth < LONG_DEPTH
        if depth >= LONG_DEPTH and self.long_ok:
            k = max(k, min(self.long_draft, 2 * depth))
            self._last_long = True
        return min(k, offered)

    def result(self, source: str, proposed: int, accepted: int, n_hist: int, depth: int = 0) -> None:
        if source == "drafter" or proposed == 0:
            return
        if self.hybrid:
            self._park(accepted, n_hist, HYBRID_PARK_AFTER, HYBRID_PARK_MIN, HYBRID_PARK_MAX)
        else:
            self._short_result(accepted, n_hist)
            self._park(accepted, n_hist, PARK_AFTER, PARK_MIN, PARK_MAX)
        if self._last_long:
            self.long_ok = accepted * 2 >= proposed  # long drafts must earn their width
        elif accepted == proposed:
            self.long_ok = True

    def _short_result(self, accepted: int, n_hist: int) -> None:
        if self._last_short:
            self.short_rate = 0.75 * self.short_rate + 0.25 * (1.0 if accepted else 0.0)
            if not accepted and self.short_rate < SHORT_MIN_RATE:
                self.next_short_probe = n_hist + SHORT_PROBE_EVERY

    def _park(self, accepted: int, n_hist: int, after: int, lo: int, hi: int) -> None:
        if accepted == 0:
            self.misses += 1
            if self.misses >= after:
                self.parked_until = n_hist + self.park_len
                self.park_len = min(2 * self.park_len, hi)
                self.misses = 0
        else:
            self.misses = 0
            self.park_len = max(lo, self.park_len // 2)


# ---------------------------------------------------------------------------- cost model
@dataclass
class _Slots:
    """Per-slot conditional acceptance p_i of one draft source."""

    prior: float
    p: list[float] = field(default_factory=list)

    def get(self, i: int) -> float:
        return self.p[i] if i < len(self.p) else (self.p[-1] if self.p else self.prior)

    def tau(self, k: int) -> float:
        t, run = 1.0, 1.0
        for i in range(k):
            run *= self.get(i)
            t += run
        return t

    def update(self, proposed: int, accepted: int) -> None:
        while len(self.p) < proposed:
            self.p.append(self.get(len(self.p)))
        for i in range(min(accepted + 1, proposed)):
            x = 1.0 if i < accepted else 0.0
            self.p[i] += ALPHA * (x - self.p[i])


@dataclass
class _Park:
    until: int = 0
    every: int = field(default_factory=lambda: PROBE_MIN)  # read when made, as every constant here is
    probing: int = 0  # rounds left in the probe under way


class CostPolicy(DraftPolicy):
    """Draft lengths from the measured cost curve and live acceptance (module docstring)."""

    adaptive = True

    def __init__(self, costs: Costs, cap: int, drafter_prior: float | None = None, ahead: bool = False):
        """`drafter_prior`: the drafter's per-slot acceptance where it is known (the registry's
        typical domain, `slot_acceptance`), else PRIOR's; `ahead`: its rounds draft ahead here
        (decode/drafting.py's runs_ahead), so a run of its rounds is priced so from the start."""
        self.costs = costs
        self.cap = max(1, int(cap))
        priors = dict(PRIOR, **({"drafter": drafter_prior} if drafter_prior else {}))
        self.slots = {s: _Slots(p) for s, p in priors.items()}
        self.parks = {s: _Park() for s in PRIOR}
        self.counts = {"probe_rounds": 0, "rounds": 0, "cut_slots": 0}
        # Live corrections of the calibrated curve: the loop's measured step times over the
        # curve's (a few seconds of calibration on a shared machine misjudge both by ~10%, and a
        # real context is longer than the calibration's), for rounds and for plain steps.
        self.round_scale, self.plain_scale = 1.0, 1.0
        # A round that follows a round has its own scale: what the model leaves out of it (a
        # block drafted ahead hides the pass's host share as well as the verify's: an H100 saved
        # ~1.8 ms a round where the model's bubble says 0.8) would otherwise be averaged with the
        # rounds that follow plain steps, and a run of rounds misjudged by both.
        self.steady_scale = 1.0
        self._last_source = "drafter"
        self.plain_rate = 1.0 / costs.plain
        self._after_round = False  # the last timed step was a round: the next one breaks no pipeline
        self._bubble = costs.bubble  # read once: `best` prices every width of every offer with it
        # Where a round drafted the next block ahead (the proposer says so: `drafted_ahead`;
        # decode/drafting.py's before_accept, a compiled pass on the device), the drafter round
        # after it hides its verify's build behind the pass and the pass's behind the verify before
        # it: it pays one synchronised step's host share (the bubble) less than its two parts.
        self._ahead_noted = False  # this round drafted the next block ahead (`drafted_ahead`)
        self._ahead_next = False  # the last timed step was a round that drafted ahead
        self._ahead_seen = ahead  # rounds here draft ahead: a run of rounds is priced so

    def _draft_cost(self, source: str) -> float:
        return (self.costs.t_draft or 0.0) if source == "drafter" else 0.0

    def _overlap(self, source: str, steady: bool = False) -> float:
        """What a round of `source` pays beyond its synchronised parts, by what came before it
        (`steady`: a round that follows the round in flight, drafted ahead where rounds here are)."""
        if steady:
            return -self._bubble if source == "drafter" and self._ahead_seen else 0.0
        if source == "drafter" and self._ahead_next:
            return -self._bubble
        return 0.0 if self._after_round else self._bubble

    def _scale(self, steady: bool = False) -> float:
        """The live correction of a round that follows a round (`steady`, or the last step was
        one) or plain steps."""
        return self.steady_scale if steady or self._after_round else self.round_scale

    def _round_cost(self, source: str, k: int, steady: bool = False) -> float:
        base = self._draft_cost(source) + self.costs.verify(k + 1)
        return max(base + self._overlap(source, steady), 0.5 * base) * self._scale(steady)

    def rate(self, source: str, k: int, depth: int = 0) -> float:
        return self.slots[self._kind(source, depth)].tau(k) / self._round_cost(source, k)

    def timed(self, width: int, seconds: float) -> None:
        """A step's wall time (`width` 1: a pipelined plain step), against the model's price for
        it as it came (after a round or after plain steps), so the bubble is never learnt as a
        scale of the curve."""
        lo, hi = LIVE_RANGE
        if width <= 1:
            x = seconds / self.costs.plain
            self.plain_scale += LIVE_ALPHA * (min(max(x, lo), hi) - self.plain_scale)
            self.plain_rate = 1.0 / (self.costs.plain * self.plain_scale)
        else:
            src = self._last_source
            base = self._draft_cost(src) + self.costs.verify(width)
            x = min(max(seconds / max(base + self._overlap(src), 0.5 * base), lo), hi)
            if self._after_round:
                self.steady_scale += LIVE_ALPHA * (x - self.steady_scale)
            else:
                self.round_scale += LIVE_ALPHA * (x - self.round_scale)
        self._after_round = width > 1
        self._ahead_next, self._ahead_noted = width > 1 and self._ahead_noted, False

    def continues(self, source: str, offered: int) -> bool:
        """The next round's chance as `length` and `result` will judge it, on the acceptance known
        now (this round's result moves it by ALPHA): the probe's next round, or the round after
        this one priced as drafted ahead against what resuming or staying asks."""
        park = self.parks[source]
        if park.probing > 1:
            return True
        if park.until > 0 and not park.probing:
            return False
        k, r = self.best(source, offered, steady=True)
        return k > 0 and r >= (RESUME_MARGIN if park.probing else MARGIN) * self.plain_rate

    def drafted_ahead(self) -> None:
        self._ahead_noted = self._ahead_seen = True

    @staticmethod
    def _kind(source: str, depth: int) -> str:
        return "lookup-long" if source == "lookup" and depth >= LONG_DEPTH else source

    def best(self, source: str, offered: int, depth: int = 0, steady: bool = False) -> tuple[int, float]:
        """The k that maximizes `rate` and that rate (tau(k) summed as k grows, not anew per k: this
        runs on every plain step where a source may draft); `steady`: priced as a round after the
        one in flight (`_overlap`)."""
        s = self.slots[self._kind(source, depth)]
        best_k, best_r, tau, run = 0, 0.0, 1.0, 1.0
        for k in range(1, min(offered, self.cap) + 1):
            run *= s.get(k - 1)
            tau += run
            r = tau / self._round_cost(source, k, steady)
            if r > best_r:
                best_k, best_r = k, r
        return best_k, best_r

    def ready(self, source: str, n_hist: int) -> bool:
        return n_hist >= self.parks[source].until

    def worth_trying(self, source: str, offered: int, n_hist: int, depth: int = 0) -> bool:
        if offered <= 0 or not self.ready(source, n_hist):
            return False
        if self.parks[source].until > 0:
            return True  # parked, and its gap has passed: `length` makes this round a probe
        # Not parked, among plain steps: a drafter (at the answer's start) is judged on the run of
        # rounds it would begin (the first round's bubble is paid once; `length` judges every
        # round after it); lookup, whose matches come one at a time, on the round alone.
        k, r = self.best(source, offered, depth, steady=source == "drafter")
        if k > 0 and r >= MARGIN * self.plain_rate:
            return True
        # Losing: park it here. (Letting it through for `length` to park would cost a synchronous
        # plain step: the loop reads the pending token back before asking for a draft.)
        self.parks[source].until = n_hist + self.parks[source].every
        return False

    def length(self, source: str, offered: int, n_hist: int, depth: int = 0) -> int:
        park = self.parks[source]
        if park.until > 0:
            if n_hist < park.until:
                return 0
            # a probe: the parked source is tried (PROBE_ROUNDS rounds in a row) to keep its
            # acceptance live; `result` resumes it only if it is then RESUME_MARGIN ahead
            if not park.probing:
                park.probing = PROBE_ROUNDS.get(source, 1)
                self.counts["probe_rounds"] += 1
            return max(self.best(source, offered, depth)[0], 1)
        # a drafter's first round among plain steps is priced as the run it begins (as worth_trying did)
        k, r = self.best(source, offered, depth, steady=source == "drafter" and not self._after_round)
        if k and r >= MARGIN * self.plain_rate:
            return k
        park.until = n_hist + park.every
        return 0

    def result(self, source: str, proposed: int, accepted: int, n_hist: int, depth: int = 0) -> None:
        if proposed == 0:
            return
        self.counts["rounds"] += 1
        self._last_source = source
        self.slots[self._kind(source, depth)].update(proposed, accepted)
        park = self.parks[source]
        if park.probing:
            park.probing -= 1
            if park.probing:
                return  # the probe's next round follows (its gap has passed: `ready`)
            steady = PROBE_ROUNDS.get(source, 1) > 1  # judged as the run of rounds it would start
            k, r = self.best(source, max(proposed, 1), depth, steady)
            if k and r >= RESUME_MARGIN * self.plain_rate:
                park.every, park.until = PROBE_MIN, 0
            else:
                park.every = min(2 * park.every, PROBE_MAX)
                park.until = n_hist + park.every

    cuts_by_confidence = True

    def cut(self, source: str, confidences: list[float]) -> int:
        """The block's prefix worth verifying, slot by slot (module docstring, "per round").
        The first slot always stays: the round's drafter pass is spent, and a round cut to
        nothing would cost a synchronous plain step (and leave a probe round unanswered). Slot
        j > 0 stays only if some continuation from it, with slot j's confidence for it and every
        later slot, gains more tokens than its extra verify width costs at plain decoding's
        rate: the decision on slot j reads only confidences up to j, so a sampled draft stays
        an exact sample."""
        if not confidences:
            return 0
        scale = self._scale()
        t = [self.costs.verify(w + 1) * scale for w in range(len(confidences) + 1)]
        rate = self.plain_rate
        survive, k = min(CONF_MAX, confidences[0]), 1
        while k < len(confidences):
            c = min(CONF_MAX, confidences[k])
            run, gain, worth = survive, 0.0, False
            for k2 in range(k + 1, len(confidences) + 1):
                run *= c
                gain += run
                if gain > rate * (t[k2] - t[k]):
                    worth = True
                    break
            if not worth:
                break
            survive *= c
            k += 1
        self.counts["cut_slots"] += len(confidences) - k
        return k

    def prefer_lookup(self, lookup_len: int, depth: int, drafter_len: int) -> bool:
        if depth < HYBRID_MIN_DEPTH:
            return False
        _, r_look = self.best("lookup", lookup_len, depth)
        _, r_draft = self.best("drafter", drafter_len) if drafter_len else (0, 0.0)
        return r_look >= r_draft

    def stats(self) -> dict:
        return {
            "policy": "cost",
            **self.counts,
            "p_drafter": [round(x, 2) for x in self.slots["drafter"].p[:8]],
            "live_round_scale": round(self.round_scale, 3),
            "live_steady_scale": round(self.steady_scale, 3),
            "live_plain_scale": round(self.plain_scale, 3),
        }


def slot_acceptance(tau: float, k: int) -> float:
    """The per-slot acceptance p at which k drafts commit `tau` tokens per round on average
    (tau(k) = 1 + p + ... + p^k), by bisection; 1.0 where tau >= k + 1."""
    if tau >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if _Slots(mid).tau(k) < tau:
            lo = mid
        else:
            hi = mid
    return lo


def plain_reason(
    costs: Costs, cap: int, drafter: bool, measured_tau: float | None = None, ahead: bool = False
) -> str | None:
    """Why speculation does not pay here, or None when it does. Two questions, by what is known:
    * Unmeasured acceptance: can any round beat plain decoding, at BEST_CASE_P per slot and the
      best width, by BEST_CASE_GAIN? (A verify of 2 that costs ~2x one of 1 says no.)
    * A drafter whose acceptance the registry records (`measured_tau`: its typical, i.e. median,
      domain's mean tokens per round at its full block of `cap` drafts): does it beat plain
      decoding by TYPICAL_GAIN on content of unknown kind? A drafter that pays only on its best
      domain loses on the rest, a fresh process pays its load, ingest and first passes before
      any round earns (auto-h200.md, 21st and 22nd sessions), and lookup, which auto runs in its
      place, takes the repetitive text for free. This verdict rests on acceptance measured
      rather than on a ceiling, so calibration noise does not flip it: on the demo pair's curves
      in tests/test_policy.py it is 0.95x on an H100 and 1.29x on a CPU with OpenBLAS.
    Both weigh each round with the pipeline's bubble (`Costs.bubble`), as the policy does a round
    among plain steps; a drafter that drafts `ahead` (a compiled pass on the device) is judged on
    its run of rounds, each a bubble below its two synchronised parts (CostPolicy._overlap)."""
    typical = bool(drafter and measured_tau)
    p = slot_acceptance(measured_tau, max(1, cap)) if typical else BEST_CASE_P
    s = _Slots(p)
    t_d = (costs.t_draft or 0.0) if drafter else 0.0
    over = -costs.bubble if (drafter and ahead) else costs.bubble

    def price(k: int) -> float:
        base = t_d + costs.verify(k + 1)
        return max(base + over, 0.5 * base)

    best = max(s.tau(k) / price(k) for k in range(1, max(1, cap) + 1))
    gain = best * costs.plain
    if gain >= (TYPICAL_GAIN if typical else BEST_CASE_GAIN):
        return None
    w2 = costs.verify(2) / costs.plain
    at = f"at its typical {measured_tau:.2f} tokens a round {gain:.2f}x" if typical else f"at best {gain:.2f}x"
    return (
        f"speculation cannot pay on this machine (a verify of 2 tokens costs {w2:.2f}x a plain step"
        + (f", a drafter pass {t_d / costs.plain:.2f}x" if drafter else "")
        + f"; {at} plain decoding)"
    )


def make_policy(
    max_draft, costs: Costs | None, *, hybrid: bool, short_draft: int = SHORT_DRAFT, long_draft: int = 32
) -> DraftPolicy:
    """ "auto" with measured costs: CostPolicy; anything else (an int, None, or no costs): the
    fixed rules."""
    if max_draft == "auto" and costs is not None:
        return CostPolicy(costs, cap=max(long_draft, 16))
    return FixedPolicy(hybrid=hybrid, short_draft=short_draft, long_draft=long_draft)
