"""`--max-draft auto` (decode/policy.py's CostPolicy, the real object) simulated on a device's cost
curve from recorded acceptance: the policy's decisions on a GPU, studied on a CPU, free of timing noise.

  python bench/sim_draft_policy.py [--record bench/results/accept-trace-cpu.json] [--prompts benchmark|train|diag]
                                   [--tokens 192] [--per-class 4] [--curve h100|h100-s27|CALIBRATION.json]
                                   [--no-ahead] [--typical 3.2] [--set NAME=VALUE ...] [--out FILE.md]

1. Record (once; kept in the --record file): the demo pair (float32) decodes each prompt greedily;
   then, for every position n of the answer, the drafter drafts its whole block from the context
   of positions < n with anchor token n, and L(n) = how many leading drafts equal the answer's
   tokens n+1.. . Greedy acceptance depends on the position alone, so a round anchored at n with k
   drafts commits min(L(n), k) + 1 tokens whatever came before it (bf16 on a GPU may differ in a
   few places; the policy is what is studied).
2. Simulate: a loop with loop.py's control flow (pipelined plain steps; a round read after them
   pays the bubble; a declined round after a round is a synchronous plain step; a block drafted
   ahead serves the round right after its own, and a block drafted ahead that no round uses holds
   the device for `--waste` ms) drives the policy: `worth_trying` in plain mode, `length`,
   `drafted_ahead`, `result`, `timed` with the modeled step times. The true times are the policy's
   own model except where measured otherwise: a round after a round that drafted ahead saves
   `--ahead-saving` ms (an H100, session 26: k7 with draft-ahead against without it, ~1.8 ms a
   round; the policy prices it at one bubble).
Rows per prompt: plain decoding (1.00x by definition), `k7` (the full block every round, drafted
ahead), `k7-noahead`, and `auto`, with auto's rounds, probes and blocks drafted ahead for nothing.
`--set ALPHA=0.1` (repeatable) runs the policy with a constant of decode/policy.py changed: a
candidate is judged here, on traces it was not tuned on, before a device is spent on it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import _package  # noqa: F401  (the installed mlx_dspark, else python/)

from mlx_dspark import benchmark as bm  # noqa: E402
from mlx_dspark.decode import policy as pol  # noqa: E402
from mlx_dspark.decode.costs import Costs  # noqa: E402

# Cost curves (seconds) measured by the calibration (decode/costs.py) on GPUs, bf16 demo pair.
CURVES = {
    # NVIDIA H100, session 26 (auto-h200.md): plain 2.49 ms, bubble 0.78, drafter pass 2.74,
    # verify w1 3.27, w8 4.48; the widths between interpolated, w16 from the 25th session's ratio.
    "h100": Costs(
        [1, 2, 4, 8, 16],
        [0.00327, 0.00345, 0.00375, 0.00448, 0.00700],
        t_draft=0.00274,
        t_plain=0.00249,
        origin="given",
    ),
    # NVIDIA H100, session 27 (auto-h200.md): plain 2.53 ms, bubble 1.22, drafter pass 2.23,
    # verify w1 3.76, w8 4.67; the widths between interpolated, w16 as above.
    "h100-s27": Costs(
        [1, 2, 4, 8, 16],
        [0.00376, 0.00390, 0.00420, 0.00467, 0.00720],
        t_draft=0.00223,
        t_plain=0.00253,
        origin="given",
    ),
}


TRAIN = Path(__file__).resolve().parents[2] / "shared" / "data" / "prompts" / "train"
TRAIN_CLASSES = {"arena-hard-v2": "chat", "gsm8k": "math", "lbpp": "code", "livecodebench": "code"}


def prompt_set(which: str, per_class: int) -> list[tuple[str, str]]:
    """(class, prompt): the benchmark's sets (`benchmark`), or the first prompts of each file of
    the training prompts (`train`: the policy is tuned on these, never on eval/)."""
    if which == "benchmark":
        return [(cls, p) for cls in ("chat", "code", "math", "copy") for p in bm.PROMPT_SETS[cls][:per_class]]
    if which == "diag":  # bench/diag_auto_ahead.py's, to set the sim beside its measurements
        from diag_auto_ahead import PROMPTS

        return list(PROMPTS.items())
    out = []
    for name, cls in TRAIN_CLASSES.items():
        with open(TRAIN / f"{name}.jsonl") as f:
            out += [(cls, json.loads(line)["turns"][0]) for line, _ in zip(f, range(per_class))]
    return out


def accept_trace(target, drafter, prompt_ids: list[int], answer: list[int]) -> list[int]:
    """L(n) for every anchor n of `answer` after `prompt_ids` (module docstring, step 1): the
    drafter's greedy block from the context of positions < n (one target forward over the whole
    text gives the tapped rows), anchor token n, against the answer's tokens n+1.. ."""
    import mlx.core as mx

    def choose(row, drafted):
        return mx.argmax(row, axis=-1).astype(mx.int32), None

    choose.argmax = True
    K = drafter.block_drafts
    full = list(prompt_ids) + list(answer)
    P = len(prompt_ids)
    out = target.forward(mx.array([full[:-1]], dtype=mx.int32), target.make_cache(), taps=tuple(drafter.taps))
    hidden = out.hidden[0]
    state = drafter.new_state()
    drafter.ingest(hidden[:P], state)
    L = []
    for n in range(P, len(full) - 1):  # anchor n: context rows < n
        h = drafter.block_hidden(full[n], None, state)
        toks, _, _ = drafter.sample(h[:K], full[n], choose)
        got = mx.stack(toks).tolist()
        a = 0
        while a < len(got) and n + 1 + a < len(full) and got[a] == full[n + 1 + a]:
            a += 1
        L.append(a)
        drafter.ingest(hidden[n : n + 1], state)
        mx.eval([c.state for c in state])
    return L


