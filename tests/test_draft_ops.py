"""The drafter pass's fused CPU ops (csrc/draft_ops.cpp, kernels/draft_ops.py: attention, SiLU, RMS
norm, the Markov chain): each equals its pure-MLX reference on fresh random inputs, a drafter pass
takes them only inside native_products(), its drafts equal MLX's ops', and generations stay equal
to plain decoding in tokens and text."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from drafter_fixtures import workspace

import mlx_dspark as md
from mlx_dspark.compat import route_linears_to_invariant_op
from mlx_dspark.decode.drafting import DrafterProposer
from mlx_dspark.kernels import draft_ops, native, native_products
from mlx_dspark.models.drafter_backbone import PlainRoPE, ProportionalRoPE
from mlx_dspark.models.drafters import load_drafter

pytestmark = pytest.mark.skipif(
    mx.default_device() != mx.cpu or native.ext(warn=False) is None, reason="the native ops run on the CPU build"
)

PROMPT = [5, 9, 23, 41, 7, 12, 30, 2, 19]


@pytest.fixture
def ext():
    return native.ext(warn=False)


def _strided_kv(rng, nkv: int, lk: int, hd: int, cap: int):
    """Keys / values as the drafter's ContextKV hands them over: the first lk rows of a wider buffer."""
    buf = mx.array(rng.standard_normal((2, 1, nkv, cap, hd)).astype(np.float32))
    return buf[0][..., :lk, :], buf[1][..., :lk, :]


@pytest.mark.parametrize("seed", range(6))
def test_attention_equals_its_reference(ext, seed):
    rng = np.random.default_rng(seed)
    nkv = int(rng.choice([1, 2, 3]))
    nh = nkv * int(rng.integers(1, 4))
    hd = int(rng.choice([16, 64, 72]))
    L, lk = int(rng.integers(1, 16)), int(rng.integers(1, 300))
    q = mx.array(rng.standard_normal((L, nh * hd)).astype(np.float32) * 3)
    w = mx.array(rng.uniform(0.5, 1.5, hd).astype(np.float32))
    keys, values = _strided_kv(rng, nkv, lk, hd, lk + int(rng.integers(0, 40)))
    rates = mx.array((10000.0 ** (-np.arange(0, hd, 2) / hd)).astype(np.float32))
    kw = dict(num_heads=nh, position=int(rng.integers(0, 5000)), scale=float(hd**-0.5), eps=1e-5)
    got = ext.draft_attention(q, w, keys, values, rates, **kw)
    want = draft_ops.attention_reference(q, w, keys, values, rates, **kw)
    assert got.shape == (L, nh * hd) and got.dtype == mx.float32
    assert mx.allclose(got, want, atol=2e-5, rtol=1e-4).item(), mx.abs(got - want).max().item()


def test_attention_reads_transposed_keys(ext):
    """Keys whose last axis is not contiguous (a transposed view) are gathered, not misread."""
    rng = np.random.default_rng(7)
    q = mx.array(rng.standard_normal((3, 4 * 8)).astype(np.float32))
    kt = mx.array(rng.standard_normal((1, 2, 8, 20)).astype(np.float32)).transpose(0, 1, 3, 2)
    v = mx.array(rng.standard_normal((1, 2, 20, 8)).astype(np.float32))
    w, rates = mx.ones((8,)), mx.array([1.0, 0.1, 0.01, 0.0])
    kw = dict(num_heads=4, position=3, scale=0.5, eps=1e-6)
    want = draft_ops.attention_reference(q, w, kt, v, rates, **kw)
    assert mx.allclose(ext.draft_attention(q, w, kt, v, rates, **kw), want, atol=2e-5).item()


@pytest.mark.parametrize("n", [1, 7, 8, 1024 * 7 + 3])
def test_silu_mul_equals_its_reference(ext, n):
    rng = np.random.default_rng(n)
    g = mx.array((rng.standard_normal(n) * 30).astype(np.float32))  # far into both tails
    u = mx.array(rng.standard_normal(n).astype(np.float32))
    got = ext.silu_mul(g, u)
    assert mx.allclose(got, draft_ops.silu_mul_reference(g, u), atol=1e-6, rtol=1e-5).item()


