"""The benchmark harness behind `mlx-dspark benchmark` and the scripts in bench/.

Every figure is measured warm (one untimed run first: MLX compiles kernels on first use) and
ratios are taken from one run of each side, on the same target and prompt.
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from .api import encode_prompt, generate, stop_token_ids
from .machine import cpu_name

COPY_PROMPT = (
    "Rewrite this function exactly, but rename the variable `total` to `acc`. Output only the code.\n\n"
    "```python\n"
    "def summarize(values, weights=None):\n"
    "    total = 0.0\n"
    "    count = 0\n"
    "    for i, value in enumerate(values):\n"
    "        if value is None:\n"
    "            continue\n"
    "        weight = 1.0 if weights is None else weights[i]\n"
    "        total += weight * value\n"
    "        count += 1\n"
    "    if count == 0:\n"
    "        return None\n"
    "    mean = total / count\n"
    '    return {"total": total, "count": count, "mean": mean}\n'
    "```\n"
)
CHAT_PROMPT = "Explain in a few sentences why the sky is blue."
CODE_PROMPT = "Write a Python function that checks whether a string is a palindrome, with a short docstring."
MATH_PROMPT = (
    "A train leaves at 9:40 and arrives at 13:10, covering 245 km. What was its average speed in km/h? Show each step."
)
# `mlx-dspark benchmark` prompt sets: a few short prompts per content class
PROMPT_SETS = {
    "chat": [
        CHAT_PROMPT,
        "Give me three tips for sleeping better, one sentence each.",
        "What is the difference between a virus and a bacterium?",
    ],
    "code": [
        CODE_PROMPT,
        "Write a Python function that returns the n-th Fibonacci number iteratively.",
        "Write a JavaScript function that removes duplicate values from an array.",
    ],
    "math": [MATH_PROMPT, "Solve for x: 3x + 7 = 25. Explain each step.", "What is 15% of 240? Show your working."],
    "copy": [COPY_PROMPT],
}


@dataclass
class Measure:
    label: str
    tokens: list[int]
    decode_tps: float
    mean_accept: float = 1.0
    prefill_s: float = 0.0
    extra: dict = field(default_factory=dict)


def emit(text: str, out: str | None) -> None:
    """Print a benchmark's report and append it to its --out record (bench/results/*.md), if any."""
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a") as f:
            f.write(text + "\n")


def load_bench_target(model: str | None, dtype: str | None = None):
    """(model path or id, target, tokenizer): `model`, or the demo model (SmolLM2-135M-Instruct GGUF)."""
    from .models.demo import model_or_demo
    from .models.loading import load_target

    model = model_or_demo(model)
    target, tok = load_target(model, dtype=dtype)
    return model, target, tok


def device_stamp() -> str:
    dev = mx.default_device()
    name = str(dev)
    if dev == mx.gpu:
        try:
            name = mx.device_info().get("device_name", name)
        except Exception:
            pass
    return f"{name}; {platform.machine()}; mlx {mx.__version__}"


def mlx_lm_decode(target, ids: list[int], n: int) -> Measure:
    """Plain mlx-lm greedy decoding (generate_step), timed like our decode: after the first token."""
    from mlx_lm.generate import generate_step

    stops = set(stop_token_ids(target, target.tokenizer))
    toks, t_first = [], None
    t0 = time.perf_counter()
    for tok, _ in generate_step(mx.array(ids), target.model, max_tokens=n, sampler=lambda lp: mx.argmax(lp, axis=-1)):
        tok = int(tok)
        if t_first is None:
            t_first = time.perf_counter()
        if tok in stops:
            break
        toks.append(tok)
    t_end = time.perf_counter()
    tps = (len(toks) - 1) / (t_end - t_first) if len(toks) > 1 else 0.0
    return Measure("mlx_lm", toks, tps, prefill_s=(t_first or t_end) - t0)


def mlx_lm_generate_decode(target, ids: list[int], n: int) -> Measure:
    """What `mlx_lm.generate` runs (stream_generate: generate_step plus its detokenizer per
    token), greedy, timed like our decode: after the first token."""
    from mlx_lm import stream_generate

    stops = set(stop_token_ids(target, target.tokenizer))
    toks, t_first = [], None
    t0 = time.perf_counter()
    for r in stream_generate(target.model, target.tokenizer, list(ids), max_tokens=n):
        if t_first is None:
            t_first = time.perf_counter()
        if int(r.token) in stops:
            break
        toks.append(int(r.token))
    t_end = time.perf_counter()
    tps = (len(toks) - 1) / (t_end - t_first) if len(toks) > 1 else 0.0
    return Measure("mlx_lm.generate", toks, tps, prefill_s=(t_first or t_end) - t0)


