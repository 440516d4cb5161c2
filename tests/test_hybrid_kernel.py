"""The GDN replay kernel: its pure-MLX reference against mlx-lm's recurrence, compile checks of
the CUDA and Metal instances on Linux, and (on a device) parity and T-invariance of the kernel."""

from __future__ import annotations

import kernel_text as kt
import mlx.core as mx
import numpy as np
import pytest
from test_metal_check import CUDA_STUB, METAL_STUB, parse

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


def _instances():
    dts = [("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16")]
    for kdt, bdt in dts:
        for with_y in (True, False):
            ins = [(kdt, 4, 999)] * 3 + [("float32", 3, 99), (bdt, 3, 99), ("float32", 4, 9999)]
            tm = [("WITH_Y", with_y)]
            yield (
                f"metal_{kdt}_{with_y}",
                kt.metal_kernel_text(gr.metal_instance(), ins, ["float32"] * 2, tm),
                METAL_STUB,
            )
            yield (
                f"cuda_{kdt}_{with_y}",
                kt.cuda_kernel_text(gr.cuda_instance(), [(d, n) for d, n, _ in ins], ["float32"] * 2, tm),
                CUDA_STUB,
            )


@pytest.mark.parametrize(
    "label,src,stub", list(_instances()), ids=lambda x: x if isinstance(x, str) and len(x) < 30 else ""
)
def test_instances_parse(label, src, stub):
    assert parse(src, stub, label) == []


def test_a_broken_body_fails_both_languages():
    body = gr._body().replace("kv += s[i] * ds_to_float(k[kt + i]);", "kv += s[i] * ds_to_float(kk[kt + i]);")
    assert body != gr._body()
    for inst, stub, text in (
        (gr.metal_instance(), METAL_STUB, kt.metal_kernel_text),
        (gr.cuda_instance(), CUDA_STUB, kt.cuda_kernel_text),
    ):
        bad = gs.Instance(inst.name, inst.input_names, inst.output_names, inst.source, body)
        ins = [("float32", 4, 999)] * 3 + [("float32", 3, 99)] * 2 + [("float32", 4, 9999)]
        src = text(bad, ins if stub is METAL_STUB else [(d, n) for d, n, _ in ins], ["float32"] * 2, [("WITH_Y", True)])
        assert any("kk" in e for e in parse(src, stub, "broken"))


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
