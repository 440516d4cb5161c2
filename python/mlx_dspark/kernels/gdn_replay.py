"""The Gated DeltaNet state replay (hybrid rollback) as one native GPU kernel, with its pure-MLX
reference.

`gdn_replay(k, v, g, beta, state)` returns the recurrent state after T positions of mlx-lm's
scalar-gated delta rule (the recurrence of qwen3_5 / qwen3_next's GDN layers; q is not needed
for the state); `gdn_recurrence(q, k, v, g, beta, state)` also returns the outputs y [B, T, Hv,
Dv] (float32), so one kernel can serve plain steps, verify rounds and the replay alike. The
body (kernels/gpu/gdn_replay.h) is written once over ds_portable.h and instanced for CUDA
(`mx.fast.cuda_kernel`) and Metal (`mx.fast.metal_kernel`); the reference is the same arithmetic
as mlx-lm's `_gated_delta_step_ops` loop.

Wired into models/hybrid.py on MLX's CUDA backend only: the rollback must rebuild the state
plain decoding holds bitwise, and this kernel sums in its own order, so it replaces mlx-lm's
recurrence in every GDN forward of a Target there (plain step, verify, replay alike). On CUDA
mlx-lm's recurrence is an ops loop (several launches per position); on Metal mlx-lm's own kernel
is already one position-invariant launch, so the Metal instance is compile-checked, not used; on
the CPU the reference (mlx-lm's ops) runs. Parity against the reference (to float32 rounding)
and position invariance run on a device (tests/test_hybrid_kernel.py) and, for the body itself,
on CPU threads (tests/emulation/gdn_replay_emu.cpp); both instances are compile-checked on Linux.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from .gpu_source import Instance, instance, make_kernel

THREADS = 128  # DS_GR_THREADS: 4 state rows of 32 lanes per threadgroup
MAX_DK = 256  # DS_GR_MAX_DK
INPUTS, OUTPUTS = ("q", "k", "v", "g", "beta", "state"), ("out", "y")

_CALL = """  const int B = state_shape[0];
  const int Hv = state_shape[1];
  const int Dv = state_shape[2];
  const int Dk = state_shape[3];
  const int T = k_shape[1];
  const int Hk = k_shape[2];
  if (row < B * Hv * Dv) ds_gr_row<WITH_Y>(q, k, v, g, beta, state, out, y, T, Hk, Hv, Dk, Dv, row, lane);
"""
# one warp per state row: whole warps share a row, so an out-of-range warp skips as a whole
_CUDA_LAUNCH = (
    "  const int gid = (int)(blockIdx.x * blockDim.x + threadIdx.x);\n"
    "  const int row = gid / 32;\n  const uint lane = threadIdx.x & 31u;\n"
)
_METAL_LAUNCH = (
    "  const int gid = (int)thread_position_in_grid.x;\n"
    "  const int row = gid / 32;\n  const uint lane = thread_index_in_simdgroup;\n"
)


BODY_FILES = ("ds_portable.h", "gdn_replay.h")


def cuda_instance() -> Instance:
    return instance("ds_gdn_replay", INPUTS, OUTPUTS, _CUDA_LAUNCH + _CALL, BODY_FILES)


def metal_instance() -> Instance:
    return instance("ds_gdn_replay", INPUTS, OUTPUTS, _METAL_LAUNCH + _CALL, BODY_FILES)


def gdn_recurrence_reference(
    q: mx.array | None, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array
):
    """Pure MLX: (y [B, T, Hv, Dv] or None without q, the state after the T positions), mlx-lm's
    per-position ops in the same order (y in float32)."""
    Hk, Hv = k.shape[2], v.shape[2]
    if Hv // Hk > 1:
        k = mx.repeat(k, Hv // Hk, -2)
        q = None if q is None else mx.repeat(q, Hv // Hk, -2)
    ys = []
    for t in range(k.shape[1]):
        kt = k[:, t]
        state = state * g[:, t][..., None, None]
        kv_mem = (state * kt[..., None, :]).sum(axis=-1)
        delta = (v[:, t] - kv_mem) * beta[:, t][..., None]
        state = state + kt[..., None, :] * delta[..., None]
        if q is not None:
            ys.append((state * q[:, t][..., None, :]).sum(axis=-1))
    return (mx.stack(ys, axis=1) if q is not None else None), state


def gdn_replay_reference(k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array) -> mx.array:
    """Pure MLX: the state after the T positions, mlx-lm's per-position ops in the same order."""
    return gdn_recurrence_reference(None, k, v, g, beta, state)[1]