def ours(target, tokenizer, ids: list[int], n: int, mode: str, drafter=None, **kw) -> Measure:
    r = generate(target, tokenizer, None, prompt_ids=ids, mode=mode, drafter=drafter, max_new_tokens=n, **kw)
    return Measure(r.mode, r.tokens, r.decode_tps, r.mean_accept_len, r.prefill_s, dict(r.stats))


def compare(
    target,
    tokenizer,
    prompt: str,
    n: int,
    sides: list[str],
    drafter=None,
    repeats: int = 1,
    chat_template: bool = True,
    **kw,
) -> dict[str, Measure]:
    """Run each side on the same prompt (warm-up first); the best of `repeats` decode tok/s."""
    ids = encode_prompt(tokenizer, prompt, chat_template=chat_template)
    out: dict[str, Measure] = {}
    for side in sides:
        run = (
            (lambda: mlx_lm_decode(target, ids, n))
            if side == "mlx_lm"
            else (lambda: ours(target, tokenizer, ids, n, side, drafter=drafter, **kw))
        )
        if side == "mlx_lm":
            mlx_lm_decode(target, ids, min(n, 8))
        else:
            ours(target, tokenizer, ids, min(n, 8), side, drafter=drafter, **kw)
        runs = [run() for _ in range(repeats)]
        best = max(runs, key=lambda m: m.decode_tps)
        best.extra["decode_tps_runs"] = [round(m.decode_tps, 2) for m in runs]
        best.extra["decode_tps_median"] = round(statistics.median(m.decode_tps for m in runs), 2)
        out[side] = best
    return out


def report(results: dict[str, Measure], base: str) -> list[str]:
    lines = []
    ref = results[base]
    for side, m in results.items():
        ratio = m.decode_tps / ref.decode_tps if ref.decode_tps else float("nan")
        same = (
            "same tokens"
            if m.tokens == ref.tokens
            else f"DIFFERENT tokens (first at {_first_diff(m.tokens, ref.tokens)})"
        )
        lines.append(
            f"{side:>9}: {m.decode_tps:8.2f} tok/s  x{ratio:5.3f} vs {base}  accept {m.mean_accept:5.2f}  "
            f"{len(m.tokens)} tokens, {same}"
        )
    return lines