@pytest.mark.parametrize("rank", [48, 12])  # 12: not a multiple of 8, the portable step
@pytest.mark.parametrize("restricted", [True, False])
def test_markov_greedy_equals_its_reference(ext, rank, restricted):
    rng = np.random.default_rng(rank + restricted)
    V = 3001
    ids = np.sort(rng.choice(V, 1203, replace=False)) if restricted else np.arange(V)
    U = mx.array(rng.standard_normal((7, len(ids))).astype(np.float32))
    w1 = mx.array(rng.standard_normal((V, rank)).astype(np.float32))
    w2 = mx.array(rng.standard_normal((len(ids), rank)).astype(np.float32) * 0.5)
    vid = mx.array(ids.astype(np.int32)) if restricted else None
    anchor = mx.array(int(ids[5]), dtype=mx.int32)
    got = ext.markov_greedy(U, w1, w2, vid, anchor)
    want = draft_ops.markov_greedy_reference(U, w1, w2, vid, anchor)
    assert got.dtype == mx.int32 and got.tolist() == want.tolist()


def test_markov_greedy_keeps_argmax_order(ext):
    """Ties go to the smaller index and a NaN wins, as mx.argmax decides."""
    w1, w2 = mx.zeros((40, 8)), mx.zeros((40, 8))
    U = mx.zeros((2, 40))
    U[0, 17] = 3.0
    U[0, 33] = 3.0
    U[1, 30] = float("nan")
    got = ext.markov_greedy(U, w1, w2, None, mx.array(0, dtype=mx.int32)).tolist()
    assert got == [17, 30] == draft_ops.markov_greedy_reference(U, w1, w2, None, mx.array(0)).tolist()


def test_bad_inputs_say_what_to_pass(ext):
    q = mx.zeros((2, 64))
    kv = mx.zeros((1, 1, 4, 64))
    with pytest.raises(ValueError, match="float32"):
        ext.draft_attention(q.astype(mx.float16), mx.ones((64,)), kv, kv, mx.ones((32,)),
                            num_heads=1, position=0, scale=1.0, eps=1e-6)  # fmt: skip
    with pytest.raises(ValueError, match="multiple of the kv heads"):
        ext.draft_attention(q, mx.ones((64,)), mx.zeros((1, 2, 4, 32)), mx.zeros((1, 2, 4, 32)), mx.ones((16,)),
                            num_heads=3, position=0, scale=1.0, eps=1e-6)  # fmt: skip
    with pytest.raises(ValueError, match="one shape"):
        ext.silu_mul(mx.zeros((3,)), mx.zeros((4,)))
    with pytest.raises(ValueError, match=r"w2 must be"):
        ext.markov_greedy(mx.zeros((2, 10)), mx.zeros((10, 8)), mx.zeros((9, 8)), None, mx.array(1))
    if mx.is_available(mx.gpu):  # a CPU-only MLX has no GPU stream to ask for
        with pytest.raises(ValueError, match="CPU"):
            ext.silu_mul(mx.zeros((3,)), mx.zeros((3,)), stream=mx.Device(mx.gpu))


@pytest.mark.parametrize("seed", range(4))
def test_rms_norm_equals_its_reference(ext, seed):
    rng = np.random.default_rng(seed)
    shape = tuple(int(n) for n in rng.integers(1, 9, size=int(rng.integers(1, 4)))) + (int(rng.integers(1, 700)),)
    x = mx.array(rng.standard_normal(shape).astype(np.float32) * 5)
    w = mx.array(rng.uniform(0.5, 1.5, shape[-1]).astype(np.float32)) if seed % 2 else None
    eps = float(rng.choice([1e-6, 1e-5, 0.1]))
    got = ext.rms_norm(x, w, eps=eps)
    assert got.shape == x.shape and got.dtype == mx.float32
    assert mx.allclose(got, draft_ops.rms_norm_reference(x, w, eps), atol=1e-5, rtol=1e-5).item()
    t = x.reshape(-1, shape[-1]).T  # a transposed view: made contiguous, not misread
    assert mx.allclose(ext.rms_norm(t, None, eps=eps), draft_ops.rms_norm_reference(t, None, eps), atol=1e-5).item()


