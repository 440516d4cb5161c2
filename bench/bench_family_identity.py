"""Every mode token-identical to baseline, per target family beyond dense KV, on this device.

  python bench/bench_family_identity.py [--dtype float32|bfloat16|float16] [--quantize 4|8]
         [--families a,b,...] [--modes baseline,lookup,dspark,dflash,scripted] [--prompts 3] [--tokens 48]
         [--max-draft 7] [--cli] [--out FILE.md]

Families (tiny random checkpoints written in their real layouts by tests/family_fixtures.py and
tests/vlm_fixtures.py, to a temporary folder, then loaded from that folder as `--model DIR` is,
at --dtype): qwen3_5 and qwen3_5_moe (hybrid Gated DeltaNet, multimodal layout; MoE), qwen3_next
(hybrid GDN, MoE), gemma3_text (sliding windows), gemma4_text (mlx-lm's Gemma 4: sliding windows,
softcap, the MoE block), qwen3_moe (dense KV, MoE experts), bonsai-2bit (PrismML Bonsai's 2-bit
Hadamard pack of a qwen3_5 hybrid, mlx-lm's prism_hadamard_qwen35), and through mlx-vlm when it is
installed gemma3-vlm and gemma4-vlm (else skipped, with the reason printed). The sliding windows
are 8 tokens: every prompt and generation runs past them.

Per family: which decode path the load self-check chose (models/invariance.py: native | kernels |
fixed-width | none; `none` means no invariant path was found and is reported as a failure), the
expert path (kernels/invariant_gather.py) for MoE families, then per mode "N of N identical" on
token ids AND text against `--mode baseline` of the same loaded target, with the first divergence
and the verify rounds that ran (a mode that never verified more than one token proves nothing;
`speculation_off` is reported). dspark and dflash use random fixture drafters written for the
target (tests/drafter_fixtures.py): they draft badly, so most rounds reject at once. `scripted`
proposes baseline's own continuation with a wrong tail that starts one token later each round (as
tests/test_loop.py's scripted proposer does), so every accept length 1..max_draft + 1 happens:
the verify rows past the first are used and every rollback point (KV trim, ring rewind, GDN
replay) runs. --cli also runs the first prompt through the command line, exactly as a user does
(`mlx-dspark generate --model DIR --dtype D --json --mode M`, fixture drafters by --drafter): lookup,
dspark and dflash against the command's own baseline (one process each: slow where kernels
compile at start, so off by default). Exit status 1 if any mode differs or any self-check found no
invariant path.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import _package  # noqa: F401  (the installed mlx_dspark, else python/)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the fixture writers

# name -> (loader, fixture kind, MoE experts)
FAMILIES = {
    "qwen3_5": ("mlx-lm", "qwen3_5", False),
    "qwen3_5_moe": ("mlx-lm", "qwen3_5_moe", True),
    "qwen3_next": ("mlx-lm", "qwen3_next", True),
    "gemma3_text": ("mlx-lm", "gemma3_text", False),
    "gemma4_text": ("mlx-lm", "gemma4_text", True),
    "qwen3_moe": ("mlx-lm", "qwen3_moe", True),
    "bonsai-2bit": ("mlx-lm", "prism_hadamard_qwen35", False),
    "gemma3-vlm": ("mlx-vlm", "gemma3", False),
    "gemma4-vlm": ("mlx-vlm", "gemma4", False),
}
WINDOW = 8
PROMPTS = (  # each tokenizes to well past the window; repeats so lookup drafts
    "the fox def add(a, b): return a + b the fox def add(a, b): return a + b hello world",
    "hello world 1 2 3 hello world 1 2 3 café the fox the fox the fox\n def fibonacci(n):",
    "return the fox hello world def add the fox return hello world def add the fox return",
    "1 2 3 4 5 6 7 8 9 10 11 12 the quick brown fox jumps over the lazy dog 1 2 3 4 5",
    "café café def add(a, b) café def add(a, b) café\n\n the fox hello world the fox",
)


def scripted_proposer(truth: list[int]):
    """Proposes truth[pos : pos + k] with its tail from a rotating cut on made wrong (t + 1)."""
    from mlx_dspark.decode.proposers import Draft, Proposer

    class Scripted(Proposer):
        name = "scripted"

        def __init__(self):
            self.n_prompt = 0
            self.calls = 0

        def begin(self, target, prompt_ids, prompt_hidden):
            self.n_prompt = len(prompt_ids)

        def wants_round(self, history):
            return True

        def propose(self, history, max_draft, sampling):
            self.calls += 1
            pos = len(history) - self.n_prompt
            right = truth[pos : pos + max_draft]
            cut = self.calls % (len(right) + 1) if right else 0
            return Draft(tokens=right[:cut] + [(t + 1) % 300 for t in right[cut:]])

    return Scripted()


def first_divergence(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def write_fixture(name: str, root: Path) -> Path:
    loader, kind, _ = FAMILIES[name]
    if loader == "mlx-vlm":
        from vlm_fixtures import write_vlm_gemma

        return write_vlm_gemma(root / name, kind, window=WINDOW, seed=1)
    if kind == "prism_hadamard_qwen35":
        from ternary_fixtures import write_ternary

        return write_ternary(root / name, seed=1)
    from family_fixtures import write_family

    return write_family(root / name, kind, seed=len(name), window=WINDOW)


def drafters(name: str, path: Path, target, root: Path, modes: list[str]) -> dict:
    """Random fixture drafters for the target: DSpark (DeepSpec layout; Gemma 4's variant for the
    gemma4 families) and DFlash (z-lab layout)."""
    from drafter_fixtures import write_deepspec, write_zlab
    from family_fixtures import text_view

    from mlx_dspark.models.drafters import load_drafter

    view = text_view(path, root / f"{name}-view")
    out = {}
    if "dspark" in modes:
        extra = {"style": "gemma4", "softcap": 1.0} if "gemma4" in name else {}
        out["dspark"] = load_drafter(str(write_deepspec(root / f"{name}-dspark", view, **extra)), target, bits=16)
    if "dflash" in modes:
        out["dflash"] = load_drafter(str(write_zlab(root / f"{name}-dflash", view)), target, bits=16)
    return out


def cli_rows(name: str, path: Path, root: Path, args, have: dict) -> list[str]:
    """The first prompt through `python -m mlx_dspark generate ... --json` per mode, against the
    command's own baseline: table rows."""
    import json
    import subprocess

    def run(mode: str) -> dict:
        cmd = [sys.executable, "-m", "mlx_dspark", "generate", "--model", str(path), "--dtype", args.dtype]
        cmd += ["--prompt", PROMPTS[0], "--max-new-tokens", str(args.tokens), "--json", "--mode", mode]
        cmd += ["--max-draft", str(args.max_draft)] if mode != "baseline" else []
        if args.quantize:
            cmd += ["--quantize", str(args.quantize)]
        if mode in ("dspark", "dflash"):
            cmd += ["--drafter", str(root / f"{name}-{mode}"), "--drafter-bits", "16"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[2:6])} --mode {mode}: exit {r.returncode}: {r.stderr.strip()[-400:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    base = run("baseline")
    rows = []
    for m in ("lookup", "dspark", "dflash"):
        if m != "lookup" and m not in have:
            continue
        r = run(m)
        same_ids, same_text = r["tokens"] == base["tokens"], r["text"] == base["text"]
        at = first_divergence(r["tokens"], base["tokens"])
        note = "-" if same_ids and same_text else f"token {at}" if at is not None else "text differs"
        widest = max(r.get("accept_lengths") or [1])
        rows.append(
            f"| cli {m} | {int(same_ids)} of 1 | {int(same_text)} of 1 | {len(r.get('accept_lengths') or [])} | "
            f"{widest} | {note} |"
        )
    return rows


def first_moving_layer(target) -> str:
    """Where the kernel path's rows move with the width: the self-check's prefix and continuation
    (invariance.rows_match), plain steps against one block, every decoder layer's output tapped;
    the first layer (and what it holds) whose output row differs, or the logits only. For a
    family whose self-check did not pick `kernels`; the target is put back on its path."""
    import mlx.core as mx

    from mlx_dspark.models import invariance

    before = invariance.path_of(target)
    invariance.set_path(target, "kernels")
    try:
        vocab, n_layers, H = max(target.vocab_size, 2), target.num_layers, target.hidden_size
        ids = mx.array([[(31 * i + 7) % vocab for i in range(29)]], dtype=mx.int32)
        taps = tuple(range(n_layers))

        def prefilled():
            cache = target.make_cache()
            mx.eval(target.forward(ids[:, :23], cache, last_only=True).logits)
            return cache

        a = prefilled()
        steps = [target.forward(ids[:, 23 + j : 24 + j], a, taps=taps) for j in range(6)]
        block = target.forward(ids[:, 23:], prefilled(), taps=taps)
        mx.eval([s.hidden for s in steps], block.hidden, block.logits)
        for layer in range(n_layers):
            sl = slice(layer * H, (layer + 1) * H)
            for j, s in enumerate(steps):
                if not mx.array_equal(s.hidden[:, 0, sl], block.hidden[:, j, sl]).item():
                    mod = target.layers[layer]
                    parts = [
                        type(getattr(mod, n)).__name__ for n in ("linear_attn", "self_attn", "mlp") if hasattr(mod, n)
                    ]
                    return f"layer {layer} ({type(mod).__name__}: {', '.join(parts)}), row {j} of 6"
        for j, s in enumerate(steps):
            if not mx.array_equal(s.logits[:, 0], block.logits[:, j]).item():
                return f"every layer's rows equal; the logits (final norm / head) differ at row {j}"
        return "no row differs in this check (the self-check's split block may be what moved)"
    finally:
        invariance.set_path(target, before)


def skip_reason(name: str) -> str | None:
    if FAMILIES[name][0] == "mlx-vlm":
        try:
            import mlx_vlm  # noqa: F401
        except ImportError as e:
            return f"mlx-vlm is not installed here ({e}); Gemma through mlx-vlm needs the [gemma] extra"
    return None


def run_family(name: str, args, root: Path, out: list[str]) -> str:
    """Writes the family's lines to `out`; returns ok (every mode identical, a self-check that found
    an invariant path), failed, or skipped."""
    import mlx_dspark as md
    from mlx_dspark.kernels import invariant_gather
    from mlx_dspark.models import invariance

    def say(line: str = "") -> None:
        print(line, flush=True)
        out.append(line)

    reason = skip_reason(name)
    if reason:
        say(f"### {name}: SKIPPED: {reason}")
        say()
        return "skipped"
    t0 = time.perf_counter()
    path = write_fixture(name, root)
    target, tok = md.load_target(str(path), dtype=args.dtype, quantize=args.quantize)
    load_s = time.perf_counter() - t0
    verdict = target.invariance
    moe = FAMILIES[name][2]
    experts = invariant_gather.gather_path() if moe and invariance.path_of(target) == "kernels" else "MLX's own"
    checked = verdict not in ("none", "off")
    say(
        f"### {name} ({FAMILIES[name][0]}, {target.model_type}, rollback {target.rollback_kind}): "
        f"self-check invariance={verdict}" + ("" if checked else " (NO INVARIANT PATH: drafting modes may differ)")
    )
    say(
        f"decode path {invariance.path_of(target)}"
        + (" (compiled steps)" if target.compiled_decode is not None else "")
        + (f", experts {experts}" if moe else "")
        + f"; load + self-check {load_s:.1f} s"
        + (f"; refusals: {target.rollback_refusal or ''} {target.tap_refusal or ''}" if target.tap_refusal else "")
    )
    if verdict not in ("native", "kernels"):
        say(f"kernel path: rows first move with the width at {first_moving_layer(target)}")
    modes = [m for m in args.modes.split(",") if m and m != "baseline"]
    ds = drafters(name, path, target, root, modes) if not target.tap_refusal else {}
    say("")
    say("| mode | ids identical | text identical | rounds | max tokens / round | first divergence |")
    say("|---|---|---|---|---|---|")
    prompts = PROMPTS[: args.prompts]
    bases = []
    for text in prompts:
        ids = md.encode_prompt(tok, text)
        bases.append((ids, md.generate(target, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=args.tokens)))
    n_base = sum(len(b.tokens) for _, b in bases)
    say(f"| baseline | - | - | {sum(b.rounds for _, b in bases)} | 1 | ({n_base} tokens) |")
    ok = checked
    for m in modes:
        if m in ("dspark", "dflash") and m not in ds:
            say(f"| {m} | - | - | - | - | not run: {target.tap_refusal} |")
            continue
        same_ids = same_text = rounds = widest = 0
        first, off = None, None
        for i, (ids, base) in enumerate(bases):
            kw = {"proposer": scripted_proposer(base.tokens + [0] * 64)} if m == "scripted" else {"mode": m}
            r = md.generate(
                target,
                tok,
                None,
                prompt_ids=ids,
                drafter=ds.get(m),
                max_new_tokens=args.tokens,
                max_draft=args.max_draft,
                **kw,
            )
            same_ids += r.tokens == base.tokens
            same_text += r.text == base.text
            rounds += r.rounds
            widest = max([widest] + r.accept_lengths)
            off = off or r.stats.get("speculation_off")
            if first is None and (r.tokens != base.tokens or r.text != base.text):
                at = first_divergence(r.tokens, base.tokens)
                if at is None:
                    c = first_divergence(list(r.text), list(base.text))
                    first = f"prompt {i}: same ids, text differs at char {c}"
                else:
                    b_at = base.tokens[at] if at < len(base.tokens) else None
                    r_at = r.tokens[at] if at < len(r.tokens) else None
                    first = f"prompt {i} token {at}: baseline {b_at}, {m} {r_at}"
        n = len(bases)
        ok = ok and same_ids == n and same_text == n
        note = first or ("-" if not off else f"speculation off: {off}")
        say(f"| {m} | {same_ids} of {n} | {same_text} of {n} | {rounds} | {widest} | {note} |")
    if args.cli:
        for row in cli_rows(name, path, root, args, ds):
            ok = ok and " 1 of 1 | 1 of 1 |" in row
            say(row)
    say("")
    return "ok" if ok else "failed"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--quantize", type=int, choices=(4, 8), help="quantize each target at load")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--modes", default="baseline,lookup,dspark,dflash,scripted")
    ap.add_argument("--prompts", type=int, default=3, help=f"how many of the {len(PROMPTS)} prompts")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--max-draft", type=int, default=7)
    ap.add_argument("--cli", action="store_true", help="also the first prompt through mlx-dspark generate")
    ap.add_argument("--out")
    args = ap.parse_args()
    names = [f for f in args.families.split(",") if f]
    unknown = [f for f in names if f not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown}: expected some of {', '.join(FAMILIES)}")

    # the self-check is what is measured here: never a verdict stored by an earlier run (or version)
    os.environ.setdefault("MLX_DSPARK_INVARIANT_CACHE", "refresh")
    import mlx.core as mx

    from mlx_dspark import benchmark as bm

    quant = f", {args.quantize}-bit" if args.quantize else ""
    lines = [
        f"## Family identity: every mode vs baseline, {args.dtype}{quant}, {bm.device_stamp()}",
        f"`{' '.join(sys.argv)}` at {time.strftime('%Y-%m-%d %H:%M')}; device {mx.default_device()}, "
        f"MLX {mx.__version__}, MLX_DSPARK_INVARIANT={os.environ.get('MLX_DSPARK_INVARIANT', 'auto')}, "
        f"MLX_DSPARK_INVARIANT_CACHE={os.environ['MLX_DSPARK_INVARIANT_CACHE']}; "
        f"{args.prompts} prompts x {args.tokens} tokens, max draft {args.max_draft}, sliding windows {WINDOW}",
        "",
    ]
    for line in lines:
        print(line, flush=True)
    written = 0

    def flush() -> None:  # the report grows family by family: a run cut short keeps what it finished
        nonlocal written
        if args.out:
            with open(args.out, "a") as f:
                f.write("".join(line + "\n" for line in lines[written:]))
        written = len(lines)

    flush()
    root = Path(tempfile.mkdtemp(prefix="family-identity-"))
    atexit.register(shutil.rmtree, root, True)
    failed, skipped = [], []
    for name in names:
        try:
            status = run_family(name, args, root, lines)
        except Exception as e:  # one family's crash is reported; the others still run
            msg = f"### {name}: ERROR {type(e).__name__}: {e}"
            print(msg, flush=True)
            traceback.print_exc()
            lines += [msg, ""]
            status = "failed"
        (failed if status == "failed" else skipped if status == "skipped" else []).append(name)
        flush()
    ran = len(names) - len(skipped)
    summary = f"**{ran - len(failed)} of {ran} families run identical in every mode**" + (
        f" (not: {', '.join(failed)})" if failed else ""
    )
    if skipped:
        summary += f"; skipped: {', '.join(skipped)}"
    print(summary, flush=True)
    lines += [summary, ""]
    flush()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
