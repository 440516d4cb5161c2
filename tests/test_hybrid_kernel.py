"""The GDN replay kernel: its pure-MLX reference against mlx-lm's recurrence, compile checks of
the CUDA and Metal instances on Linux, the body run on CPU threads, the hybrid rollback's kernel
route (a stand-in on the CPU; the kernel itself on CUDA), and on a device parity and position
invariance of the kernel."""

from __future__ import annotations

import kernel_text as kt
import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark.kernels import gdn_replay as gr
from mlx_dspark.kernels import gpu_source as gs


def inputs(seed=0, B=1, T=6, Hk=2, Hv=4, Dk=32, Dv=16, dtype=mx.float32):
    from mlx_lm.models import gated_delta

    rng = np.random.default_rng(seed)
    f = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    q, k = gated_delta.normalize_qk(f(B, T, Hk, Dk), f(B, T, Hk, Dk), inv_scale=Dk**-0.5, eps=1e-6)
    a, b = f(B, T, Hv), f(B, T, Hv)
    A_log, dt_bias = mx.log(mx.array(rng.uniform(0.5, 8, Hv).astype(np.float32))), f(Hv)
    g = gated_delta.compute_g(A_log, a, dt_bias)
    return dict(
        q=q.astype(dtype),
        k=k.astype(dtype),
        v=f(B, T, Hv, Dv).astype(dtype),
        a=a,
        b=b,
        A_log=A_log,
        dt_bias=dt_bias,
        g=g,
        beta=mx.sigmoid(b).astype(dtype),
        state=f(B, Hv, Dv, Dk) * 0.1,
    )


def test_reference_is_mlx_lm_recurrence_bitwise():
    from mlx_lm.models import gated_delta

    x = inputs()
    y_ref, ref = gated_delta.gated_delta_update(
        x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["state"], None, use_kernel=False
    )
    ours = gr.gdn_replay_reference(x["k"], x["v"], x["g"], x["beta"], x["state"])
    assert ours.shape == ref.shape == (1, 4, 16, 32)
    assert np.array_equal(np.array(ours), np.array(ref))
    y, s = gr.gdn_recurrence_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"])
    assert np.array_equal(np.array(s), np.array(ref)) and np.array_equal(np.array(y), np.array(y_ref))


def _metal_check():
    """tests/test_metal_check.py (it needs libclang, which CI installs): imported by the compile
    checks only, so the device tests of this file also run where libclang is not installed."""
    import test_metal_check

    return test_metal_check


def _instances():
    dts = [("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16")]
    for kdt, bdt in dts:
        for with_y in (True, False):
            ins = [(kdt, 4, 999)] * 3 + [("float32", 3, 99), (bdt, 3, 99), ("float32", 4, 9999)]
            tm = [("WITH_Y", with_y)]
            yield (
                f"metal_{kdt}_{with_y}",
                kt.metal_kernel_text(gr.metal_instance(), ins, ["float32"] * 2, tm),
                "METAL_STUB",
            )
            yield (
                f"cuda_{kdt}_{with_y}",
                kt.cuda_kernel_text(gr.cuda_instance(), [(d, n) for d, n, _ in ins], ["float32"] * 2, tm),
                "CUDA_STUB",
            )


@pytest.mark.parametrize(
    "label,src,stub", list(_instances()), ids=lambda x: x if isinstance(x, str) and len(x) < 30 else ""
)
def test_instances_parse(label, src, stub):
    mc = _metal_check()
    assert mc.parse(src, getattr(mc, stub), label) == []