def test_rope_rates_cover_the_rotations_the_op_does():
    assert draft_ops.inv_freq(PlainRoPE(64, 1e4, full_head=True)).shape == (32,)
    assert draft_ops.inv_freq(PlainRoPE(32, 1e4)) is None  # partial RoPE rotates other pairs: MLX's ops
    rates = draft_ops.inv_freq(ProportionalRoPE(64, 1e4, 0.25)).tolist()
    assert rates[0] == 1.0 and rates[7] > 0 and rates[8:] == [0.0] * 24  # past the factor: no rotation


def _pair(dkey: str):
    route_linears_to_invariant_op()
    ws = workspace()
    target, tok = md.load_target(str(ws["target_gemma4" if "gemma4" in dkey else "target_qwen3"]), dtype="float32")
    return target, tok, load_drafter(str(ws[dkey]), target, bits=16)


@pytest.fixture
def counted(monkeypatch, ext):
    """Counts the fused ops' calls."""
    seen: list[str] = []

    class Counting:
        def __getattr__(self, name):
            real = getattr(ext, name)
            if name in ("draft_attention", "silu_mul", "markov_greedy", "rms_norm", "draft_linear", "invariant_linear"):
                return lambda *a, **k: (seen.append(name), real(*a, **k))[1]
            return real

    monkeypatch.setattr(native, "ext", lambda warn=True: Counting())
    return seen


