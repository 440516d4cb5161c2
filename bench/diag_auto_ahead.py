"""What `--max-draft auto` makes of DSpark on this machine, against fixed blocks with and without
drafting ahead (decode/drafting.py's before_accept), in one warm process: per prompt and repetition,
baseline, `--mode auto` and `--mode dspark` (both with the CLI's default `--max-draft auto`), and `--mode dspark
--max-draft 7` with draft-ahead on and off; tok/s of the decode, the ratio to baseline of the same
repetition, drafter / ahead / lookup rounds and the live round scales (after plain steps / in a
run); every run's ids and text checked equal to baseline. The calibrated curve is printed once,
and at the end a table of medians over the repetitions.

  python bench/diag_auto_ahead.py --model GGUF [--dtype bfloat16] [--tokens 192] [--reps 3] [--set NAME=VALUE ...]

`--set ALPHA=0.1` runs the policy with a constant of decode/policy.py changed (as
bench/sim_draft_policy.py's `--set`): a live A/B of a candidate the simulator proposed, one process
per side.
"""

from __future__ import annotations

import argparse
import statistics

import _package  # noqa: F401  (the mlx_dspark on the path or installed, else python/: an A/B sets PYTHONPATH)

PROMPTS = {
    "code": "Write a Python function that merges two sorted lists into one sorted list.",
    "chat": "Explain in a few sentences why the sky is blue.",
    "math": "What is the sum of the first 100 positive integers? Show your reasoning.",
}
RUNS = (
    ("auto", {"mode": "auto", "max_draft": "auto"}, True),
    ("dspark-auto", {"mode": "dspark", "max_draft": "auto"}, True),
    ("k7", {"mode": "dspark", "max_draft": 7}, True),
    ("k7-noahead", {"mode": "dspark", "max_draft": 7}, False),
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a policy constant, changed")
    args = ap.parse_args()
    from sim_draft_policy import set_constants

    if args.set:
        print(f"policy constants changed: {set_constants(args.set)}", flush=True)
    import mlx_dspark as md
    from mlx_dspark.api import drafter_for, start
    from mlx_dspark.decode.drafting import DrafterProposer
    from mlx_dspark.models.loading import load_target

    t, tok = load_target(args.model, dtype=args.dtype)
    d = drafter_for(t, "dspark")
    shown = False
    speeds: dict = {}  # (prompt, label) -> decode tok/s of each repetition
    for name, text in PROMPTS.items():
        ids = md.encode_prompt(tok, text)
        for rep in range(args.reps):
            b = md.generate(t, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=args.tokens)
            row = [f"{name} {rep}", f"baseline {b.decode_tps:.0f}"]
            speeds.setdefault((name, "baseline"), []).append(b.decode_tps)
            for label, kw, ahead in RUNS:
                DrafterProposer.draft_ahead = ahead
                tg = start(t, tok, None, prompt_ids=ids, drafter=d, max_new_tokens=args.tokens, **kw)
                r = tg.run()
                s = r.stats
                if r.tokens != b.tokens or r.text != b.text:
                    raise SystemExit(f"{label} on {name}: not baseline's ids and text")
                speeds.setdefault((name, label), []).append(r.decode_tps)
                row.append(
                    f"{label} {r.decode_tps:.0f} ({r.decode_tps / b.decode_tps:.2f}x; drafter {s.get('drafter_rounds')}"
                    f" acc {s.get('drafter_accepted', 0) / max(1, s.get('drafter_rounds') or 0):.2f}"
                    f" ahead {s.get('ahead_rounds')} unused {s.get('ahead_unused')} lookup {s.get('lookup_rounds')}"
                    f" probe {s.get('probe_rounds')} scale {s.get('live_round_scale')}/{s.get('live_steady_scale')})"
                )
                policy = getattr(tg.generation.proposer, "policy", None)
                if not shown and getattr(policy, "costs", None) is not None:
                    c, shown = policy.costs, True
                    print(
                        f"curve: plain {c.plain * 1e3:.2f} ms, bubble {c.bubble * 1e3:.2f}, drafter pass "
                        f"{(c.t_draft or 0) * 1e3:.2f}, verify w1 {c.verify(1) * 1e3:.2f}, w8 {c.verify(8) * 1e3:.2f}",
                        flush=True,
                    )
            DrafterProposer.draft_ahead = True
            print(" | ".join(row), flush=True)
    # medians over the repetitions: one baseline run moves by 10-20% on a GPU, a ratio to it as much
    labels = ["baseline"] + [label for label, _, _ in RUNS]
    print("\nmedian tok/s (ratio of medians to baseline's):\n| prompt | " + " | ".join(labels) + " |")
    print("|---" * (len(labels) + 1) + "|")
    for name in PROMPTS:
        med = {label: statistics.median(speeds[(name, label)]) for label in labels}
        print(f"| {name} | " + " | ".join(f"{med[x]:.0f} ({med[x] / med['baseline']:.2f}x)" for x in labels) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