def test_a_broken_body_fails_both_languages():
    good = gr.cuda_instance().header
    body = good.replace("kv += s[i] * ds_to_float(k[kt + i]);", "kv += s[i] * ds_to_float(kk[kt + i]);")
    assert body != good
    mc = _metal_check()
    for inst, stub, text in (
        (gr.metal_instance(), mc.METAL_STUB, kt.metal_kernel_text),
        (gr.cuda_instance(), mc.CUDA_STUB, kt.cuda_kernel_text),
    ):
        bad = gs.Instance(inst.name, inst.input_names, inst.output_names, inst.source, body)
        ins = [("float32", 4, 999)] * 3 + [("float32", 3, 99)] * 2 + [("float32", 4, 9999)]
        src = text(
            bad, ins if stub is mc.METAL_STUB else [(d, n) for d, n, _ in ins], ["float32"] * 2, [("WITH_Y", True)]
        )
        assert any("kk" in e for e in mc.parse(src, stub, "broken"))


def test_cpu_dispatch_is_the_reference():
    x = inputs(seed=1)
    with mx.stream(mx.cpu):
        a = gr.gdn_replay(x["k"], x["v"], x["g"], x["beta"], x["state"])
    b = gr.gdn_replay_reference(x["k"], x["v"], x["g"], x["beta"], x["state"])
    assert np.array_equal(np.array(a), np.array(b))


_GPU = mx.cuda.is_available() or mx.metal.is_available()


@pytest.mark.skipif(not _GPU, reason="needs a GPU (CUDA or Metal)")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("shape", [dict(Hk=2, Hv=4, Dk=32, Dv=16), dict(Hk=16, Hv=32, Dk=128, Dv=128)])
def test_kernel_parity_and_position_invariance(dtype, shape):
    lang = "cuda" if mx.cuda.is_available() else "metal"
    for seed in range(3):
        x = inputs(seed=seed, T=7, dtype=dtype, **shape)
        got = gr.gdn_replay_gpu(x["k"], x["v"], x["g"], x["beta"], x["state"], lang=lang)
        f32 = [t.astype(mx.float32) for t in (x["q"], x["k"], x["v"], x["g"], x["beta"])]
        y_ref, ref = gr.gdn_recurrence_reference(*f32, x["state"])
        assert np.allclose(np.array(got), np.array(ref), rtol=1e-4, atol=1e-5)
        y, s2 = gr.gdn_recurrence_gpu(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], lang=lang)
        assert np.array_equal(np.array(s2), np.array(got))  # y does not change the state's arithmetic
        assert np.allclose(np.array(y), np.array(y_ref), rtol=1e-4, atol=1e-5)
        s = x["state"]
        for t in range(7):  # one position at a time: bitwise the 7-position call
            sl = slice(t, t + 1)
            s = gr.gdn_replay_gpu(x["k"][:, sl], x["v"][:, sl], x["g"][:, sl], x["beta"][:, sl], s, lang=lang)
        assert np.array_equal(np.array(s), np.array(got))


def test_gpu_body_runs_on_cpu_threads(tmp_path):
    """The body itself (not a reference) on the CPU, one std::thread per lane, SIMD shuffles
    emulated (tests/emulation/gdn_replay_emu.cpp): matches a float64 delta rule, and one
    7-position call is bitwise 7 one-position calls (what makes a replay equal plain steps)."""
    kt.run_gpu_body_on_cpu("gdn_replay_emu.cpp", tmp_path)


def _kernel_target(tmp_path, name="qwen3_5", seed=3):
    from family_fixtures import write_family

    import mlx_dspark as md

    path = write_family(tmp_path / name, name, seed=seed, gdn_key_dim=32)
    return md.load_target(str(path), dtype="float32")


def _verify_rewind_vs_plain(tgt, prompt, block, n):
    from mlx_dspark.models import hybrid

    wide, plain = tgt.make_cache(), tgt.make_cache()
    for c in (wide, plain):
        tgt.forward(mx.array([prompt]), c)
    tgt.forward(mx.array([block]), wide)
    tgt.trim(wide, n)
    for t in block[: len(block) - n]:
        tgt.forward(mx.array([[t]]), plain)
    a, b = hybrid._states(wide), hybrid._states(plain)
    assert len(a) == len(b) and len(a) > 0
    for x, y in zip(a, b):
        assert x.shape == y.shape and np.array_equal(np.array(x), np.array(y))  # bitwise