@pytest.mark.parametrize("dkey", ["dspark_qwen3", "dspark_gemma4"])
def test_a_drafter_pass_takes_the_fused_ops_and_drafts_as_mlx_does(dkey, counted, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_DRAFT_PANELS", "off")  # float32 products: test_draft_linear.py has the panels
    _, _, d = _pair(dkey)
    ctx = mx.random.normal((12, d.spec.backbone.context_dim), key=mx.random.key(5))
    want = d.block_hidden(77, ctx, d.new_state())  # outside a pass: MLX's ops
    mx.eval(want)
    assert counted == []
    with native_products.native_products():
        got = d.block_hidden(77, ctx, d.new_state())
        mx.eval(got)
    layers = d.spec.backbone.num_layers
    assert counted.count("draft_attention") == layers
    assert counted.count("silu_mul") == (0 if "gemma4" in dkey else layers)  # Gemma's MLP is GELU
    # per layer: input, post-attention (Gemma: pre- and post-feed-forward too) and the keys' norm; the
    # context rows' hidden_norm and the final norm
    assert counted.count("rms_norm") == (5 if "gemma4" in dkey else 3) * layers + 2
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()


def test_the_markov_chain_runs_as_one_op_and_drafts_what_the_loop_drafts(counted, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_DRAFT_PANELS", "off")  # float32 products on both sides
    target, _, d = _pair("dspark_qwen3")
    d.restrict_vocab(range(3, 250))
    fwd = target.forward(mx.array([PROMPT]), target.make_cache(), taps=d.taps)
    drafts = {}
    for fused in (False, True):
        p = DrafterProposer(d, lookup_drafts=False)
        if not fused:
            p.propose = lambda h, k, s, p=p: p._run_pass(p._prepare(h, k, s))  # outside native_products()
        p.begin(target, PROMPT[:-1], fwd.hidden[0][:-1])
        drafts[fused] = p.propose(PROMPT, d.block_drafts, None).read()
    assert counted.count("markov_greedy") == 1
    assert drafts[True] == drafts[False] and len(drafts[True]) == d.block_drafts


@pytest.mark.parametrize("dkey", ["perm_dspark_noisy", "perm_dspark"])
def test_generations_with_the_fused_ops_equal_baseline(dkey, counted):
    ws = workspace()
    target, tok = md.load_target(str(ws["target_perm"]), dtype="float32")
    d = load_drafter(str(ws[dkey]), target, bits=16)
    base = md.generate(target, tok, None, prompt_ids=PROMPT, mode="baseline", max_new_tokens=48)
    spec = md.generate(target, tok, None, prompt_ids=PROMPT, mode="dspark", drafter=d, max_new_tokens=48)
    assert spec.tokens == base.tokens and spec.text == base.text
    assert spec.stats["drafter_accepted"] > 0 and "draft_attention" in counted
    assert "draft_linear" in counted  # the products from float16 panels (tests/test_draft_linear.py)


def test_the_portable_fallbacks_equal_the_references_too():
    """MLX_DSPARK_CPU_ISA=portable: the ops' scalar set (a CPU without AVX2 + FMA + F16C), in its own process."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import mlx.core as mx
        from mlx_dspark.kernels import draft_linear, draft_ops, invariant, native
        ext = native.ext(warn=False)
        assert ext.draft_ops_isa() == "portable", ext.draft_ops_isa()
        k = mx.random.key(3)
        q, kv = mx.random.normal((5, 4 * 16), key=k), mx.random.normal((2, 1, 2, 40, 16), key=mx.random.key(4))
        w, rates = mx.ones((16,)), mx.array([1.0, 0.5, 0.1, 0.05, 0.01, 0.0, 0.0, 0.0])
        kw = dict(num_heads=4, position=9, scale=0.25, eps=1e-6)
        a = ext.draft_attention(q, w, kv[0], kv[1], rates, **kw)
        assert mx.allclose(a, draft_ops.attention_reference(q, w, kv[0], kv[1], rates, **kw), atol=2e-5).item()
        g, u = mx.random.normal((3, 37), key=k) * 20, mx.random.normal((3, 37), key=mx.random.key(5))
        assert mx.allclose(ext.silu_mul(g, u), draft_ops.silu_mul_reference(g, u), atol=1e-6, rtol=1e-5).item()
        U, w1, w2 = mx.random.normal((4, 300), key=k), mx.random.normal((300, 16), key=k), mx.random.normal((300, 16))
        an = mx.array(7, dtype=mx.int32)
        got = ext.markov_greedy(U, w1, w2, None, an).tolist()
        assert got == draft_ops.markov_greedy_reference(U, w1, w2, None, an).tolist()
        n = ext.rms_norm(g, u[0], eps=1e-5)
        assert mx.allclose(n, draft_ops.rms_norm_reference(g, u[0], 1e-5), atol=1e-5, rtol=1e-5).item()
        assert ext.draft_linear_isa() == "portable", ext.draft_linear_isa()
        x, wl = mx.random.normal((9, 77), key=k), mx.random.normal((50, 77), key=mx.random.key(2))
        p, bl = draft_linear.pack(wl), mx.random.normal((50,), key=k)
        y = ext.draft_linear(x, p, bl, n=50)
        assert mx.allclose(y, draft_linear.draft_linear_reference(x, p, 50, bl), atol=1e-4, rtol=1e-4).item()
        assert mx.array_equal(y[4:5], ext.draft_linear(x[4:5], p, bl, n=50)).item()
        qd = mx.random.normal((1, 4, 3, 16), key=k)
        d = ext.invariant_attention(qd, kv[0], kv[1], scale=0.25)
        ref = invariant.invariant_attention_reference(qd, kv[0], kv[1], 0.25)
        assert mx.allclose(d, ref, atol=2e-5).item()
        alone = ext.invariant_attention(qd[:, :, 1:2], kv[0][:, :, :39], kv[1][:, :, :39], scale=0.25)
        assert mx.array_equal(d[:, :, 1:2], alone).item()
        print("ok")
        """
    )
    env = {**__import__("os").environ, "MLX_DSPARK_CPU_ISA": "portable"}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
