"""Parity of the native accept kernels with their pure-MLX references (CPU, in CI).

Fresh random inputs every run (no fixed seed unless MLX_DSPARK_TEST_SEED is set); every
failure prints the seed to reproduce it. Outputs are poisoned (the allocator's cache is filled
with a sentinel first) so an element a kernel forgets to write shows up.
"""

from __future__ import annotations

import io
import os
import random

import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark import kernels
from mlx_dspark.kernels import native as _native
from mlx_dspark.kernels.reference import greedy_accept_reference, sampling_accept_reference

SEED = int(os.environ.get("MLX_DSPARK_TEST_SEED", random.randrange(2**31)))
POISON = -77


def poison(*shapes):
    """Leave freed int32 buffers full of POISON in MLX's cache, sized like the outputs to come."""
    bufs = [mx.full(s, POISON, dtype=mx.int32) for s in shapes for _ in range(2)]
    mx.eval(bufs)
    del bufs


def key(i: int):
    return mx.random.key(SEED * 1000 + i)


def make_greedy(B, w, V, dtype, i, ties=False):
    k1, k2, k3 = mx.random.split(key(i), 3)
    if ties:  # a handful of distinct values: every row has many tied maxima
        lg = mx.random.randint(0, 3, (B, w, V), key=k1).astype(dtype)
    else:
        lg = mx.random.normal((B, w, V), key=k1).astype(dtype)
    tgt = greedy_accept_reference(lg, mx.zeros((B, w - 1), mx.int32))[0]
    # drafts that match the target up to a random point, then differ
    cut = mx.random.randint(0, w, (B, 1), key=k2)
    wrong = (tgt[:, : w - 1] + 1 + mx.random.randint(0, V - 1, (B, w - 1), key=k3)) % V
    draft = mx.where(mx.arange(w - 1)[None] < cut, tgt[:, : w - 1], wrong).astype(mx.int32)
    return lg, draft


def check_greedy(lg, draft, ext):
    B, w, _ = lg.shape
    want = greedy_accept_reference(lg, draft)
    poison((B, w), (B,))
    got = ext.greedy_accept(lg, draft, stream=mx.cpu)
    mx.eval(want, got)
    for name, a, b in zip(("target", "accepted", "bonus"), got, want):
        assert a.dtype == mx.int32 and a.shape == b.shape, name
        assert mx.array_equal(a, b).item(), f"{name} differs (seed {SEED}): {a} vs {b}"


CASES = [(V, w, dt) for V in (49152, 151936) for w in (1, 2, 5, 8, 16) for dt in (mx.float32, mx.float16, mx.bfloat16)]


@pytest.mark.parametrize("V,w,dtype", CASES)
def test_greedy_parity(ext, V, w, dtype):
    B = random.Random(SEED + V + w).randint(1, 4)
    lg, draft = make_greedy(B, w, V, dtype, hash((V, w, str(dtype))) % 1000)
    check_greedy(lg, draft, ext)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_greedy_ties_nan_and_signed_zero(ext, dtype):
    lg, draft = make_greedy(4, 9, 5000, dtype, 11, ties=True)
    check_greedy(lg, draft, ext)
    x = np.array(lg.astype(mx.float32))
    x[0, 1, 4000] = np.nan  # NaN wins (mx.argmax order), the first NaN of a row wins
    x[0, 1, 4500] = np.nan
    x[1, 2, :] = -np.inf
    x[1, 2, 3000] = np.nan
    x[2, 3, :] = 0.0
    x[2, 3, :100] = -0.0  # -0 == +0: the first index wins
    x[3, 0, :] = -np.inf  # all equal: index 0
    check_greedy(mx.array(x).astype(dtype), draft, ext)


def test_greedy_noncontiguous_input(ext):
    lg, draft = make_greedy(2, 6, 3000, mx.float32, 12)
    check_greedy(mx.transpose(mx.transpose(lg, (2, 1, 0)), (2, 1, 0))[:, ::-1], draft, ext)
    check_greedy(lg[:, 1:], draft[:, 1:], ext)


def test_greedy_dispatch_uses_native_primitive(ext):
    lg, draft = make_greedy(1, 4, 1000, mx.float32, 13)
    assert kernels.kernel_paths()["greedy_accept"] == "native-cpu"
    out = kernels.greedy_accept(lg, draft)
    dot = io.StringIO()
    mx.export_to_dot(dot, *out)
    assert "DsparkGreedyAccept" in dot.getvalue()


# ------------------------------------------------------------------------ sampling accept
def make_sampling(B, w, V, i, with_q=True):
    ks = mx.random.split(key(i), 6)
    k = w - 1
    p = mx.softmax(2 * mx.random.normal((B, w, V), key=ks[0]), axis=-1)
    p = mx.where(mx.random.uniform(shape=(B, w, V), key=ks[1]) < 0.3, 0.0, p)  # truncated
    q = mx.softmax(2 * mx.random.normal((B, max(k, 1), V), key=ks[2]), axis=-1)[:, :k] if with_q else None
    src = q if with_q else p[:, :k]
    draft = mx.random.categorical(mx.log(src + 1e-30), key=ks[3]).astype(mx.int32) if k else mx.zeros((B, 0), mx.int32)
    u = mx.random.uniform(shape=(B, k), key=ks[4])
    ub = mx.random.uniform(shape=(B,), key=ks[5])
    return p, q, draft, u, ub