@pytest.fixture
def stand_in_kernel(monkeypatch):
    """The CUDA route on the CPU: replay_path says cuda, and the kernel launch is the reference
    (position-invariant like the kernel). Counts the positions each launch covered."""
    calls = []

    def fake(q, k, v, g, beta, state, lang="cuda"):
        assert lang == "cuda" and state.dtype == mx.float32 and g.dtype == mx.float32
        calls.append(k.shape[1])
        y, s = gr.gdn_recurrence_reference(q, k, v, g, beta, state)
        return (None if q is None else y.astype(mx.float32)), s

    monkeypatch.setattr(gr, "replay_path", lambda: "cuda")
    monkeypatch.setattr(gr, "gdn_recurrence_gpu", fake)
    return calls


def test_the_cuda_route_records_and_replays_through_the_kernel(tmp_path, stand_in_kernel):
    """With the kernel route on, every GDN forward and the replay go through the kernel launch,
    the rollback still rebuilds plain decoding's state bitwise, and speculation is lossless."""
    from test_loop import _ScriptedProposer

    import mlx_dspark as md

    tgt, tok = _kernel_target(tmp_path)
    assert tgt.rollback_kind == "replay"
    stand_in_kernel.clear()
    _verify_rewind_vs_plain(tgt, [5, 9, 13, 2, 7], [3, 1, 4, 1, 5, 9, 2], 4)
    assert 7 in stand_in_kernel and 3 in stand_in_kernel  # the verify forward and the 3-position replay
    ids = md.encode_prompt(tok, "the fox def add hello world")
    base = md.generate(tgt, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=30)
    for run in (
        md.generate(tgt, tok, None, prompt_ids=ids, mode="lookup", max_new_tokens=30, max_draft=4),
        md.generate(
            tgt, tok, None, prompt_ids=ids, proposer=_ScriptedProposer(base.tokens + [0] * 64), max_new_tokens=30
        ),
    ):
        assert run.tokens == base.tokens and run.text == base.text


