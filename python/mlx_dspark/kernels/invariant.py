"""Width-invariant causal attention over a KV cache: one query row's output never depends on how
many queries are computed with it, nor on how long the cache is past that row.

The linear layers are made row-invariant by kernels/invariant_linear.py (or by running every
decode forward at one fixed width); attention's shape moves with the block width and with the key
length, which grows by one each step. This op closes that gap: on a GPU each query row reduces
over its own causal keys, in fixed chunks of CHUNK keys, in key order
(kernels/gpu/invariant_attention.h says exactly how); on the CPU each row is its own call.

Paths, picked per backend (`attention_path()`):
  cuda       the GPU body through mx.fast.cuda_kernel (reads the cache through its strides: no copy)
  metal      the same body through mx.fast.metal_kernel (compile-checked on Linux)
  native     the CPU with the extension, float32: csrc/invariant_attention.cpp, one op per call
             whatever the width (each row over its own causal keys in a fixed order)
  rows       the CPU otherwise: each query row alone through MLX's own attention, over exactly its
             causal keys (invariant_attention_rows: the plain step's call, so bit-identical to it;
             about eight ops per extra row per layer, so a verify round's width costs time)
  reference  pure MLX, the chunked arithmetic elementwise (MLX_DSPARK_KERNELS=reference)

`active()` is the switch the fixed-width forward turns on: while it is on (in this thread),
compat.py routes mlx-lm's calls of mx.fast.scaled_dot_product_attention with a causal (or no)
mask here. Everything else (prefill, drafters, other threads) keeps MLX's own kernel.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import mlx.core as mx

from .gpu_source import Instance, instance, make_kernel

CHUNK = 128  # DS_IA_THREADS: keys per chunk = threads per threadgroup
MAX_D = 256  # DS_IA_MAX_D

_local = threading.local()


@contextlib.contextmanager
def active():
    """Route causal attention (and, where compat routes them, the linear layers) through the
    invariant ops inside this block (this thread only)."""
    prev = getattr(_local, "on", False)
    _local.on = True
    try:
        yield
    finally:
        _local.on = prev


def is_active() -> bool:
    return getattr(_local, "on", False)


# ------------------------------------------------------------------------------- reference
def invariant_attention_reference(
    q: mx.array, k: mx.array, v: mx.array, scale: float, offset: mx.array | None = None
) -> mx.array:
    """q [B, H, Lq, D], k / v [B, Hkv, Lk, D] -> [B, H, Lq, D] in q's dtype; causal, aligned at the
    end (query i at position Lk - Lq + i), or, with `offset` (an int32 scalar array), at position
    offset + i of a buffer whose keys past that are never read (a compiled decode step's KV buffer);
    an `offset` of shape [B] gives each batch row its own position (the rows of a batched step).
    Keys are padded to whole chunks, so every chunk has the same shape; a chunk past a row's causal
    length leaves that row's state bit-for-bit unchanged."""
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    rep = H // Hkv
    f32 = mx.float32
    qf = q.astype(f32).reshape(B, Hkv, rep, Lq, 1, D)
    first = (Lk - Lq) if offset is None else offset.astype(mx.int32)
    lead = 1
    if offset is not None and offset.ndim == 1:
        first, lead = first.reshape(B, 1), B
    n = (mx.arange(Lq) + first + 1).reshape(lead, 1, 1, Lq, 1)  # causal length of each row
    nch = -(-Lk // CHUNK)
    pad = nch * CHUNK - Lk
    kf, vf = k.astype(f32), v.astype(f32)
    if pad:
        z = mx.zeros((B, Hkv, pad, D), dtype=f32)
        kf, vf = mx.concatenate([kf, z], axis=2), mx.concatenate([vf, z], axis=2)
    vt = vf.swapaxes(2, 3)  # [B, Hkv, D, Lk'] so every sum runs over the last axis
    neg_inf = mx.array(-mx.inf, dtype=f32)
    m = mx.full((B, Hkv, rep, Lq, 1), -mx.inf, dtype=f32)
    l = mx.zeros((B, Hkv, rep, Lq, 1), dtype=f32)
    acc = mx.zeros((B, Hkv, rep, Lq, D), dtype=f32)
    cols = mx.arange(CHUNK).reshape(1, 1, 1, 1, CHUNK)
    for c in range(nch):
        kc = kf[:, :, None, None, c * CHUNK : (c + 1) * CHUNK, :]  # [B, Hkv, 1, 1, C, D]
        valid = (cols + c * CHUNK) < n
        s = mx.where(valid, mx.sum(qf * kc, axis=-1) * scale, neg_inf)  # [B, Hkv, rep, Lq, C]
        m_new = mx.maximum(m, mx.max(s, axis=-1, keepdims=True))
        p = mx.where(valid, mx.exp(s - m_new), 0.0)
        alpha = mx.exp(m - m_new)
        l = l * alpha + mx.sum(p, axis=-1, keepdims=True)
        vc = vt[:, :, None, None, :, c * CHUNK : (c + 1) * CHUNK]  # [B, Hkv, 1, 1, D, C]
        acc = acc * alpha + mx.sum(p[..., None, :] * vc, axis=-1)
        m = m_new
    return (acc / l).reshape(B, H, Lq, D).astype(q.dtype)


_MLX_SDPA = mx.fast.scaled_dot_product_attention  # MLX's own (compat wraps it after this import)


def cpu_route(dtype=mx.float32) -> str:
    """What the CPU's invariant attention runs for queries of `dtype`: native (the extension's op:
    float32, the extension built), rows (MLX's attention one row at a time) or reference
    (MLX_DSPARK_KERNELS=reference). `invariant_attention` routes by it; doctor reports it."""
    if os.environ.get("MLX_DSPARK_KERNELS", "").strip().lower() == "reference":
        return "reference"
    if dtype == mx.float32:
        from . import native

        ext = native.ext(warn=False)
        if getattr(ext, "invariant_attention", None) is not None:
            return "native"
    return "rows"


def native_cpu(q: mx.array):
    """The extension's CPU op for q's attention where `cpu_route` picks it (on the CPU), else None."""
    if mx.default_device() != mx.cpu or cpu_route(q.dtype) != "native":
        return None
    from . import native

    return native.ext(warn=False).invariant_attention


def one_row(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """A single query row over all of k / v (its causal keys) as the CPU's plain step computes it."""
    fn = native_cpu(q)
    return fn(q, k, v, scale=scale) if fn is not None else _MLX_SDPA(q, k, v, scale=scale, mask=None)


def invariant_attention_rows(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """The CPU path: each query row alone, over exactly its own causal keys, through MLX's own
    attention (one query, no mask). A row's call then has the same shapes and values as the plain
    step at that position, whatever the block width, so it is bit-identical to it; MLX's CPU
    attention with one query is vectorized over the keys (the chunked forms loop in Python)."""
    Lq, Lk = q.shape[2], k.shape[2]
    if Lq == 1:
        return _MLX_SDPA(q, k, v, scale=scale, mask=None)
    rows = []
    for i in range(Lq):
        n = Lk - Lq + i + 1
        rows.append(_MLX_SDPA(q[:, :, i : i + 1], k[:, :, :n], v[:, :, :n], scale=scale, mask=None))
    return mx.concatenate(rows, axis=2)


# ------------------------------------------------------------------------------ GPU instances
_CUDA_LAUNCH = """  ds_ctx c;
  c.tid = threadIdx.x;
  c.nthreads = blockDim.x;
  c.bx = blockIdx.x;
  c.by = blockIdx.y;
  __shared__ float sq[DS_IA_MAX_D];
  __shared__ float sp[DS_IA_THREADS];
  __shared__ float red[DS_IA_THREADS / 32];
"""
_METAL_LAUNCH = """  ds_ctx c;
  c.tid = thread_position_in_threadgroup.x;
  c.nthreads = threads_per_threadgroup.x;
  c.bx = threadgroup_position_in_grid.x;
  c.by = threadgroup_position_in_grid.y;
  threadgroup float sq[DS_IA_MAX_D];
  threadgroup float sp[DS_IA_THREADS];
  threadgroup float red[DS_IA_THREADS / 32];
"""
_CALL = """  const int H = q_shape[1];
  const int Lq = q_shape[2];
  const int D = q_shape[3];
  const int Hkv = k_shape[1];
  const int qi = (int)c.bx;
  const int b = (int)c.by / H;
  const int h = (int)c.by - b * H;
  const int first = FIRST;  // the position of query row 0 (of batch row b)
  const int kvh = h / (H / Hkv);
  ds_ia_row<T>(c, q, b * q_strides[0] + h * q_strides[1] + qi * q_strides[2], q_strides[3],
               k, b * k_strides[0] + kvh * k_strides[1], k_strides[2], k_strides[3],
               v, b * v_strides[0] + kvh * v_strides[1], v_strides[2], v_strides[3],
               D, first + qi + 1, scale[0], out, (((ds_i64)b * H + h) * Lq + qi) * D, sq, sp, red);
"""
INPUTS, OUTPUTS = ("q", "k", "v", "scale"), ("out",)
# The offset forms (compiled decode steps, models/compiled_decode.py): k / v are a KV buffer of any
# capacity whose keys past a row's position are never read. "shared": query row 0 of every batch
# row sits at position off[0] (a generation's step); "rows": batch row b's at off[b] (the rows of
# a batched step, one buffer [B, Hkv, capacity, D] per layer: one launch for all rows).
OFFSET_INPUTS = INPUTS + ("off",)
OFFSET_FORMS = {"": "k_shape[2] - Lq", "shared": "off[0]", "rows": "off[b]"}
_NAMES = {"": "ds_invariant_attention", "shared": "ds_invariant_attention_off", "rows": "ds_invariant_attention_rowoff"}


BODY_FILES = ("ds_portable.h", "invariant_attention.h")


def _instance(launch: str, form: str) -> Instance:
    if form not in OFFSET_FORMS:
        raise ValueError(f"offset form {form!r}: one of {sorted(OFFSET_FORMS)}")
    inputs = OFFSET_INPUTS if form else INPUTS
    return instance(_NAMES[form], inputs, OUTPUTS, launch + _CALL.replace("FIRST", OFFSET_FORMS[form]), BODY_FILES)


def cuda_instance(form: str = "") -> Instance:
    """The CUDA instance of offset form `form` ("" end-aligned, "shared", "rows")."""
    return _instance(_CUDA_LAUNCH, form)


def metal_instance(form: str = "") -> Instance:
    return _instance(_METAL_LAUNCH, form)


@functools.lru_cache(maxsize=None)
def _kernel(lang: str, form: str = ""):
    inst = cuda_instance(form) if lang == "cuda" else metal_instance(form)
    return make_kernel(lang, inst, ensure_row_contiguous=False)


_scales: dict[float, mx.array] = {}


def invariant_attention_gpu(
    q: mx.array, k: mx.array, v: mx.array, scale: float, lang: str = "cuda", offset: mx.array | None = None
) -> mx.array:
    B, H, Lq, D = q.shape
    s = _scales.get(scale)
    if s is None:
        s = _scales[scale] = mx.array([scale], dtype=mx.float32)
    if offset is None:
        form, inputs = "", [q, k, v, s]
    elif offset.ndim == 1:  # a position per batch row
        if offset.shape[0] != B:
            raise ValueError(f"{offset.shape[0]} row positions for {B} batch rows")
        form, inputs = "rows", [q, k, v, s, offset.astype(mx.int32)]
    else:
        form, inputs = "shared", [q, k, v, s, offset.astype(mx.int32).reshape(1)]
    (out,) = _kernel(lang, form)(
        inputs=inputs,
        template=[("T", q.dtype)],
        grid=(Lq * CHUNK, B * H, 1),
        threadgroup=(CHUNK, 1, 1),
        output_shapes=[(B, H, Lq, D)],
        output_dtypes=[q.dtype],
    )
    return out


# ------------------------------------------------------------------------------------ dispatch
def attention_path() -> str:
    """cuda | metal | reference: what `invariant_attention` runs on the default device."""
    if os.environ.get("MLX_DSPARK_KERNELS", "").strip().lower() == "reference" or mx.default_device() == mx.cpu:
        return "reference"
    if mx.cuda.is_available():
        return "cuda"
    if mx.metal.is_available():
        return "metal"
    return "reference"


def supported(q: mx.array, k: mx.array, v: mx.array) -> bool:
    """Shapes the op takes (anything else keeps MLX's kernel, and the load self-check sees it)."""
    return (
        q.ndim == 4
        and k.ndim == 4
        and v.ndim == 4
        and q.shape[3] == k.shape[3] == v.shape[3]
        and q.shape[3] <= MAX_D
        and k.shape[1] > 0
        and q.shape[1] % k.shape[1] == 0
        and k.shape[2] >= q.shape[2]
        and q.dtype in (mx.float32, mx.float16, mx.bfloat16)
    )


def invariant_attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """The invariant op; inside a compiled decode step (a KV buffer whose write position the cache
    handed over with `expect_offset`) its offset form."""
    path = attention_path()
    offset = take_offset()
    if path == "reference":
        if offset is not None:
            return invariant_attention_reference(q, k, v, scale, offset)
        route = cpu_route(q.dtype) if mx.default_device() == mx.cpu else "reference"
        if route == "native":
            return native_cpu(q)(q, k, v, scale=scale)
        if route == "rows":
            return invariant_attention_rows(q, k, v, scale)
        return invariant_attention_reference(q, k, v, scale)
    return invariant_attention_gpu(q, k, v, scale, lang=path, offset=offset)


class NotInvariant(RuntimeError):
    """A forward that a compiled decode step traces calls something it cannot carry."""


# A compiled decode step's cache (models/compiled_decode.py) returns its whole KV buffer, whose
# positions past the rows are stale: it hands the rows' position here, and the next attention call
# in this thread takes it. A cache that handed one over which no invariant attention took is an
# error (`offset_pending`): MLX's own kernel would have read the stale positions.
def expect_offset(offset: mx.array) -> None:
    if getattr(_local, "offset", None) is not None:
        raise NotInvariant("a KV buffer's position was handed over twice without an attention call between")
    _local.offset = offset


def take_offset() -> mx.array | None:
    offset = getattr(_local, "offset", None)
    _local.offset = None
    return offset


def offset_pending() -> bool:
    return getattr(_local, "offset", None) is not None