def check_sampling(args, ext):
    p = args[0]
    want = sampling_accept_reference(*args)
    poison((p.shape[0],))
    got = ext.sampling_accept(*args, stream=mx.cpu)
    mx.eval(want, got)
    for name, a, b in zip(("accepted", "bonus"), got, want):
        assert a.dtype == mx.int32 and a.shape == b.shape, name
        assert mx.array_equal(a, b).item(), f"{name} differs (seed {SEED}): {a} vs {b}"
    return got


@pytest.mark.parametrize("V", [49152, 151936])
@pytest.mark.parametrize("w", [1, 2, 4, 9, 16])
@pytest.mark.parametrize("with_q", [True, False])
def test_sampling_parity(ext, V, w, with_q):
    B = random.Random(SEED + V + w).randint(1, 4)
    check_sampling(make_sampling(B, w, V, hash((V, w, with_q)) % 1000, with_q), ext)


def test_sampling_edge_cases(ext):
    B, w, V = 8, 4, 300
    p, q, draft, u, ub = make_sampling(B, w, V, 21)
    p, q, d, u_, ub = (np.array(a) for a in (p, q, draft, u, ub))
    q[0, 0, d[0, 0]] = 0.0  # q(d) = 0: accepted iff p(d) > 0
    p[1, 0, d[1, 0]] = 0.0  # p(d) = 0: rejected
    d[2, 1] = V + 5  # out of range: rejected
    d[3, 0] = -1
    q[4, 0] = 2 * p[4, 0]  # rejected (u > 1/2) with a zero residual: bonus from p_0
    u_[4, 0] = 0.999
    p[5, :] = 0.0  # no mass anywhere: argmax of p_a
    q[5, :] = 0.0
    ub[6] = 0.0
    ub[7] = np.nextafter(np.float32(1), np.float32(0))
    args = tuple(mx.array(a) for a in (p, q, d, u_, ub))
    acc, bonus = check_sampling(args, ext)
    assert acc[1].item() == 0 and acc[2].item() <= 1 and acc[3].item() == 0
    assert acc[0].item() >= (1 if p[0, 0, d[0, 0]] > 0 else 0)
    assert acc[4].item() == 0 and p[4, 0, bonus[4].item()] > 0
    assert bonus[5].item() == 0  # argmax of an all-zero row
    check_sampling((args[0], None) + args[2:], ext)


def _numpy_rule(p, q, d, u, ub):
    """The documented rule in plain numpy/Python integers (checks the reference itself)."""
    B, w, V = p.shape
    k = w - 1
    acc, bon = [], []
    for b in range(B):
        a = k
        for j in range(k):
            t = int(d[b, j])
            pj = p[b, j, t] if 0 <= t < V else np.float32(0)
            qj = (q[b, j, t] if q is not None else np.float32(1)) if 0 <= t < V else np.float32(0)
            if not np.float32(u[b, j]) * qj < pj:
                a = j
                break
        mass = lambda x: [int(np.float32(min(max(v, 0), 1)) * np.float32(2**40)) for v in x]
        m = mass(p[b, a])
        if a < k:
            qa = q[b, a] if q is not None else (np.arange(V) == d[b, a]).astype(np.float32)
            r = mass((p[b, a] - qa).astype(np.float32))
            if sum(r) > 10995:
                m = r
        M = sum(m)
        U = min(max(int(np.float32(ub[b]) * np.float32(2**24)), 0), 2**24 - 1)
        T = M * U >> 24
        cs = np.cumsum(np.array(m, dtype=object))
        bon.append(int(np.argmax(cs > T)) if M else int(np.argmax(p[b, a])))
        acc.append(a)
    return acc, bon


def test_sampling_reference_is_the_documented_rule():
    for i, with_q in enumerate((True, False, True)):
        args = make_sampling(4, 5, 64, 30 + i, with_q)
        want = _numpy_rule(*(None if a is None else np.array(a) for a in args))
        acc, bon = sampling_accept_reference(*args)
        assert (acc.tolist(), bon.tolist()) == want, f"seed {SEED}"


