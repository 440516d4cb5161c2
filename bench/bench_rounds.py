"""Per-round cost breakdown of DSpark rounds on the CPU (float32), with a SmolLM2-shaped pair.

  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
      python bench/bench_rounds.py [--rounds 40] [--context 200] [--out bench/results/rounds-cpu.md]

The pair is written once (random weights) under --workdir:
  target   llama, hidden 576, 30 layers, 9 heads / 3 KV heads, intermediate 1536, vocab 49152,
           tied embeddings (the shape of SmolLM2-135M), float32
  drafter  DeepSpec DSpark packaging: 5 layers of the same width, taps [1, 8, 14, 21, 27],
           block 7, Markov rank 256, confidence head

Each round of the real verify loop (decode/loop.py, the DSpark proposer) is instrumented: every
stage is forced to completion (mx.eval) when it ends, so the stages add up to the round:
  drafter backbone   the 5-layer block pass (context rows projected into the cache + 7 slots)
  draft lm_head      U = lm_head(7 slot states)
  Markov sampling    7 sequential z_j = U_j + W2 . W1[prev], argmax (greedy)
  verify             the target forward over anchor + 7 drafts (width 8), taps included
  accept             greedy prefix match
  commit + rest      trim, context rows, bookkeeping: the round's time minus the stages above
A random drafter accepts almost nothing, which does not matter for per-round cost. The plain
(width-1) decode step of the same target is measured for comparison.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
import _package  # noqa: E402,F401  (the installed mlx_dspark, else python/)

sys.path.insert(0, str(ROOT / "tests"))

import mlx.core as mx  # noqa: E402

TAPS = [1, 8, 14, 21, 27]
UPSTREAM_MARKOV_MS = 0.6  # upstream mlx-dspark's published Markov-head overhead per round (M4 Pro)
QWEN3_VOCAB = 151936


def write_pair(workdir: Path) -> tuple[Path, Path]:
    from drafter_fixtures import write_deepspec
    from fixtures import write_model

    tdir, ddir = workdir / "smollm2-shaped", workdir / "dspark-5layer"
    if not (tdir / "model.safetensors").exists():
        write_model(
            tdir,
            "llama",
            layers=30,
            hidden=576,
            heads=9,
            kv_heads=3,
            intermediate=1536,
            tie=True,
            model_vocab=49152,
            seed=0,
        )
    if not (ddir / "model.safetensors").exists():
        write_deepspec(
            ddir,
            tdir,
            layers=5,
            heads=9,
            kv_heads=3,
            head_dim=64,
            intermediate=1536,
            markov_rank=256,
            block=7,
            taps=TAPS,
            std=0.3,
        )
    return tdir, ddir


class Stages:
    def __init__(self):
        self.t: dict[str, list[float]] = {}

    def add(self, key: str, dt: float) -> None:
        self.t.setdefault(key, []).append(dt)

    def wrap(self, obj, name: str, key, outputs):
        fn = getattr(obj, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            mx.eval(outputs(out))
            self.add(key(*a, **k) if callable(key) else key, time.perf_counter() - t0)
            return out

        setattr(obj, name, timed)
        return fn


def _arrays(out):
    if isinstance(out, mx.array):
        return [out]
    if isinstance(out, (list, tuple)):
        return [x for o in out for x in _arrays(o)]
    vals = [getattr(out, a, None) for a in ("logits", "hidden")]
    return [v for v in vals if isinstance(v, mx.array)]


def run_rounds(target, drafter, prompt, rounds: int) -> dict:
    from mlx_dspark.decode import accept, loop
    from mlx_dspark.decode.modes import drafter_proposer

    st = Stages()
    d_fns = [
        st.wrap(drafter, "block_hidden", "drafter backbone", _arrays),
        st.wrap(drafter, "logits", "draft lm_head", _arrays),
        st.wrap(drafter, "sample", "draft sample (lm_head + Markov)", _arrays),
    ]
    t_fwd = st.wrap(
        target, "forward", lambda tokens, *a, **k: "verify" if tokens.shape[-1] > 1 else "plain step", _arrays
    )
    acc = accept.GreedyAcceptor.verify
    st.wrap(accept.GreedyAcceptor, "verify", "accept", lambda out: [])
    p = drafter_proposer(drafter, lookup_drafts=False)
    starts: list[float] = []
    propose = p.propose

    def stamped(*a, **k):  # round boundaries: one propose per round
        starts.append(time.perf_counter())
        return propose(*a, **k)

    p.propose = stamped
    try:
        loop.run(target, prompt, p, max_new_tokens=rounds + 2, max_draft=drafter.block_drafts)
    finally:
        for name, fn in zip(("block_hidden", "logits", "sample"), d_fns):
            setattr(drafter, name, fn)
        target.forward = t_fwd
        accept.GreedyAcceptor.verify = acc
    samples = {k: [x * 1e3 for x in (v[1:] if len(v) > 2 else v)] for k, v in st.t.items()}
    # the first round also projects the whole prompt into the drafter's context: left out
    samples["round"] = [(b - a) * 1e3 for a, b in zip(starts[1:], starts[2:])]
    return samples


def summarize(samples: dict) -> dict:
    med = {k: statistics.median(v) for k, v in samples.items() if v}
    out = {
        "drafter backbone": med.get("drafter backbone", 0.0),
        "draft lm_head": med.get("draft lm_head", 0.0),
        "Markov sampling": med.get("draft sample (lm_head + Markov)", 0.0) - med.get("draft lm_head", 0.0),
        "verify": med.get("verify", 0.0),
        "accept": med.get("accept", 0.0),
        "round": med["round"],
    }
    out["commit + rest"] = out["round"] - sum(
        out[k] for k in ("drafter backbone", "draft lm_head", "Markov sampling", "verify", "accept")
    )
    return out


def markov_micro(drafter, repeats: int = 30) -> float:
    """7 sequential Markov steps from given base logits, lazily chained, one eval (median ms)."""
    V = drafter.spec.vocab_size
    U = mx.random.normal((drafter.block_drafts, V))
    mx.eval(U)

    def choose(row, drafted):
        return mx.argmax(row).astype(mx.int32), None

    times = []
    for _ in range(repeats + 3):
        t0 = time.perf_counter()
        prev = mx.array(5, dtype=mx.int32)
        toks = []
        for j in range(U.shape[0]):
            t, _ = choose(U[j] + drafter.markov_bias(prev).astype(U.dtype), toks)
            toks.append(t)
            prev = t
        mx.eval(toks)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:]) * 1e3


def plain_step(target, prompt, n: int = 30) -> float:
    from mlx_dspark.decode import loop

    res = loop.run(target, prompt, None, max_new_tokens=n + 1)
    return res.decode_s / max(len(res.tokens) - 1, 1) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=60, help="rounds per drafter, over all repetitions")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    ap.add_argument("--context", type=int, default=200, help="prompt tokens before the first round")
    ap.add_argument("--bits", type=int, nargs="+", default=[16, 4], help="drafter precisions to measure")
    ap.add_argument("--workdir", default="/tmp/mlx-dspark-bench-rounds")
    ap.add_argument("--out", help="write the markdown report here")
    args = ap.parse_args()

    from mlx_dspark import benchmark as bm
    from mlx_dspark.blas import loaded_blas
    from mlx_dspark.models.drafters import load_drafter
    from mlx_dspark.models.loading import load_target

    tdir, ddir = write_pair(Path(args.workdir))
    target, _ = load_target(str(tdir), dtype="float32")
    prompt = [int(x) for x in mx.random.randint(0, target.vocab_size, (args.context,), key=mx.random.key(0)).tolist()]
    plain_step(target, prompt, 5)  # warm up
    drafters = {}
    for bits in args.bits:
        drafters[bits] = load_drafter(str(ddir), target, bits=bits)
        run_rounds(target, drafters[bits], prompt, 4)  # warm up (kernel compilation)
    # Interleaved repetitions, so that load drifting on a shared machine hits every variant alike.
    base, acc = [], {b: {} for b in args.bits}
    per = max(args.rounds // args.reps, 4)
    for _ in range(args.reps):
        base.append(plain_step(target, prompt))
        for bits, d in drafters.items():
            for k, v in run_rounds(target, d, prompt, per).items():
                acc[bits].setdefault(k, []).extend(v)
    base_ms = statistics.median(base)
    rows = []
    for bits, d in drafters.items():
        r = summarize(acc[bits])
        r["markov_micro"] = markov_micro(d)
        rows.append((bits, r))

    blas = loaded_blas()
    import os

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        f"## DSpark per-round cost, CPU float32 target ({bm.device_stamp()})",
        "",
        f"`{' '.join(sys.argv)}` at {time.strftime('%Y-%m-%d %H:%M')}; BLAS: {blas or 'bundled reference BLAS'}; "
        f"load average {load:.1f} on {os.cpu_count()} cores (other work on the machine inflates every figure)",
        f"Target: random llama shaped like SmolLM2-135M (hidden 576, 30 layers, 9/3 heads, intermediate 1536, "
        f"vocab 49152), float32, {args.context}-token prompt. Drafter: 5-layer DSpark (DeepSpec packaging), "
        f"block 7, Markov rank 256, taps {TAPS}. Medians over {args.rounds} rounds of the real loop, in {args.reps} interleaved repetitions "  # noqa: E501
        "(the first round, which also projects the prompt into the drafter context, left out), each stage "
        "forced to completion; 'round' is the median time from one round's start to the next.",
        "",
    ]
    cols = ["drafter backbone", "draft lm_head", "Markov sampling", "verify", "accept", "commit + rest", "round"]
    lines.append("| drafter | " + " | ".join(cols) + " |")
    lines.append("|---|" + "---:|" * len(cols))
    for bits, r in rows:
        name = "float32 (bits 16)" if bits == 16 else f"{bits}-bit"
        lines.append(f"| {name} | " + " | ".join(f"{r[c]:.2f} ms" for c in cols) + " |")
    lines.append("")
    lines.append(
        "Shares of the round, and the break-even: a round pays when it commits more tokens than round / plain step."
    )
    lines.append("")
    lines.append("| drafter | " + " | ".join(cols[:-1]) + " | round / plain step |")
    lines.append("|---|" + "---:|" * len(cols))
    for bits, r in rows:
        name = "float32 (bits 16)" if bits == 16 else f"{bits}-bit"
        lines.append(
            f"| {name} | "
            + " | ".join(f"{100 * r[c] / r['round']:.1f}%" for c in cols[:-1])
            + f" | {r['round'] / base_ms:.2f} |"
        )
    lines += [
        "",
        f"Plain decode step of the same target (width 1, pipelined baseline): {base_ms:.2f} ms "
        f"(median of {args.reps} runs of 30 steps, interleaved with the rounds).",
        "",
    ]
    lines.append(
        "Markov head alone (7 sequential steps from given base logits, one eval), and the comparison "
        f"with upstream mlx-dspark's published ~{UPSTREAM_MARKOV_MS} ms/round (M4 Pro, 4-bit drafter, "
        f"Qwen3 vocab {QWEN3_VOCAB}):"
    )
    lines.append("")
    lines.append("| drafter | Markov, vocab 49152 | x 3.09 for vocab 151936 (derived) | share of the round |")
    lines.append("|---|---:|---:|---:|")
    for bits, r in rows:
        name = "float32 (bits 16)" if bits == 16 else f"{bits}-bit"
        m = r["markov_micro"]
        lines.append(
            f"| {name} | {m:.2f} ms | {m * QWEN3_VOCAB / 49152:.2f} ms | {100 * r['Markov sampling'] / r['round']:.1f}% |"  # noqa: E501
        )
    text = "\n".join(lines) + "\n"
    bm.emit(text, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