@functools.lru_cache(maxsize=None)
def _kernel(lang: str):
    return make_kernel(lang, cuda_instance() if lang == "cuda" else metal_instance())


def supported(k: mx.array, v: mx.array, state: mx.array) -> bool:
    return (
        k.ndim == 4
        and v.ndim == 4
        and state.ndim == 4
        and k.shape[-1] <= MAX_DK
        and k.shape[-1] % 32 == 0
        and state.dtype == mx.float32
        and v.shape[2] % k.shape[2] == 0
    )


def gdn_recurrence_gpu(
    q: mx.array | None, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array, lang: str = "cuda"
):
    """(y [B, T, Hv, Dv] float32 or None without q, the new state), one launch."""
    B, Hv, Dv, Dk = state.shape
    T = k.shape[1]
    rows = B * Hv * Dv
    grid = -(-(rows * 32) // THREADS) * THREADS
    with_y = q is not None
    out, y = _kernel(lang)(
        inputs=[q if with_y else k, k, v, g, beta, state],
        template=[("WITH_Y", with_y)],
        grid=(grid, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[state.shape, (B, T, Hv, Dv) if with_y else (1,)],
        output_dtypes=[mx.float32, mx.float32],
    )
    return (y if with_y else None), out


def gdn_replay_gpu(
    k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array, lang: str = "cuda"
) -> mx.array:
    return gdn_recurrence_gpu(None, k, v, g, beta, state, lang=lang)[1]


def replay_path() -> str:
    """cuda | metal | reference: what `gdn_replay` runs on the default device."""
    if mx.default_device() == mx.cpu:
        return "reference"
    if mx.cuda.is_available():
        return "cuda"
    if mx.metal.is_available():
        return "metal"
    return "reference"


@functools.lru_cache(maxsize=None)
def self_check(lang: str) -> str | None:
    """Run the kernel once on small random inputs: None when it matches the reference (to float32
    rounding) and one 5-position call is bitwise five one-position calls, else what went wrong.
    Callers route a model through the kernel only after this passed (once per process)."""
    import numpy as np

    try:
        rng = np.random.default_rng(0)
        f = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32))  # noqa: E731
        T, Hk, Hv, Dk, Dv = 5, 2, 4, 64, 8
        q, k, v, state = f(1, T, Hk, Dk) * 0.125, f(1, T, Hk, Dk) * 0.125, f(1, T, Hv, Dv), f(1, Hv, Dv, Dk) * 0.1
        g, beta = mx.sigmoid(f(1, T, Hv)) * 0.5 + 0.5, mx.sigmoid(f(1, T, Hv))
        y, s = gdn_recurrence_gpu(q, k, v, g, beta, state, lang=lang)
        y_ref, s_ref = gdn_recurrence_reference(q, k, v, g, beta, state)
        if not (
            mx.allclose(s, s_ref, rtol=1e-4, atol=1e-5).item() and mx.allclose(y, y_ref, rtol=1e-4, atol=1e-5).item()
        ):
            return "the native GDN kernel does not match its reference"
        one = state
        for t in range(T):
            sl = slice(t, t + 1)
            one = gdn_recurrence_gpu(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], one, lang=lang)[1]
        if not mx.array_equal(one, s).item():
            return "the native GDN kernel's state depends on how many positions a call covers"
    except Exception as e:  # a JIT failure must not take the model down: mlx-lm's path remains
        return f"the native GDN kernel failed to run ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    return None


def gdn_replay(k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array) -> mx.array:
    path = replay_path()
    if path == "reference" or not supported(k, v, state):
        return gdn_replay_reference(k, v, g, beta, state)
    return gdn_replay_gpu(k, v, g, beta, state, lang=path)
