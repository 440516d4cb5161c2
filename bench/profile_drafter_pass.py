"""Where one DSpark drafter pass spends its time: its parts, each timed alone.

  python bench/profile_drafter_pass.py [--context 200] [--out bench/results/drafter-pass-cpu.md]

The demo pair (float32, the CLI's loading) with a random context of `--context` tapped rows
ingested. Each part runs on the same inputs with its own mx.eval, median of 25 calls after 3
warm-up calls, inside native_products() as a drafter pass runs: the whole block's hidden states,
one backbone layer and its parts, the final norm, and `sample` (lm_head rows, the Markov chain,
the confidences). Parts timed alone each pay an eval of their own, so they sum to a little more
than the whole. Then the pass as a round runs it: DrafterProposer.propose with its draft read
back (what the calibration times) and, where the pass compiles (the GPU), the compiled pass alone.
"""

from __future__ import annotations

import argparse
import time

import _package  # noqa: F401  (the installed mlx_dspark, else python/)
import mlx.core as mx  # noqa: E402

from mlx_dspark import benchmark as bm  # noqa: E402
from mlx_dspark.api import drafter_for  # noqa: E402
from mlx_dspark.kernels.native_products import native_products  # noqa: E402
from mlx_dspark.models.compiled_draft import _greedy  # noqa: E402


def median_ms(fn, n: int = 25) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e3


def whole_pass_rows(target, d, context: int) -> list[tuple[str, float]]:
    """A drafter round's pass as the loop runs it: the compiled greedy pass where the pass compiles
    here (models/compiled_draft.py; the GPU), and DrafterProposer.propose with the draft read back,
    as the calibration times it (decode/costs.py _DraftTimer: ingest one row, draft, read)."""
    from mlx_dspark.decode.costs import _DraftTimer
    from mlx_dspark.models import compiled_draft

    ids = [(17 + 7919 * i) % 4000 + 1 for i in range(context)]
    out = target.forward(mx.array([ids]), target.make_cache(), taps=tuple(d.taps), last_only=True)
    timer = _DraftTimer(d, target, ids, out.hidden[0])
    for _ in range(28):
        timer.time()
    got = [("propose + read back (ingest one row, draft the block: the calibration's drafter pass)", timer.best * 1e3)]
    compiled = compiled_draft.for_drafter(d)
    if compiled is not None and not compiled.failed:
        state, row = timer.prop.state, out.hidden[0][-1:]
        got.append(
            (
                "the compiled greedy pass alone (no row to ingest, tokens evaluated)",
                median_ms(lambda: mx.eval(compiled(77, None, state, False)[0])),
            )
        )
        got.append(
            ("  with one row ingested first (op by op)", median_ms(lambda: mx.eval(compiled(77, row, state, False)[0])))
        )
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--out")
    a = ap.parse_args()
    _, target, _ = bm.load_bench_target(None)
    d = drafter_for(target, "dspark", None)
    bb = d.model
    ctx = mx.random.normal((a.context, d.spec.backbone.context_dim), key=mx.random.key(0))
    state = d.new_state()
    d.ingest(ctx, state)
    mx.eval([c.keys for c in state])
    rows = []
    with native_products():
        ids = mx.array([77] + [d.mask_token_id] * (d.block_size - 1), dtype=mx.int32)
        x = d.embed(ids)[None]
        layer, cache, rope = bb.layers[0], state[0], bb._rope
        xn = layer.input_layernorm(x)
        h = d.block_hidden(77, None, state)
        mx.eval(x, xn, h)
        attn = layer.self_attn
        rows = [
            ("block hidden states (the backbone, all layers)", lambda: mx.eval(d.block_hidden(77, None, state))),
            (f"one layer (of {len(bb.layers)})", lambda: mx.eval(layer(x, None, rope, cache))),
            ("  input norm", lambda: mx.eval(layer.input_layernorm(x))),
            ("  attention (projections, norms, RoPE, cache append)", lambda: mx.eval(attn(xn, None, rope, cache))),
            ("    q projection", lambda: mx.eval(attn.q_proj(xn))),
            ("    k / v projections, k norm, RoPE", lambda: mx.eval(*attn._kv(xn, rope, cache.offset))),
            ("  MLP (gate, up, SiLU-and-multiply, down)", lambda: mx.eval(layer.mlp(xn))),
            ("final norm", lambda: mx.eval(bb.norm(x))),
            (
                "sample (lm_head rows, Markov chain, confidences)",
                lambda: mx.eval(*[o for o in d.sample(h, 77, _greedy, True)[::2] if o is not None]),
            ),
        ]
        timed = [(name, median_ms(fn)) for name, fn in rows]
    timed += whole_pass_rows(target, d, a.context)
    lines = [
        f"\n### profile_drafter_pass.py, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n",
        f"`python bench/profile_drafter_pass.py --context {a.context}`; {bm.device_stamp()}; "
        f"drafter block {d.block_size}, {len(bb.layers)} layers\n",
        "| part | ms (median) |",
        "|---|---:|",
        *(f"| {name} | {ms:.3f} |" for name, ms in timed),
    ]
    bm.emit("\n".join(lines), a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
