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
        raise UserError(f"{option('mode', mode)} needs a drafter: pass {option('drafter')} REPO_OR_DIR "
                        f"(or use {option('mode', 'auto')}, which falls back to lookup for targets without one)")
    return drafter_proposer(drafter, **drafter_options)


def drafter_proposer(drafter, *, confidence_threshold: float = 0.0, lookup_drafts: bool = True,
                     **_others) -> Proposer:
    """The Proposer that drafts with a loaded DSpark / DFlash drafter (options other proposers
    take are ignored here)."""
    from .drafting import DrafterProposer

    return DrafterProposer(drafter, confidence_threshold=confidence_threshold, lookup_drafts=lookup_drafts)
