"""Draft-length rules replayed on recorded DSpark rounds: a comparison free of timing noise.

  python bench/replay_draft_policy.py [--prompts benchmark|eval] [--tokens 128]
                                      [--out bench/results/confidence-cut-cpu.md]

Wall-clock A/B runs of two policies on a shared 2-core VM move 10-40% between runs of the same
side (bench_confidence_cut.py). This separates the policy from the clock:
1. Record: the demo pair decodes each prompt greedily with every round drafting the whole block
   (a recording DraftPolicy: it asks for the confidences and never cuts; lookup drafts off). Per
   round it keeps the head's confidences and how many drafts the target accepted.
2. Replay: each rule picks a draft length per recorded round; greedy acceptance of a shorter draft
   is min(accepted, k), so the round commits min(accepted, k) + 1 tokens and costs t_draft +
   t_verify(k + 1) on this machine's calibrated curve (decode/costs.py). The rules:
   - per-slot averages: CostPolicy's live per-slot acceptance sizes each round (the cut off);
   - cut: CostPolicy.cut on the round's confidences (the default);
   - best fixed cap: the best single cap per prompt, chosen knowing every round (an oracle).
   Speed is tokens / modeled time against plain decoding's t_plain. Parking is not replayed (every
   recorded round is kept), so a prompt below 1.0x here is one the live policy parks.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import _package  # noqa: F401  (the installed mlx_dspark, else python/)

from mlx_dspark import benchmark as bm  # noqa: E402
from mlx_dspark.api import drafter_for, encode_prompt, generate  # noqa: E402
from mlx_dspark.decode import policy as pol  # noqa: E402
from mlx_dspark.decode.costs import costs_for  # noqa: E402
from mlx_dspark.decode.drafting import DrafterProposer  # noqa: E402

EVAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "prompts" / "eval"


class Recorder(pol.FixedPolicy):
    """Drafts every block whole and keeps (confidences, proposed, accepted) per drafter round."""

    cuts_by_confidence = True

    def __init__(self):
        super().__init__(hybrid=True)
        self.rounds: list[tuple[list[float], int, int]] = []
        self._conf: list[float] | None = None

    def cut(self, source: str, confidences: list[float]) -> int:
        self._conf = list(confidences)
        return len(confidences)

    def result(self, source: str, proposed: int, accepted: int, n_hist: int, depth: int = 0) -> None:
        if source == "drafter" and self._conf is not None and proposed:
            self.rounds.append((self._conf, proposed, accepted))
        self._conf = None


def prompts(which: str, per_set: int) -> list[tuple[str, str]]:
    if which == "benchmark":
        return [(cls, p) for cls in ("chat", "code", "math", "copy") for p in bm.PROMPT_SETS[cls]]
    out = []
    for name in ("mt-bench", "humaneval", "mbpp", "math500"):
        with open(EVAL / f"{name}.jsonl") as f:
            out += [(name, json.loads(line)["turns"][0]) for line, _ in zip(f, range(per_set))]
    return out


def replay(rounds, costs, rule: str, cap: int = 0) -> float:
    """Modeled speed of `rule` over recorded rounds, as a multiple of plain decoding."""
    p = pol.CostPolicy(costs, cap=16)
    tokens = seconds = 0.0
    for n, (conf, proposed, accepted) in enumerate(rounds):
        if rule == "cut":
            k = p.cut("drafter", conf)
        elif rule == "fixed":
            k = min(cap, proposed)
        else:
            k = p.best("drafter", proposed)[0]
        got = min(accepted, k)
        p.result("drafter", k, got, n)
        tokens += got + 1
        seconds += (costs.t_draft or 0.0) + costs.verify(k + 1)
    return tokens / seconds * costs.plain


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target (default: the demo model)")
    ap.add_argument("--prompts", default="benchmark", choices=["benchmark", "eval"])
    ap.add_argument("--per-set", type=int, default=5, help="eval prompts per set (with --prompts eval)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out")
    args = ap.parse_args()
    t0 = time.perf_counter()
    model, target, tok = bm.load_bench_target(args.model)
    drafter = drafter_for(target, "dspark")
    costs = costs_for(target, drafter)
    if costs is None:
        raise SystemExit("no calibrated cost curve here (MLX_DSPARK_CALIBRATION=off?)")
    lines, by_class = [], {}
    for cls, prompt in prompts(args.prompts, args.per_set):
        rec = Recorder()
        prop = DrafterProposer(drafter, lookup_drafts=False, policy=rec)
        generate(target, tok, None, prompt_ids=encode_prompt(tok, prompt), proposer=prop, max_new_tokens=args.tokens)
        if not rec.rounds:
            continue
        avg = replay(rec.rounds, costs, "avg")
        cut = replay(rec.rounds, costs, "cut")
        fixed = max(replay(rec.rounds, costs, "fixed", k) for k in range(1, drafter.block_drafts + 1))
        by_class.setdefault(cls, []).append((avg, cut, fixed))
        acc = sum(a for _, _, a in rec.rounds) / len(rec.rounds)
        lines.append(
            f"| {cls} | {prompt[:40]!r} | {len(rec.rounds)} | {acc:.2f} | {avg:.3f}x | {cut:.3f}x | {cut / avg:.3f}x "
            f"| {fixed:.3f}x |"
        )
        print(lines[-1], flush=True)

    curve = ", ".join(f"w{w} {t * 1e3:.1f}" for w, t in zip(costs.widths, costs.t_verify))
    out = [
        f"### Draft-length rules replayed on recorded rounds: {model}, {bm.device_stamp()}",
        f"`bench/replay_draft_policy.py --prompts {args.prompts} --tokens {args.tokens}` "
        f"at {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"Calibrated curve (ms): plain {costs.plain * 1e3:.1f}, drafter pass {(costs.t_draft or 0) * 1e3:.1f}, "
        f"{curve}.",
        "",
        "| set | prompt | rounds | drafts accepted a round (of 7) | per-slot averages | cut | cut / averages "
        "| best fixed cap (oracle) |",
        "|---|---|---|---|---|---|---|---|",
        *lines,
        "",
    ]
    for cls, rows in by_class.items():
        avg, cut, fixed = (bm.geomean([r[i] for r in rows]) for i in range(3))
        out.append(
            f"- {cls} ({len(rows)} prompts): per-slot averages {avg:.3f}x, **cut {cut:.3f}x** ({cut / avg:.3f}x), "
            f"best fixed cap {fixed:.3f}x"
        )
    out.append(f"- whole run {time.perf_counter() - t0:.0f} s")
    bm.emit("\n".join(out), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