def test_the_kernel_route_can_be_turned_off(tmp_path, stand_in_kernel, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_GDN_KERNEL", "0")
    tgt, _ = _kernel_target(tmp_path, seed=4)
    stand_in_kernel.clear()
    _verify_rewind_vs_plain(tgt, [5, 9, 13], [3, 1, 4], 2)
    assert stand_in_kernel == []


def test_small_key_heads_keep_mlx_lm_recurrence(tmp_path, stand_in_kernel):
    """Dk = 16 is not a multiple of 32: the kernel does not take it, mlx-lm's recurrence runs."""
    from family_fixtures import write_family

    import mlx_dspark as md

    tgt, _ = md.load_target(str(write_family(tmp_path / "small", "qwen3_5", seed=5)), dtype="float32")
    stand_in_kernel.clear()
    _verify_rewind_vs_plain(tgt, [5, 9], [3, 1, 4], 1)
    assert stand_in_kernel == []


@pytest.mark.gpu
@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_cuda_rollback_runs_the_kernel_and_is_bitwise(tmp_path, name):
    """On CUDA: the fixture's GDN layers run the native kernel, a verify forward rewound to any
    accept point equals plain steps bitwise, and speculation equals baseline."""
    from test_loop import _ScriptedProposer

    import mlx_dspark as md

    mx.set_default_device(mx.gpu)
    try:
        tgt, tok = _kernel_target(tmp_path, name)
        assert tgt.rollback_kind == "replay"
        c = tgt.make_cache()
        tgt.forward(mx.array([[1, 2, 3]]), c)
        assert {getattr(getattr(x, "round", None), "kernel", None) for x in c} >= {"cuda"}
        for n in range(0, 8):
            _verify_rewind_vs_plain(tgt, [5, 9, 13, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6], n)
        ids = md.encode_prompt(tok, "the fox def add hello world")
        base = md.generate(tgt, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=30)
        prop = _ScriptedProposer(base.tokens + [0] * 64)
        run = md.generate(tgt, tok, None, prompt_ids=ids, proposer=prop, max_new_tokens=30)
        assert run.tokens == base.tokens and run.text == base.text
    finally:
        mx.set_default_device(mx.cpu)


def test_a_kernel_that_fails_its_self_check_is_not_used(tmp_path, monkeypatch):
    """A kernel whose state depends on the call's width (or that fails to compile) is caught by
    the once-per-process self-check: a warning, and the model keeps mlx-lm's recurrence."""
    calls = []

    def drifting(q, k, v, g, beta, state, lang="cuda"):
        calls.append(k.shape[1])
        y, s = gr.gdn_recurrence_reference(q, k, v, g, beta, state)
        return y, s * (1.0 + 1e-7 * k.shape[1])  # bits that depend on T

    monkeypatch.setattr(gr, "replay_path", lambda: "cuda")
    monkeypatch.setattr(gr, "gdn_recurrence_gpu", drifting)
    gr.self_check.cache_clear()
    try:
        assert "depends on how many positions" in gr.self_check("cuda")
        with pytest.warns(RuntimeWarning, match="keep mlx-lm's recurrence"):
            tgt, _ = _kernel_target(tmp_path, seed=6)
            assert tgt.rollback_kind == "replay"
        calls.clear()
        _verify_rewind_vs_plain(tgt, [5, 9], [3, 1, 4], 1)
        assert calls == []
    finally:
        gr.self_check.cache_clear()


def test_depthwise_conv_is_the_layers_conv_at_any_width():
    """The kernel route's conv: nn.Conv1d's depthwise product to float32 rounding, and each output
    row bitwise the same whether computed in a wide call or alone (what a verify round needs)."""
    import mlx.nn as nn

    from mlx_dspark.models import hybrid

    for seed in range(3):
        mx.random.seed(seed)
        C, K, L = 96, 4, 11
        conv = nn.Conv1d(C, C, kernel_size=K, groups=C, padding=0, bias=False)
        x = mx.random.normal((2, L, C))
        got = hybrid.depthwise_conv(conv, x)
        assert got.shape == (2, L - K + 1, C)
        assert mx.allclose(got, conv(x), rtol=1e-5, atol=1e-6).item()
        for t in range(L - K + 1):
            one = hybrid.depthwise_conv(conv, x[:, t : t + K, :])
            assert mx.array_equal(one[:, 0], got[:, t]).item()


def test_the_kernel_route_is_proven_by_its_parts(tmp_path, stand_in_kernel, monkeypatch):
    """Where the kernel route's logits are not mlx-lm's bitwise (on CUDA, MLX's float32 matmul is
    3e-4 relative from the CPU's and magnifies the kernel's last bits), the proof checks each GDN
    layer's conv and recurrence against the CPU's float32 on the inputs it recorded, and the
    recording forward without the kernel bitwise: a sound route is accepted (its rollback
    replays), a recurrence off by 1e-3 is refused by name."""
    from mlx_dspark.models import hybrid

    tgt, _ = _kernel_target(tmp_path, seed=8)
    c = tgt.make_cache()
    tgt.forward(mx.array([[4, 8, 15, 16, 23]]), c)
    assert hybrid.kernel_parts_differ(c) is None
    with hybrid.native_kernel_off():
        off = tgt.make_cache()
        tgt.forward(mx.array([[4, 8, 15]]), off)
    assert all(getattr(getattr(x, "round", None), "kernel", None) is None for x in off)
    sound = gr.gdn_recurrence_gpu  # the stand-in

    def off_by_1e3(q, k, v, g, beta, state, lang="cuda"):
        y, s = sound(q, k, v, g, beta, state, lang)
        return (None if y is None else y * 1.001), s

    monkeypatch.setattr(gr, "gdn_recurrence_gpu", off_by_1e3)
    assert "the native GDN kernel differs from the float32 recurrence" in hybrid.kernel_parts_differ(c)
    tgt, _ = _kernel_target(tmp_path, seed=8)
    assert tgt.rollback_kind.startswith("none (layer ") and "native GDN kernel differs" in tgt.rollback_kind