def rounds_of(L: list[int], k: int) -> list[int]:
    """The drafts accepted in each round of a run that drafts k every round from the start."""
    pos, out = 0, []
    while pos < len(L):
        out.append(min(L[pos], k))
        pos += out[-1] + 1
    return out


def record(prompts: list[tuple[str, str]], tokens: int, model: str | None) -> list[dict]:
    from mlx_dspark.api import drafter_for, encode_prompt, generate

    _, target, tok = bm.load_bench_target(model)
    drafter = drafter_for(target, "dspark")
    traces = []
    for cls, text in prompts:
        ids = encode_prompt(tok, text)
        out = generate(target, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=tokens)
        L = accept_trace(target, drafter, ids, out.tokens)
        traces.append({"class": cls, "prompt": text, "block": drafter.block_drafts, "accept": L})
        print(f"recorded {cls}: {text[:40]!r}, {len(L)} positions, mean L {sum(L) / max(1, len(L)):.2f}", flush=True)
    return traces


class Truth:
    """Modeled wall times of the loop's steps (seconds)."""

    def __init__(self, c: Costs, ahead_saving: float, waste: float):
        self.c, self.ahead_saving, self.waste = c, ahead_saving, waste

    def round(self, k: int, after_plain: bool, ahead: bool) -> float:
        t = (self.c.t_draft or 0.0) + self.c.verify(k + 1)
        if after_plain:
            return t + self.c.bubble
        return t - self.ahead_saving if ahead else t


def simulate(L: list[int], block: int, truth: Truth, policy, draft_ahead: bool) -> dict:
    """Tokens and modeled seconds of decoding the recorded answer under `policy` (None: every
    step a full-block round)."""
    c = truth.c
    N = len(L)
    pos, seconds = 0, 0.0  # pos: the anchor (the last token decided), as an index into L
    mode = "plain"  # what the last step was: "plain" (pipelined), "round"
    ahead = False  # the round in flight drafted the next block ahead
    stats = {"rounds": 0, "ahead_unused": 0, "plain": 0}
    while pos < N:
        n_hist = 1000 + pos  # any history length: the policy only compares them
        if mode == "plain" and policy is not None and not policy.worth_trying("drafter", block, n_hist):
            seconds += c.plain
            policy.timed(1, c.plain)
            pos += 1
            stats["plain"] += 1
            continue
        k = block
        if policy is not None:
            k = policy.length("drafter", block, n_hist) if policy.ready("drafter", n_hist) else 0
        k = min(k, N - pos)
        if k <= 0:  # a synchronous plain step (declined after a round), or plain mode's read-back
            t = c.verify(1)
            if ahead:
                t += truth.waste
                stats["ahead_unused"] += 1
            seconds += t
            pos += 1
            mode, ahead = "plain", False
            stats["plain"] += 1
            continue
        t = truth.round(k, mode == "plain", ahead)
        a = min(L[pos], k)
        drafted_ahead = draft_ahead and pos + a + 1 < N
        expects = getattr(policy, "continues", None)  # an older tree's policy has none
        if drafted_ahead and expects is not None and not expects("drafter", block):
            drafted_ahead = False
        if drafted_ahead and policy is not None:
            policy.drafted_ahead()
        if policy is not None:
            policy.result("drafter", k, a, n_hist)
            policy.timed(k + 1, t)
        seconds += t
        pos += a + 1
        mode, ahead = "round", drafted_ahead
        stats["rounds"] += 1
    stats["speed"] = N * c.plain / seconds
    if policy is not None:
        stats["probes"] = policy.counts["probe_rounds"]
    return stats