def _first_diff(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


# ------------------------------------------------------------------ `mlx-dspark benchmark`
def precision(target) -> str:
    """The target's weights as this run holds them: e.g. "float32", "bfloat16, 4-bit (group 64)"."""
    from .models.precision import weights_summary

    dtypes, quant = weights_summary(target.model)
    q = ", ".join(f"{b}-bit (group {g})" for b, g in quant)
    return dtypes.replace("mlx.core.", "") + (f", {q}" if q else "")


def stamp(target, drafter=None) -> dict:
    """Where a benchmark ran: enough to fold a shared JSON into the registry."""
    from ._version import __version__
    from .blas import active_blas

    cpu = mx.default_device() == mx.cpu
    chip = cpu_name()
    if not cpu:
        try:
            chip = mx.device_info().get("device_name", chip)
        except Exception:
            pass
    return {
        "device": "cpu" if cpu else "gpu",
        "chip": chip,
        "cores": __import__("os").cpu_count(),
        "machine": platform.machine(),
        "system": platform.system(),
        "mlx": mx.__version__,
        "mlx_dspark": __version__,
        "blas": active_blas()["name"] if cpu else None,
        "precision": precision(target),
        "model": str(target.source or target.name),
        "drafter": getattr(drafter, "source", None) if drafter is not None else None,
    }


def geomean(xs: list[float]) -> float:
    """The geometric mean of the positive values (0.0 where there are none)."""
    import math

    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else 0.0


def run_sets(
    target,
    tokenizer,
    sets: dict[str, list[str]],
    n: int,
    *,
    mode: str,
    trials: int = 3,
    drafter=None,
    versus_mlx_lm: bool = False,
    progress=None,
    **kw,
) -> dict:
    """Each prompt of each class: a warm-up run per side, then `trials` rounds in which the sides
    alternate; per prompt the median decode tok/s of each side, per class the geometric mean over
    its prompts, and the ratios (mode / baseline, and / mlx-lm)."""
    sides = (["mlx_lm"] if versus_mlx_lm else []) + ["baseline", "mode"]
    total = sum(len(p) for p in sets.values()) * (trials + 1) * len(sides)
    done = 0
    classes, resolved = {}, mode
    for cls, prompts in sets.items():
        rows = []
        for prompt in prompts:
            ids = encode_prompt(tokenizer, prompt)
            runs: dict[str, list[Measure]] = {s: [] for s in sides}
            for t in range(trials + 1):
                order = sides if t % 2 == 0 else list(reversed(sides))
                for side in order:
                    if side == "mlx_lm":
                        m = mlx_lm_decode(target, ids, n)
                    else:
                        m = ours(
                            target,
                            tokenizer,
                            ids,
                            n,
                            "baseline" if side == "baseline" else mode,
                            drafter=drafter,
                            **({} if side == "baseline" else kw),
                        )
                        if side == "mode":
                            resolved = m.label
                    if t:  # t == 0 is the warm-up
                        runs[side].append(m)
                    done += 1
                    if progress:
                        progress(done, total, f"{cls} {side if side != 'mode' else resolved}")
            med = {s: statistics.median(m.decode_tps for m in runs[s]) for s in sides}
            rows.append(
                {
                    "prompt": prompt[:80],
                    "tps": {("mode" if s == "mode" else s): round(v, 3) for s, v in med.items()},
                    "mean_accept": round(statistics.median(m.mean_accept for m in runs["mode"]), 3),
                    "same_tokens": all(m.tokens == runs["baseline"][0].tokens for m in runs["mode"]),
                }
            )
        c = {
            "prompts": rows,
            "baseline_tps": round(geomean([r["tps"]["baseline"] for r in rows]), 3),
            "mode_tps": round(geomean([r["tps"]["mode"] for r in rows]), 3),
            "mean_accept": round(statistics.mean(r["mean_accept"] for r in rows), 3),
            "same_tokens": all(r["same_tokens"] for r in rows),
        }
        c["ratio"] = round(geomean([r["tps"]["mode"] / r["tps"]["baseline"] for r in rows]), 3)
        if versus_mlx_lm:
            c["mlx_lm_tps"] = round(geomean([r["tps"]["mlx_lm"] for r in rows]), 3)
            c["ratio_vs_mlx_lm"] = round(geomean([r["tps"]["mode"] / r["tps"]["mlx_lm"] for r in rows]), 3)
        classes[cls] = c
    return {"mode": resolved, "requested_mode": mode, "trials": trials, "max_new_tokens": n, "classes": classes}


def table(result: dict) -> str:
    vs = any("mlx_lm_tps" in c for c in result["classes"].values())
    head = (
        ["class", "baseline tok/s", f"{result['mode']} tok/s", "x baseline"]
        + (["mlx-lm tok/s", "x mlx-lm"] if vs else [])
        + ["accept", "same tokens"]
    )
    lines = ["  ".join(f"{h:>14}" for h in head)]
    for cls, c in result["classes"].items():
        cells = (
            [cls, f"{c['baseline_tps']:.2f}", f"{c['mode_tps']:.2f}", f"{c['ratio']:.3f}x"]
            + ([f"{c['mlx_lm_tps']:.2f}", f"{c['ratio_vs_mlx_lm']:.3f}x"] if vs else [])
            + [f"{c['mean_accept']:.2f}", "yes" if c["same_tokens"] else "NO"]
        )
        lines.append("  ".join(f"{x:>14}" for x in cells))
    return "\n".join(lines)


def chart(result: dict, stamp_: dict, path: str) -> None:
    """A PNG bar chart of the per-class ratios (matplotlib: pip install 'mlx-dspark[chart]')."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from .errors import UserError

        raise UserError("--chart needs matplotlib: pip install 'mlx-dspark[chart]'") from None
    classes = list(result["classes"])
    vs = all("ratio_vs_mlx_lm" in result["classes"][c] for c in classes)
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(classes), 3.6))
    xs = range(len(classes))
    width = 0.38 if vs else 0.6
    ax.bar(
        [x - (width / 2 if vs else 0) for x in xs],
        [result["classes"][c]["ratio"] for c in classes],
        width,
        label=f"{result['mode']} / baseline",
    )
    if vs:
        ax.bar(
            [x + width / 2 for x in xs],
            [result["classes"][c]["ratio_vs_mlx_lm"] for c in classes],
            width,
            label=f"{result['mode']} / mlx-lm",
        )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(xs), classes)
    ax.set_ylabel("decode speed-up (x)")
    ax.set_title(f"{Path(stamp_['model']).name} on {stamp_['chip']} ({stamp_['precision']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
