"""Modes are Proposers. This maps a mode name (and a drafter, if any) to one."""

from __future__ import annotations

from ..errors import UserError, option
from .lookup import LookupProposer
from .proposers import Proposer

MODES = ("auto", "baseline", "lookup", "dspark", "dflash")
DEFAULT_MAX_DRAFT = {"baseline": 0, "lookup": 32}


def make_proposer(mode: str, *, drafter=None, lookup_long_draft: int = 32, **drafter_options) -> Proposer:
    """Build the Proposer for `mode`. `drafter` is a loaded drafter (models/dspark.py, dflash.py)."""
    if mode not in MODES:
        raise UserError(f"unknown {option('mode', mode)}: choose one of {', '.join(MODES)}")
    if mode == "auto":
        mode = drafter.kind if drafter is not None else "lookup"
    if mode == "baseline":
        return Proposer()
    if mode == "lookup":
        return LookupProposer(long_draft=lookup_long_draft)
    if drafter is None:
        raise UserError(
            f"{option('mode', mode)} needs a drafter: pass {option('drafter')} REPO_OR_DIR "
            f"(or use {option('mode', 'auto')}, which falls back to lookup for targets without one)"
        )
    return drafter_proposer(drafter, **drafter_options)


def drafter_proposer(drafter, *, confidence_threshold: float = 0.0, lookup_drafts: bool = True, **_others) -> Proposer:
    """The Proposer that drafts with a loaded DSpark / DFlash drafter (options other proposers
    take are ignored here)."""
    from .drafting import DrafterProposer

    return DrafterProposer(drafter, confidence_threshold=confidence_threshold, lookup_drafts=lookup_drafts)


_said: set[str] = set()


def _say_once(msg: str) -> None:
    import sys

    if msg not in _said:
        _said.add(msg)
        print(f"mlx-dspark: {msg}", file=sys.stderr)


def apply_auto(target, proposer, mode: str, lookup_long_draft: int = 32):
    """`max_draft="auto"`: give `proposer` the cost policy for this machine, or, in mode auto where
    speculation cannot pay here, replace it by plain decoding (said once). Returns (proposer, None):
    the loop's cap then comes from the proposer as for the default."""
    from . import costs as cost_curves
    from .policy import CostPolicy, slot_acceptance

    if not hasattr(proposer, "use_policy"):
        return proposer, None  # baseline, or a caller's own proposer
    drafter = getattr(proposer, "drafter", None)
    c = cost_curves.costs_for(target, drafter)
    if c is None:
        return proposer, None  # MLX_DSPARK_CALIBRATION=off: the fixed rules
    cap = proposer.block_drafts if drafter is not None else lookup_long_draft
    runs_ahead = getattr(proposer, "runs_ahead", None)
    ahead = bool(runs_ahead and runs_ahead())
    tau = _measured_tau(drafter)  # the registry's record: the verdict's and the policy's prior
    if mode == "auto":
        lookup = getattr(proposer, "lookup_drafts", False)
        runs, said = auto_verdict(c, drafter, lookup, lookup_long_draft, ahead, measured_tau=tau)
        if said:
            _say_once(said)
        if runs == "lookup" and drafter is not None:
            proposer = LookupProposer(long_draft=lookup_long_draft)
            proposer.use_policy(CostPolicy(c, cap=lookup_long_draft))
            return proposer, None
        if runs == "baseline":
            return Proposer(), None
    prior = slot_acceptance(tau, drafter.block_drafts) if tau and drafter is not None else None
    proposer.use_policy(CostPolicy(c, cap=max(cap, lookup_long_draft), drafter_prior=prior, ahead=ahead))
    return proposer, None


def auto_verdict(
    c, drafter, lookup_drafts: bool = True, lookup_long_draft: int = 32, ahead: bool = False, measured_tau=...
) -> tuple[str, str | None]:
    """What `--mode auto` runs on the cost curve `c`: (the drafter's kind, "lookup" or
    "baseline"; what it says once, or None). A drafter drafts at most its block; lookup drafts are
    free, so where the drafter cannot pay (policy.plain_reason, weighed by what the registry
    records it earns on its typical domain) lookup alone may, if the drafter's proposer drafts
    lookup too. `ahead`: the drafter's rounds draft ahead (policy.plain_reason); `measured_tau`:
    the registry's record for the drafter where the caller has read it (None: unmeasured)."""
    from .policy import plain_reason

    if drafter is None:
        why = plain_reason(c, lookup_long_draft, False)
        return ("baseline", f"{why}: --mode auto runs plain decoding ({c.summary()})") if why else ("lookup", None)
    if measured_tau is ...:
        measured_tau = _measured_tau(drafter)
    why = plain_reason(c, drafter.block_drafts, True, measured_tau, ahead)
    if not why:
        return drafter.kind, None
    if lookup_drafts and plain_reason(c, lookup_long_draft, False) is None:
        detail = why.split("(", 1)[1].rstrip(")")
        return "lookup", f"the drafter cannot pay on this machine ({detail}): --mode auto runs lookup ({c.summary()})"
    return "baseline", f"{why}: --mode auto runs plain decoding ({c.summary()})"


def _measured_tau(drafter) -> float | None:
    """What the registry records this drafter earns per round on its typical domain (None: not
    measured)."""
    if drafter is None:
        return None
    from ..models.registry import typical_acceptance

    return typical_acceptance(str(getattr(drafter, "source", "") or ""))