@pytest.mark.parametrize("with_q", [True, False])
def test_sampling_is_lossless_in_distribution(with_q):
    """The first committed token (draft if accepted, else bonus) is distributed as p_0."""
    V, N = 6, 40000
    rng = np.random.default_rng(SEED)
    p0 = rng.dirichlet(np.ones(V)).astype(np.float32)
    q0 = rng.dirichlet(np.ones(V)).astype(np.float32) if with_q else None
    src = q0 if with_q else np.eye(V, dtype=np.float32)[rng.integers(V)]  # lookup: a fixed proposal
    d = rng.choice(V, size=N, p=src / src.sum()).astype(np.int32)
    p = mx.broadcast_to(mx.array(p0)[None, None], (N, 2, V))
    q = mx.broadcast_to(mx.array(q0)[None, None], (N, 1, V)) if with_q else None
    acc, bon = kernels.sampling_accept(
        p,
        q,
        mx.array(d)[:, None],
        mx.array(rng.random((N, 1), dtype=np.float32)),
        mx.array(rng.random(N, dtype=np.float32)),
    )
    tok = np.where(np.array(acc) > 0, d, np.array(bon))
    counts = np.bincount(tok, minlength=V)
    expect = p0 / p0.sum() * N
    chi2 = float(((counts - expect) ** 2 / np.maximum(expect, 1e-9)).sum())
    assert chi2 < 30.0, f"chi2 {chi2:.1f} (df {V - 1}), seed {SEED}: {counts} vs {expect.round()}"


# -------------------------------------------------------------------- dispatch / fallback
def test_reference_mode_and_fallback_warns_once(monkeypatch, ext):
    import sys
    import warnings

    lg, draft = make_greedy(2, 5, 2000, mx.bfloat16, 40)
    want = greedy_accept_reference(lg, draft)
    monkeypatch.setenv("MLX_DSPARK_KERNELS", "reference")
    assert kernels.kernel_paths()["greedy_accept"] == "reference"
    monkeypatch.delenv("MLX_DSPARK_KERNELS")

    monkeypatch.setitem(sys.modules, "mlx_dspark._ext", None)  # the extension is missing
    kernels.reset()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                got = kernels.greedy_accept(lg, draft)
                got2 = kernels.sampling_accept(*make_sampling(2, 3, 50, 41))
        fallback = [c for c in caught if issubclass(c.category, _native.NativeFallbackWarning)]
        assert len(fallback) == 1, [str(c.message) for c in caught]
        assert "native kernels unavailable" in str(fallback[0].message)
        status = kernels.native_status()
        assert not status["loaded"] and "not importable" in status["reason"]
        assert status["kernels"]["greedy_accept"] == "reference"
        assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))
        assert len(got2) == 2
    finally:
        monkeypatch.undo()
        kernels.reset()
    assert _native.ext(warn=False) is not None


def test_each_kernel_is_checked_on_its_first_use_and_falls_back_alone(monkeypatch, ext):
    """A greedy generation compiles and checks only the greedy kernel (on CUDA each is an NVRTC
    compile); a sampling kernel that fails its check falls back alone, with one warning naming it."""
    import warnings

    real_call = kernels._call

    def broken_sampling(path, kernel, *args):
        if kernel == "sampling_accept":
            raise RuntimeError("does not compile here")
        return real_call(path, kernel, *args)

    kernels.reset()
    try:
        lg, draft = make_greedy(2, 5, 2000, mx.float32, 50)
        got = kernels.greedy_accept(lg, draft)
        assert set(kernels._checked) == {("native-cpu", "greedy_accept")}
        monkeypatch.setattr(kernels, "_call", broken_sampling)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                sampled = kernels.sampling_accept(*make_sampling(2, 3, 50, 51))
        fallback = [str(c.message) for c in caught if issubclass(c.category, _native.NativeFallbackWarning)]
        assert len(fallback) == 1 and "sampling_accept kernel failed its self-check" in fallback[0], fallback
        paths = kernels.kernel_paths()
        assert paths["greedy_accept"] == "native-cpu"
        assert paths["sampling_accept"] == "reference (self-check failed)"
        want = greedy_accept_reference(lg, draft)
        assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))
        assert all(
            mx.array_equal(a, b).item()
            for a, b in zip(sampled, sampling_accept_reference(*make_sampling(2, 3, 50, 51)))
        )
    finally:
        monkeypatch.undo()
        kernels.reset()


def test_on_cuda_only_a_long_lived_process_compiles_the_accept_kernels(monkeypatch):
    """Each CUDA accept kernel is an NVRTC compile (~2.5 s on the H200) that saves tens of
    microseconds a round: a one-shot run takes the references, `serve` (expect_long_run) and
    MLX_DSPARK_KERNELS=jit take the kernels."""
    monkeypatch.setattr(kernels, "_backend", lambda: "cuda")
    monkeypatch.delenv("MLX_DSPARK_KERNELS", raising=False)
    try:
        assert kernels._path() == "reference"
        assert "MLX_DSPARK_KERNELS=jit" in kernels.kernel_paths()["greedy_accept"]  # what doctor says
        kernels.expect_long_run()
        assert kernels._path() == "cuda"
        kernels.expect_long_run(False)
        monkeypatch.setenv("MLX_DSPARK_KERNELS", "jit")
        assert kernels._path() == "cuda"
    finally:
        kernels.expect_long_run(False)
