"""Decode tok/s at T = 0.7 and T = 1.0 against T = 0, for every mode, on the CPU.

  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
      python bench/bench_sampling.py [--max-new-tokens 64] [--trials 2] [--out bench/results/sampling-cpu.md]

Target: the demo model (SmolLM2-135M-Instruct, GGUF Q4_1 -> float32; real weights, so lookup's
acceptance at T > 0 is real). Until a real DSpark/DFlash pair exists (issue "distill"), the
DSpark and DFlash rows use random-weight drafters in the real DeepSpec packaging for this
target (taps [1, 15, 28], block 7): they accept almost nothing, so those rows measure the cost
of a sampled round (DraftSampler per slot, processed target rows, the accept kernel) against a
greedy one, not a speedup.

Sampling settings per column: T = 0 (greedy); T = 0.7 and T = 1.0 (temperature only); and, at
T = 0.7, top-p 0.9 (a sort over the vocabulary per row) and presence penalty 0.5 (penalties
disable the pipelined plain step: the next token's distribution depends on the pending one).
Every run is seeded; figures are the best decode tok/s of `--trials` runs after a warm-up run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
import _package  # noqa: E402,F401  (the installed mlx_dspark, else python/)

sys.path.insert(0, str(ROOT / "tests"))

from mlx_dspark import benchmark as bm  # noqa: E402
from mlx_dspark.api import encode_prompt, generate  # noqa: E402
from mlx_dspark.decode.sampling import SamplingParams  # noqa: E402

SETTINGS = {
    "T=0": dict(temperature=0.0),
    "T=0.7": dict(temperature=0.7),
    "T=1.0": dict(temperature=1.0),
    "T=0.7 top-p 0.9": dict(temperature=0.7, top_p=0.9),
    "T=0.7 presence 0.5": dict(temperature=0.7, presence_penalty=0.5),
}


def drafters_for(target, source_dir: Path, workdir: Path) -> dict:
    from drafter_fixtures import write_deepspec

    from mlx_dspark.models.drafters import load_drafter

    out = {}
    for kind, kw in (("dspark", dict(markov_rank=256)), ("dflash", dict(markov_rank=0, confidence=False))):
        d = workdir / f"random-{kind}"
        if not (d / "model.safetensors").exists():
            write_deepspec(
                d,
                source_dir,
                layers=5,
                heads=9,
                kv_heads=3,
                head_dim=64,
                intermediate=1536,
                block=7,
                taps=[1, 15, 28],
                std=0.3,
                **kw,
            )
        out[kind] = load_drafter(str(d), target, bits=16)
    return out


def measure_mode(target, tok, ids, mode, drafter, n, settings, trials, seed=0) -> dict:
    """Best decode tok/s per setting; the settings take turns within each trial, so load drift on
    a shared machine hits them alike."""

    def once(kw, k):
        c0 = time.process_time()
        r = generate(
            target,
            tok,
            None,
            prompt_ids=ids,
            mode=mode,
            drafter=drafter,
            max_new_tokens=k,
            sampling=SamplingParams(seed=seed, **kw),
            lookup_drafts=False,
        )
        r.stats["cpu_ms_per_token"] = (time.process_time() - c0) * 1e3 / max(len(r.tokens), 1)
        return r

    for name in settings:  # warm-up (kernel compilation)
        once(SETTINGS[name], 8)
    best: dict = {}
    for _ in range(trials):
        for name in settings:
            r = once(SETTINGS[name], n)
            if name not in best or r.decode_tps > best[name].decode_tps:
                best[name] = r
    return best


def micro(V: int, repeats: int = 30) -> list[str]:
    """Cost of the sampling ops alone, against a plain argmax: processing + draw of one row (a
    plain step) and processing + accept of a verify block of w = 8 (7 drafts with q), on both
    paths: lazy MLX (the GPU default) and numpy on the host (the CPU default, decode/sampled.py)."""
    import statistics

    import mlx.core as mx
    import numpy as np

    from mlx_dspark.decode import sampled

    out = [
        "",
        f"Sampling ops alone, vocab {V}, median CPU time of {repeats} (ms; CPU time: less sensitive to "
        "other load than wall time). w=1: processing + draw of one row; w=8: processing + accept of "
        "a verify block (7 drafts, q given). mlx = the lazy path (GPU default), host = numpy (CPU default).",
        "",
        "| setting | argmax w=1 | mlx w=1 | host w=1 | argmax w=8 | mlx w=8 | host w=8 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(size=(8, V)).astype(np.float32) * 3)
    q = mx.softmax(mx.array(rng.normal(size=(1, 7, V)).astype(np.float32)), axis=-1)
    d = mx.array(rng.integers(0, V, size=(1, 7)).astype(np.int32))
    hist = [int(t) for t in rng.integers(0, V, size=300)]
    mx.eval(logits, q, d)

    def t(fn):
        for _ in range(3):
            mx.eval(fn())
        ts = []
        for _ in range(repeats):
            t0 = time.process_time()
            mx.eval(fn())
            ts.append(time.process_time() - t0)
        return statistics.median(ts) * 1e3

    for name, kw in SETTINGS.items():
        sp = SamplingParams(seed=0, **kw)
        cells = []
        for w in (1, 8):
            cells.append(t(lambda: mx.argmax(logits[:w], axis=-1)))
            for host in (False, True):
                acc = sampled.SampledAcceptor(sp)
                acc.host = host
                acc.begin(hist[:100])
                if w == 1:
                    cells.append(t(lambda: acc.sample(logits[0], hist)))
                else:
                    draft = sampled.Draft(tokens=d[0].tolist(), q=q[0])
                    cells.append(t(lambda: mx.array(acc.verify(logits, draft, hist))))
        out.append(f"| {name} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=["baseline", "lookup", "dspark", "dflash"])
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS))
    ap.add_argument("--workdir", default="/tmp/mlx-dspark-bench-sampling")
    ap.add_argument("--out", help="write the markdown report here")
    ap.add_argument("--micro-only", action="store_true", help="only the sampling-ops table (vocab 49152)")
    args = ap.parse_args()
    if args.micro_only:
        print("\n".join(micro(49152)))
        return 0

    from mlx_dspark.blas import loaded_blas
    from mlx_dspark.models.demo import demo_model_path
    from mlx_dspark.models.loading import load_target

    model = str(demo_model_path())
    target, tok = load_target(model, dtype="float32")
    source_dir = Path(target.source) if Path(target.source).is_dir() else None
    if source_dir is None:  # the converted GGUF folder (config.json + model.safetensors)
        from mlx_dspark.models.gguf import convert_gguf_cached

        source_dir = Path(convert_gguf_cached(Path(model), dtype="float32", quantize=None))
    drafters = {}
    if any(m in ("dspark", "dflash") for m in args.modes):
        drafters = drafters_for(target, source_dir, Path(args.workdir))
    prompts = {"baseline": bm.CHAT_PROMPT, "lookup": bm.COPY_PROMPT, "dspark": bm.CHAT_PROMPT, "dflash": bm.CHAT_PROMPT}
    rows = []
    t_start = time.time()
    for mode in args.modes:
        ids = encode_prompt(tok, prompts[mode])
        res = measure_mode(target, tok, ids, mode, drafters.get(mode), args.max_new_tokens, args.settings, args.trials)
        for name in args.settings:
            r = res[name]
            print(
                f"{mode:8s} {name:20s} {r.decode_tps:7.2f} tok/s  accept {r.mean_accept_len:.2f}  "
                f"{len(r.tokens)} tokens  {r.stats['cpu_ms_per_token']:.0f} CPU ms/token",
                flush=True,
            )
        rows.append((mode, res))

    load = os.getloadavg()[0]
    lines = [
        f"## Sampling: decode tok/s at T > 0 against T = 0 ({bm.device_stamp()})",
        "",
        f"`{' '.join(sys.argv)}` at {time.strftime('%Y-%m-%d %H:%M')} ({time.time() - t_start:.0f} s); "
        f"BLAS: {loaded_blas() or 'bundled reference BLAS'}; load average {load:.1f} on {os.cpu_count()} cores "
        "(other work on the machine inflates every figure). Target: SmolLM2-135M-Instruct (demo GGUF, "
        f"float32), {args.max_new_tokens} new tokens, seed 0, best of {args.trials} (settings interleaved) after a "
        "warm-up. Prompts: "
        "chat (baseline, dspark, dflash), copy (lookup). DSpark/DFlash: random-weight drafters (DeepSpec "
        "packaging, 5 layers, block 7): their rows show the cost of sampled rounds, not a speedup.",
        "",
    ]
    lines.append("| mode | " + " | ".join(args.settings) + " |")
    lines.append("|---|" + "---:|" * len(args.settings))
    for mode, res in rows:
        base = res.get("T=0")
        cells = []
        for name in args.settings:
            r = res[name]
            rel = f" ({r.decode_tps / base.decode_tps:.2f}x)" if base and name != "T=0" and base.decode_tps else ""
            cells.append(f"{r.decode_tps:.1f}{rel}; {r.stats['cpu_ms_per_token']:.0f} ms; acc {r.mean_accept_len:.2f}")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Cells: best decode tok/s (ratio to T = 0 of the same mode); CPU time per generated token of "
        "that run, prefill included (less sensitive to other load than wall time, not immune); mean "
        "tokens committed per forward. Sampled runs may stop early at EOS (different token counts).",
    ]
    lines += micro(target.vocab_size)
    text = "\n".join(lines) + "\n"
    bm.emit(text, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