def new_policy(costs: Costs, block: int, typical: float, ahead: bool = True):
    """CostPolicy as decode/modes.py's apply_auto builds it for a drafter (that drafts `ahead`),
    whose registry entry says `typical` tokens a round (0: unknown)."""
    import inspect

    if "drafter_prior" not in inspect.signature(pol.CostPolicy).parameters:
        return pol.CostPolicy(costs, cap=16)  # an older tree
    prior = pol.slot_acceptance(typical, block) if typical else None
    return pol.CostPolicy(costs, cap=16, drafter_prior=prior, ahead=ahead)


def load_curve(name: str) -> Costs:
    """A curve of CURVES, or a calibration file (decode/costs.py's cache: {"key", "value"})."""
    if name in CURVES:
        return CURVES[name]
    value = json.loads(Path(name).read_text())["value"]
    return Costs(**{k: v for k, v in value.items() if k in Costs.__dataclass_fields__})


def set_constants(pairs: list[str]) -> dict:
    """Apply `NAME=VALUE` overrides to decode/policy.py's module constants (the policy reads them
    at each decision); an unknown name or a value of another type is an error."""
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        old = getattr(pol, name, None)
        if not sep or not name.isupper() or not isinstance(old, (int, float)) or isinstance(old, bool):
            raise SystemExit(f"--set {pair!r}: expected NAME=VALUE for a numeric constant of decode/policy.py")
        try:
            out[name] = type(old)(value)
        except ValueError:
            raise SystemExit(f"--set {pair!r}: {name} takes a {type(old).__name__}") from None
        setattr(pol, name, out[name])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", default=str(Path(__file__).parent / "results" / "accept-trace-cpu.json"))
    ap.add_argument("--model", default=None, help="target (default: the demo model)")
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--prompts", default="benchmark", choices=["benchmark", "train", "diag"], help="what to record")
    ap.add_argument("--per-class", type=int, default=4, help="prompts per class (benchmark) or per file (train)")
    ap.add_argument("--curve", default="h100", help=f"{', '.join(CURVES)}, or a calibration file (its JSON)")
    ap.add_argument("--no-ahead", action="store_true", help="rounds never draft ahead (a CPU: no compiled passes)")
    ap.add_argument("--ahead-saving", type=float, default=1.8, help="ms a round drafted ahead saves")
    ap.add_argument("--waste", type=float, default=1.6, help="ms an unused block drafted ahead holds the device")
    ap.add_argument("--typical", type=float, default=3.2, help="the registry's tokens a round (0: unknown)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a constant of decode/policy.py for this run (e.g. ALPHA=0.1; repeatable)",
    )
    ap.add_argument("--out")
    args = ap.parse_args()
    overrides = set_constants(args.set)
    path = Path(args.record)
    if path.exists():
        traces = json.loads(path.read_text())["traces"]
    else:
        t0 = time.perf_counter()
        traces = record(prompt_set(args.prompts, args.per_class), args.tokens, args.model)
        path.write_text(
            json.dumps({"recorded": f"{bm.device_stamp()}, {time.perf_counter() - t0:.0f} s", "traces": traces}) + "\n"
        )
    costs = load_curve(args.curve)
    ahead = not args.no_ahead
    truth = Truth(costs, args.ahead_saving / 1e3, args.waste / 1e3)
    rows, by_class = [], {}
    for tr in traces:
        L, K = tr["accept"], tr["block"]
        k7 = simulate(L, K, truth, None, True)
        k7n = simulate(L, K, truth, None, False)
        auto = simulate(L, K, truth, new_policy(costs, K, args.typical, ahead), ahead)
        by_class.setdefault(tr["class"], []).append((k7["speed"], k7n["speed"], auto["speed"]))
        rows.append(
            f"| {tr['class']} | {tr['prompt'][:36]!r} | {sum(L) / len(L):.2f} | {k7['speed']:.3f}x "
            f"| {k7n['speed']:.3f}x "
            f"| {auto['speed']:.3f}x | {auto['rounds']} / {auto['plain']} / {auto['probes']} / {auto['ahead_unused']} |"
        )
    out = [
        f"### `--max-draft auto` simulated on the {args.curve} curve ({costs.summary()})",
        f"`bench/sim_draft_policy.py --curve {args.curve} --ahead-saving {args.ahead_saving} --waste {args.waste}"
        f"{' --no-ahead' if args.no_ahead else ''} --typical {args.typical}"
        f"{''.join(f' --set {k}={v}' for k, v in overrides.items())}` "
        f"at {time.strftime('%Y-%m-%d %H:%M')}; acceptance recorded on {Path(args.record).name}",
        "",
        "| class | prompt | drafts accepted at each position (of 7) | k7 | k7-noahead | auto "
        "| auto rounds / plain steps / probes / blocks drafted ahead unused |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    for cls, r in by_class.items():
        k7, k7n, auto = (bm.geomean([x[i] for x in r]) for i in range(3))
        out.append(f"- {cls} ({len(r)} prompts): k7 {k7:.3f}x, k7-noahead {k7n:.3f}x, **auto {auto:.3f}x**")
    bm.emit("\n".join(out), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
