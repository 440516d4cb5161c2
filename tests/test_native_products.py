"""A drafter pass on the CPU runs its products through the native row kernel
(kernels/native_products.py): every dense linear and the draft vocabulary's heads take it inside
the pass and nowhere else, what they compute equals MLX's matmul to float32 rounding, a
generation's rows are independent of how many draft together, and the generations stay lossless."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from drafter_fixtures import workspace

import mlx_dspark as md
from mlx_dspark.compat import route_linears_to_invariant_op
from mlx_dspark.decode.drafting import DrafterProposer
from mlx_dspark.kernels import native, native_products
from mlx_dspark.models.drafters import load_drafter

PROMPT = [5, 9, 23, 41, 7, 12, 30, 2, 19]

pytestmark = pytest.mark.skipif(
    mx.default_device() != mx.cpu or native.ext(warn=False) is None, reason="the native kernel runs on the CPU build"
)


@pytest.fixture
def calls(monkeypatch):
    """Counts the native kernel's products (the extension's invariant_linear), with the drafter's
    float32 weights on it (the float16 panels: test_draft_linear.py)."""
    monkeypatch.setenv("MLX_DSPARK_DRAFT_PANELS", "off")
    ext = native.ext(warn=False)
    real = ext.invariant_linear
    seen = []

    class Counting:
        def __getattr__(self, name):
            return getattr(ext, name)

        def invariant_linear(self, x, w, b):
            seen.append(tuple(x.shape))
            return real(x, w, b)

    monkeypatch.setattr(native, "ext", lambda warn=True: Counting())
    from mlx_dspark.kernels import invariant_linear

    invariant_linear._plans.clear()  # plans hold the function they were made with
    yield seen
    invariant_linear._plans.clear()


def _pair(dkey: str, draft_vocab=None):
    route_linears_to_invariant_op()  # what DrafterProposer installs; these tests call the drafter itself
    ws = workspace()
    target, tok = md.load_target(str(ws["target_qwen3"]), dtype="float32")
    d = load_drafter(str(ws[dkey]), target, bits=16)
    if draft_vocab is not None:
        d.restrict_vocab(draft_vocab)
    return target, tok, d


def _backbone_linears(d) -> int:
    return sum(isinstance(m, nn.Linear) and (n == "fc" or n.startswith("layers.")) for n, m in d.model.named_modules())


@pytest.mark.parametrize("dkey", ["dspark_qwen3", "dflash_zlab"])
def test_a_drafter_pass_takes_the_native_products_and_drafts_as_mlx_does(dkey, calls):
    _, _, d = _pair(dkey, draft_vocab=range(0, 300))
    calls.clear()  # the target's load (its invariance probe takes the kernel with a fast BLAS)
    ctx = mx.random.normal((12, d.spec.backbone.context_dim), key=mx.random.key(5))
    state_mlx, state_native = d.new_state(), d.new_state()
    want = d.block_hidden(77, ctx, state_mlx)  # outside a pass: MLX's matmul
    mx.eval(want)
    assert calls == []
    with native_products.native_products():
        got = d.block_hidden(77, ctx, state_native)
        head = d.logits(got)
    mx.eval(got, head)
    assert len(calls) >= _backbone_linears(d) + 1  # every backbone linear, and the draft vocabulary's head
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()
    assert mx.allclose(head, d.logits(want), atol=1e-3, rtol=1e-4).item()
    assert not native_products.is_on()  # the flag ends with the block


def test_the_proposer_routes_its_passes_and_ingestion(calls):
    target, _, d = _pair("dspark_qwen3")
    fwd = target.forward(mx.array([PROMPT]), target.make_cache(), taps=d.taps)
    p = DrafterProposer(d, lookup_drafts=False)
    p.begin(target, PROMPT[:-1], fwd.hidden[0][:-1])
    drafted = p.propose(PROMPT, d.block_drafts, None).read()
    assert len(drafted) == d.block_drafts and calls
    n = len(calls)
    p._add_rows(mx.zeros((1, fwd.hidden.shape[-1])))
    p._ingest_pending(keep=0)  # the context rows' projections (fc, each layer's k/v)
    assert len(calls) > n


def test_a_wide_product_keeps_a_fast_blas(monkeypatch, calls):
    w = mx.random.normal((40, 64), key=mx.random.key(1))
    wide = mx.random.normal((native_products.MAX_ROWS_FAST_BLAS + 1, 64), key=mx.random.key(2))
    with native_products.native_products():
        monkeypatch.setattr(native_products, "_fast_blas", [True])
        assert native_products.dense(wide[:8], w) is not None
        assert native_products.dense(wide, w) is None  # BLAS's sgemm: faster there on some machines
        monkeypatch.setattr(native_products, "_fast_blas", [False])
        y = native_products.dense(wide, w)  # the reference BLAS: the kernel at every width
    assert y is not None and mx.allclose(y, wide @ w.T, atol=1e-4).item()
    assert native_products.dense(wide[:8], w) is None  # outside a pass


def test_batched_drafter_rows_equal_solo_passes_bitwise():
    """The native kernel computes each row alone, so a row's draft does not depend on how many
    generations draft together (MLX's sgemm rounds by width)."""
    _, _, d = _pair("dspark_qwen3")
    ctxs = [mx.random.normal((n, d.spec.backbone.context_dim), key=mx.random.key(n)) for n in (6, 11)]
    with native_products.native_products():
        solo = []
        for c, a in zip(ctxs, (31, 64)):
            h = d.block_hidden(a, c, d.new_state())
            mx.eval(h)
            solo.append(h)
        rows = d.block_hidden_rows([31, 64], ctxs, [d.new_state(), d.new_state()])
        mx.eval(rows)
    for b in range(2):
        assert mx.array_equal(rows[b], solo[b]).item()


@pytest.mark.parametrize("dkey", ["perm_dspark_noisy", "perm_dflash_zlab"])
def test_generations_with_native_products_equal_baseline(dkey):
    ws = workspace()
    target, tok = md.load_target(str(ws["target_perm"]), dtype="float32")
    d = load_drafter(str(ws[dkey]), target, bits=16)
    base = md.generate(target, tok, None, prompt_ids=PROMPT, mode="baseline", max_new_tokens=48)
    spec = md.generate(target, tok, None, prompt_ids=PROMPT, mode=d.kind, drafter=d, max_new_tokens=48)
    assert spec.tokens == base.tokens and spec.text == base.text and spec.rounds > 1
