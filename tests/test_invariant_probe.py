"""The load probe: plain decoding is never blocked by it; it refuses the speculative modes only for
a real rollback defect, not for the width-dependent rounding of a bf16 or quantized forward."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import KVCache

import mlx_dspark as md
from mlx_dspark.errors import UserError
from mlx_dspark.models.target import Target

PRECISIONS = [
    {"dtype": "bfloat16"},
    {"quantize": 8},
    {"quantize": 4},
    {"dtype": "bfloat16", "quantize": 8},
    {"dtype": "bfloat16", "quantize": 4},
    {"dtype": "float16"},
    {},
]
PROMPT = "repeat: the fox the fox the fox def add(a, b)"


@pytest.fixture(scope="module")
def path(model_dir):
    return str(model_dir("llama", scale=2.0, seed=11, hidden=128))


def _same(a, b, tok):
    assert a.tokens == b.tokens
    assert a.text == b.text == tok.decode(a.tokens)


@pytest.mark.parametrize("kw", PRECISIONS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()) or "default")
def test_every_precision_passes_the_probe_and_stays_lossless(path, kw):
    target, tok = md.load_target(path, **kw)
    assert target.rollback_refusal is None and target.tap_refusal is None
    base = md.generate(target, tok, PROMPT, mode="baseline", max_new_tokens=40)
    look = md.generate(target, tok, PROMPT, mode="lookup", max_new_tokens=40)
    _same(look, base, tok)


class _WidthRounding:
    """A model whose logits round differently at each width, as a bf16 or quantized forward does
    on a GPU: a few ulps of the logits' dtype, a deterministic function of the width (so the same
    width over the same cache replays exactly)."""

    def __init__(self, model, ulps: int = 3):
        self._model, self._ulps = model, ulps

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, tokens, cache=None, **kw):
        out = self._model(tokens, cache=cache, **kw)
        w = tokens.shape[1]
        eps = {mx.float32: 2.0**-23, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}[out.dtype]
        V = out.shape[-1]
        sign = ((mx.arange(V) * 7 + w) % 3 - 1).astype(mx.float32)
        bumped = out.astype(mx.float32) * (1.0 + self._ulps * eps * sign * (w > 1))
        return bumped.astype(out.dtype)


@pytest.mark.parametrize(
    "kw",
    [
        {"dtype": "bfloat16"},
        {"dtype": "bfloat16", "quantize": 8},
        {"dtype": "bfloat16", "quantize": 4},
        {"dtype": "float16", "quantize": 8},
        {"dtype": "bfloat16", "gpu_quantize": 8},
        {"dtype": "bfloat16", "gpu_quantize": 4},
    ],
    ids=["bf16", "bf16-q8", "bf16-q4", "fp16-q8", "bf16-q8-bf16scales", "bf16-q4-bf16scales"],
)
def test_width_dependent_rounding_is_accepted(path, kw):
    kw = dict(kw)
    bits = kw.pop("gpu_quantize", None)
    target, tok = md.load_target(path, probe=False, **kw)
    if bits:  # quantized as on a GPU: the scales stay bf16, so the logits are bf16
        nn.quantize(target.model, group_size=64, bits=bits)
    target.model = _WidthRounding(target.model)
    target.probe()  # must not raise
    # The speculative modes run (what they emit on a width-rounding target is issue 17's business).
    res = md.generate(target, tok, PROMPT, mode="lookup", max_new_tokens=20)
    assert len(res.tokens) > 0
    assert target.rollback_refusal is None


class _TrimsTheWrongEnd(KVCache):
    """A genuinely broken rollback: trim(n) drops the oldest n positions instead of the newest."""

    def trim(self, n):
        n = min(self.offset, n)
        self.keys = self.keys[..., n : self.offset, :]
        self.values = self.values[..., n : self.offset, :]
        self.offset -= n
        return n


def _broken_cache(self):
    return [_TrimsTheWrongEnd() for _ in self.layers]


@pytest.mark.parametrize(
    "kw", [{}, {"dtype": "bfloat16"}, {"quantize": 8}, {"quantize": 4}], ids=["f32", "bf16", "q8", "q4"]
)
def test_broken_rollback_loads_for_baseline_and_refuses_speculation(path, kw, monkeypatch):
    good, tok = md.load_target(path, **kw)
    want = md.generate(good, tok, PROMPT, mode="baseline", max_new_tokens=30)
    monkeypatch.setattr(Target, "make_cache", _broken_cache)
    target, tok = md.load_target(path, **kw)  # the probe runs and must not raise
    assert target.rollback_refusal and "rolling the KV cache back" in target.rollback_refusal
    got = md.generate(target, tok, PROMPT, mode="baseline", max_new_tokens=30)
    _same(got, want, tok)
    with pytest.raises(UserError, match="rolling the KV cache back"):
        md.generate(target, tok, PROMPT, mode="lookup", max_new_tokens=30)
    with pytest.raises(UserError, match="rolling the KV cache back"):
        target.check_speculation()


def test_broken_taps_block_only_the_drafters(path):
    target, tok = md.load_target(path, probe=False)
    target.probe()
    target.tap_refusal = "llama: tapped hidden states are wrong"
    md.generate(target, tok, PROMPT, mode="baseline", max_new_tokens=5)
    md.generate(target, tok, PROMPT, mode="lookup", max_new_tokens=5)
    with pytest.raises(UserError, match="tapped"):
        target.forward(mx.array([[1, 2]]), target.make_cache(), taps=(0,))


def test_probe_still_rejects_taps_out_of_range(path):
    target, _ = md.load_target(path, probe=False)
    with pytest.raises(UserError, match="out of range"):
        target.probe(taps=(99,))
