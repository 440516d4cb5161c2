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
    "    return {\"total\": total, \"count\": count, \"mean\": mean}\n"
    "```\n"
)
CHAT_PROMPT = "Explain in a few sentences why the sky is blue."
CODE_PROMPT = "Write a Python function that checks whether a string is a palindrome, with a short docstring."


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
    from .models.loading import load_target

    if model is None:
        from .models.demo import demo_model_path

        model = str(demo_model_path())
    target, tok = load_target(model, dtype=dtype)
    return model, target, tok


def cpu_name() -> str:
    """The processor's model name (from /proc/cpuinfo on Linux), else the machine type."""
    from pathlib import Path

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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


def ours(target, tokenizer, ids: list[int], n: int, mode: str, drafter=None, **kw) -> Measure:
    r = generate(target, tokenizer, None, prompt_ids=ids, mode=mode, drafter=drafter, max_new_tokens=n, **kw)
    return Measure(r.mode, r.tokens, r.decode_tps, r.mean_accept_len, r.prefill_s, dict(r.stats))


def compare(target, tokenizer, prompt: str, n: int, sides: list[str], drafter=None, repeats: int = 1,
            chat_template: bool = True, **kw) -> dict[str, Measure]:
    """Run each side on the same prompt (warm-up first); the best of `repeats` decode tok/s."""
    ids = encode_prompt(tokenizer, prompt, chat_template=chat_template)
    out: dict[str, Measure] = {}
    for side in sides:
        run = (lambda: mlx_lm_decode(target, ids, n)) if side == "mlx_lm" else (
            lambda: ours(target, tokenizer, ids, n, side, drafter=drafter, **kw))
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
        same = "same tokens" if m.tokens == ref.tokens else f"DIFFERENT tokens (first at {_first_diff(m.tokens, ref.tokens)})"
        lines.append(f"{side:>9}: {m.decode_tps:8.2f} tok/s  x{ratio:5.3f} vs {base}  accept {m.mean_accept:5.2f}  "
                     f"{len(m.tokens)} tokens, {same}")
    return lines


def _first_diff(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
