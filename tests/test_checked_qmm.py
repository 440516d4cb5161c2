"""kernels/checked_qmm.py: a quantized product MLX computes wrongly or not reproducibly (measured on
the H200: quantized_matmul over more than one row with K equal to one group) is found at load and
routed around, so prefills repeat bit for bit and every mode still equals baseline, in tokens and
text. The CPU's products are sound, so a stand-in breaks them the way the device does."""

from __future__ import annotations

import mlx.core as mx
import pytest
from family_fixtures import write_family

import mlx_dspark as md
from mlx_dspark.kernels import checked_qmm

PROMPT = "the quick brown fox jumps over the lazy dog and the fox"


@pytest.fixture
def check_on(monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_QMM_CHECK", "on")
    monkeypatch.setenv("MLX_DSPARK_INVARIANT_CACHE", "off")
    checked_qmm.reset()
    yield
    checked_qmm.reset()


def _garbled(product):
    """`product` that adds fresh noise when it takes more than 17 rows and K is one group (the
    device's bug; decode and verify widths stay sound, as our kernels keep them on the device)."""

    def broken(x, w, *args, group_size=64, **kw):
        y = product(x, w, *args, group_size=group_size, **kw)
        if x.shape[-1] == group_size and x.size // x.shape[-1] > 17:
            y = y + 0.1 * mx.random.normal(y.shape).astype(y.dtype)
        return y

    return broken


def _prefilled(target, ids):
    cache = target.make_cache()
    logits = target.forward(mx.array([ids]), cache, last_only=True).logits
    mx.eval(logits)
    return [logits] + [c.state[0][..., : c.offset, :] for c in cache]


def _same(a, b) -> bool:
    return all(mx.array_equal(x, y).item() for x, y in zip(a, b))


def _garble_qmm(monkeypatch):
    monkeypatch.setattr(mx, "quantized_matmul", _garbled(mx.quantized_matmul))


def test_a_garbled_product_is_found_and_routed_dense(model_dir, check_on, monkeypatch):
    """hidden 64 with group 64: every projection reading the residual stream has K = one group."""
    path = model_dir("llama", layers=2, hidden=64, intermediate=128, seed=5)
    sound, _ = md.load_target(str(path), dtype="float32", quantize=4)
    assert sound.dense_products == []  # no false alarm on a sound product
    ids = md.encode_prompt(sound.tokenizer, PROMPT)[:30]
    want = _prefilled(sound, ids)

    _garble_qmm(monkeypatch)
    checked_qmm.reset()
    target, tok = md.load_target(str(path), dtype="float32", quantize=4)
    assert target.dense_products and all("not the same on 3 runs" in d for d in target.dense_products)
    marked = [n for n, m in target.model.named_modules() if checked_qmm.marked(m)]
    assert "model.layers.0.self_attn.q_proj" in marked and "model.layers.0.mlp.down_proj" not in marked  # K 128
    a, b = _prefilled(target, ids), _prefilled(target, ids)
    assert _same(a, b)  # the prefill repeats bit for bit
    assert all(mx.allclose(x, y, rtol=1e-4, atol=1e-4).item() for x, y in zip(a, want))  # and is the model's
    prompt = md.encode_prompt(tok, PROMPT)
    base = md.generate(target, tok, None, prompt_ids=prompt, mode="baseline", max_new_tokens=24)
    again = md.generate(target, tok, None, prompt_ids=prompt, mode="baseline", max_new_tokens=24)
    look = md.generate(target, tok, None, prompt_ids=prompt, mode="lookup", max_new_tokens=24)
    assert (again.tokens, again.text) == (base.tokens, base.text)
    assert (look.tokens, look.text) == (base.tokens, base.text)


def test_without_the_check_the_garbled_prefill_moves(model_dir, monkeypatch):
    """The control: the same stand-in with the check off gives two different prefills. Nothing else
    at load finds it: the rows check (models/invariance.py) compares verify rows with plain steps
    over one prefilled prefix, and those widths are sound; only this check catches a prefill that
    does not repeat."""
    monkeypatch.setenv("MLX_DSPARK_QMM_CHECK", "off")
    monkeypatch.setenv("MLX_DSPARK_INVARIANT_CACHE", "off")
    path = model_dir("llama", layers=2, hidden=64, intermediate=128, seed=5)
    _garble_qmm(monkeypatch)
    target, _ = md.load_target(str(path), dtype="float32", quantize=4)
    assert target.dense_products == [] and target.invariance != "none"
    ids = list(range(3, 33))
    assert not _same(_prefilled(target, ids), _prefilled(target, ids))


def test_garbled_experts_are_found_and_routed_dense(tmp_path, check_on, monkeypatch):
    """qwen3_moe's experts (moe_intermediate 64 = one group in their down projection) through
    mx.gather_qmm, the way mlx-lm's SwitchGLU calls it."""
    path = write_family(tmp_path / "qwen3_moe", "qwen3_moe", seed=3, hidden=128)
    ids = list(range(5, 45))
    sound, _ = md.load_target(str(path), dtype="float32", quantize=4)
    assert sound.dense_products == []
    want = _prefilled(sound, ids)
    monkeypatch.setattr(mx, "gather_qmm", _garbled(mx.gather_qmm))
    checked_qmm.reset()
    target, _ = md.load_target(str(path), dtype="float32", quantize=4)
    assert any(d.startswith("gather_qmm 4-bit group 64") for d in target.dense_products), target.dense_products
    a, b = _prefilled(target, ids), _prefilled(target, ids)
    assert _same(a, b)
    assert all(mx.allclose(x, y, rtol=1e-4, atol=1e-4).item() for x, y in zip(a, want))


def test_the_setting_is_checked(monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_QMM_CHECK", "sometimes")
    with pytest.raises(md.UserError, match="expected auto, on or off"):
        checked_qmm.enabled()
    monkeypatch.setenv("MLX_DSPARK_QMM_CHECK", "auto")
    assert checked_qmm.enabled() is (mx.default_device() != mx.cpu)


def test_a_product_that_fails_to_launch_is_routed_dense(model_dir, check_on, monkeypatch):
    """MLX's float32 group-128 product on CUDA raises at eval (measured); the layer goes dense."""
    path = model_dir("llama", layers=2, hidden=64, intermediate=128, seed=5)
    product = mx.quantized_matmul

    def failing(x, w, *args, group_size=64, **kw):
        if x.shape[-1] == group_size and x.size // x.shape[-1] > 17:
            raise RuntimeError("cuGraphAddKernelNode(&node, graph_, NULL, 0, &params) failed: invalid argument")
        return product(x, w, *args, group_size=group_size, **kw)

    monkeypatch.setattr(mx, "quantized_matmul", failing)
    target, tok = md.load_target(str(path), dtype="float32", quantize=4)
    assert target.dense_products and all("fails to run (cuGraphAddKernelNode" in d for d in target.dense_products)
    ids = list(range(3, 33))
    assert _same(_prefilled(target, ids), _prefilled(target, ids))
    base = md.generate(target, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=16)
    look = md.generate(target, tok, None, prompt_ids=ids, mode="lookup", max_new_tokens=16)
    assert (look.tokens, look.text) == (base.tokens, base.text)
