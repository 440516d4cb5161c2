"""Held-out evaluation of a drafter: mean acceptance length per domain, through the real loop.

Every prompt is generated greedily by the one verify loop (api.generate) with the drafter as the
proposer, exactly as `mlx-dspark generate` runs it. Acceptance length per round = accepted
drafts + 1 (the bonus), pooled over all rounds of a domain (DeepSpec's `accept_len`,
DeepSpec's deepspec/eval/base_evaluator.py). Free n-gram lookup drafts are off, so the figure is the drafter's own.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Sequence

from . import data as D


def acceptance(
    target,
    tokenizer,
    drafter,
    prompts: Sequence[D.Prompt],
    *,
    max_new_tokens: int = 128,
    lookup_drafts: bool = False,
    max_prompt_tokens: int = 4096,
    chat_template: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict:
    """{domain: {mean_accept, rounds, prompts, tokens, decode_tps}, "_all": pooled} for `prompts`
    (prompts longer than `max_prompt_tokens` are skipped and counted)."""
    from ..api import generate

    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    per: dict[str, dict] = {}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        ids = D.encode(tokenizer, p.text, chat_template)
        d = per.setdefault(
            p.domain, {"accept_sum": 0, "rounds": 0, "prompts": 0, "tokens": 0, "decode_s": 0.0, "skipped": 0}
        )
        if len(ids) > max_prompt_tokens:
            d["skipped"] += 1
            continue
        res = generate(
            target,
            tokenizer,
            None,
            prompt_ids=ids,
            mode=drafter.kind,
            drafter=drafter,
            max_new_tokens=max_new_tokens,
            lookup_drafts=lookup_drafts,
        )
        d["accept_sum"] += sum(res.accept_lengths)
        d["rounds"] += len(res.accept_lengths)
        d["prompts"] += 1
        d["tokens"] += len(res.tokens)
        d["decode_s"] += res.decode_s
        if (i + 1) % 10 == 0 or i + 1 == len(prompts):
            say(f"distill: evaluated {i + 1}/{len(prompts)} prompts ({time.perf_counter() - t0:.0f}s)")
    out = {}
    tot = {"accept_sum": 0, "rounds": 0, "prompts": 0, "tokens": 0, "decode_s": 0.0, "skipped": 0}
    for dom, d in sorted(per.items()):
        out[dom] = _finish(d)
        for k in tot:
            tot[k] += d[k]
    out["_all"] = _finish(tot)
    return out


def _finish(d: dict) -> dict:
    return {
        "mean_accept": round(d["accept_sum"] / d["rounds"], 4) if d["rounds"] else 0.0,
        "rounds": d["rounds"],
        "prompts": d["prompts"],
        "tokens": d["tokens"],
        "skipped": d["skipped"],
        "decode_tps": round((d["tokens"] - d["prompts"]) / d["decode_s"], 2) if d["decode_s"] > 0 else 0.0,
    }


def format_table(result: dict) -> str:
    lines = [f"{'domain':<16} {'prompts':>7} {'rounds':>7} {'mean accept':>11}"]
    for dom, r in result.items():
        name = "all (pooled)" if dom == "_all" else dom
        lines.append(f"{name:<16} {r['prompts']:>7} {r['rounds']:>7} {r['mean_accept']:>11.3f}")
    return "\n".join(lines)


__all__ = ["acceptance", "format_table"]
