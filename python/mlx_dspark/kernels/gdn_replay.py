"""The Gated DeltaNet state replay (hybrid rollback) as one native GPU kernel, with its pure-MLX
reference.

`gdn_replay(k, v, g, beta, state)` returns the recurrent state after T positions of mlx-lm's
scalar-gated delta rule (the recurrence of qwen3_5 / qwen3_next's GDN layers; q is not needed
for the state); `gdn_recurrence(q, k, v, g, beta, state)` also returns the outputs y [B, T, Hv,
Dv] (float32), so one kernel can serve plain steps, verify rounds and the replay alike. The
body (kernels/gpu/gdn_replay.h) is written once over ds_portable.h and instanced for CUDA
(`mx.fast.cuda_kernel`) and Metal (`mx.fast.metal_kernel`); the reference is the same arithmetic
as mlx-lm's `_gated_delta_step_ops` loop.

Not wired into models/hybrid.py yet, on purpose: the rollback must rebuild the state plain
decoding holds bitwise, and plain decoding runs mlx-lm's own recurrence (its ops loop on CPU and
CUDA, its Metal kernel on Apple GPUs). This kernel sums in its own order, so it may only replace
the replay where the plain path runs the same kernel, i.e. once the recording forward routes
every GDN forward (plain step, verify, replay) through it on a GPU. Parity against the reference
(to float32 rounding) runs on a device (tests/test_hybrid_kernel.py); both instances are
compile-checked on Linux.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from .gpu_source import GPU_DIR, Instance

THREADS = 64  # DS_GR_THREADS
MAX_DK = 256  # DS_GR_MAX_DK
INPUTS, OUTPUTS = ("q", "k", "v", "g", "beta", "state"), ("out", "y")

_CALL = """  const int B = state_shape[0];
  const int Hv = state_shape[1];
  const int Dv = state_shape[2];
  const int Dk = state_shape[3];
  const int T = k_shape[1];
  const int Hk = k_shape[2];
  if (row < B * Hv * Dv) ds_gr_row<WITH_Y>(q, k, v, g, beta, state, out, y, T, Hk, Hv, Dk, Dv, row);
"""
_CUDA_LAUNCH = "  const int row = (int)(blockIdx.x * blockDim.x + threadIdx.x);\n"
_METAL_LAUNCH = "  const int row = (int)thread_position_in_grid.x;\n"


@functools.lru_cache(maxsize=None)
def _body() -> str:
    return "".join((GPU_DIR / f).read_text() + "\n" for f in ("ds_portable.h", "gdn_replay.h"))


def cuda_instance() -> Instance:
    return Instance("ds_gdn_replay", INPUTS, OUTPUTS, _CUDA_LAUNCH + _CALL, _body())


def metal_instance() -> Instance:
    return Instance("ds_gdn_replay", INPUTS, OUTPUTS, _METAL_LAUNCH + _CALL, _body())


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
    inst = cuda_instance() if lang == "cuda" else metal_instance()
    make = mx.fast.cuda_kernel if lang == "cuda" else mx.fast.metal_kernel
    return make(
        name=inst.name,
        input_names=list(inst.input_names),
        output_names=list(inst.output_names),
        source=inst.source,
        header=inst.header,
    )


def supported(k: mx.array, v: mx.array, state: mx.array) -> bool:
    return (
        k.ndim == 4
        and v.ndim == 4
        and state.ndim == 4
        and k.shape[-1] <= MAX_DK
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
    grid = -(-rows // THREADS) * THREADS
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


def gdn_replay(k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array) -> mx.array:
    path = replay_path()
    if path == "reference" or not supported(k, v, state):
        return gdn_replay_reference(k, v, g, beta, state)
    return gdn_replay_gpu(k, v, g, beta, state, lang=path)
