"""Width-invariant MoE expert products: what mlx-lm's SwitchLinear (mx.gather_mm) and
QuantizedSwitchLinear (mx.gather_qmm) compute, out[..., m, :] = x[..., m, :] @ W[idx[...]].T, with
every output row computed by the same arithmetic whatever the number of tokens in the call.

Why it is needed: on a GPU MLX's gather kernels, like its matmuls, pick their tiling by shape (and
mlx-lm sorts the (token, expert) pairs by expert from 64 pairs on), so a verify round's expert rows
are not a plain step's bitwise, and an MoE target failed the load self-check on the kernel path.
This op is the dense invariant kernel (kernels/invariant_linear.py) per (token, expert) pair: each
output element gets exactly the sums the dense kernel gives that row alone with that expert's
weight (same lane split, same fma order, same xor tree: kernels/gpu/invariant_gather.h reuses the
dense body's helpers), so it never depends on how many pairs the call has, nor on their order.

Paths (`gather_path()`), per backend:
  cuda       the GPU body (kernels/gpu/invariant_gather.h) through mx.fast.cuda_kernel
  metal      the same body through mx.fast.metal_kernel (compile-checked on Linux)
  rowwise    a GPU with MLX_DSPARK_KERNELS=reference: each pair alone through MLX's own gather op
             (every call has one shape, so it is invariant; P calls)
  mlx        the CPU: MLX's own gather_mm / gather_qmm, whose CPU kernels compute each pair as its
             own product (measured bitwise at M = 1..17, sorted and not, float32 and 4 / 8-bit in
             float32 / bf16 / fp16: tests/test_moe_invariant_gather.py); call() answers None there.
Bias (SwitchLinear's per-expert bias) is added by the caller after the product, as mlx-lm does.

`call(layer, x, indices)` is what compat.py's routing calls for SwitchLinear / QuantizedSwitchLinear
while kernels.invariant.active() is on; None means "MLX's own op" (and the self-check judges).
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx

from .gpu_source import GPU_DIR, Instance, compact
from .invariant_linear import BITS, COLS, GROUPS, THREADS, VEC

ROWS = 4  # DS_IL_ROWS: rows per threadgroup (grid y)
MAX_GRID_Y = 65535  # CUDA's limit on grid y; a larger call keeps MLX's op (never a decode step)
_FLOATS = (mx.float32, mx.float16, mx.bfloat16)


# ------------------------------------------------------------------------------- reference
def invariant_gather_reference(
    x: mx.array,
    weight: mx.array,
    indices: mx.array,
    scales: mx.array | None = None,
    biases: mx.array | None = None,
    group_size: int = 64,
    bits: int = 0,
) -> mx.array:
    """The kernels' semantics: out[*S, m, n] = sum_k x[*S, m, k] W[idx[*S], n, k] in float32, rounded
    once to x's dtype, S = the broadcast of x.shape[:-2] and indices.shape, W [E, N, K] dense or
    MLX's affine quantization per expert (w = scale * q + bias). Any order of the sum."""
    if bits:
        w = mx.dequantize(
            weight, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size, bits=bits
        )
    else:
        w = weight.astype(mx.float32)
    S = _broadcast(tuple(x.shape[:-2]), tuple(indices.shape))
    idx = mx.broadcast_to(indices, S).reshape(-1)
    M, K = x.shape[-2:]
    xs = mx.broadcast_to(x.astype(mx.float32), S + (M, K)).reshape(-1, M, K)
    y = xs @ mx.take(w, idx, axis=0).swapaxes(-1, -2)
    return y.reshape(S + (M, w.shape[1])).astype(x.dtype)


def _broadcast(a: tuple, b: tuple) -> tuple:
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    out = []
    for u, v in zip(a, b):
        if u != v and 1 not in (u, v):
            raise ValueError(f"invariant_gather: batch shapes {a} and {b} do not broadcast")
        out.append(max(u, v) if 0 not in (u, v) else 0)
    return tuple(out)


def operands(x: mx.array, indices: mx.array):
    """(x, idx, S) as the kernel takes them: idx flat [P] over the output batch shape S, and x
    [*xb, M, K] whose batch dims are S's leading dims (then ones), so pair p reads x batch p / rep
    with rep = P / prod(xb); an x that broadcasts otherwise is materialized (never in mlx-lm)."""
    xb, M, K = tuple(x.shape[:-2]), x.shape[-2], x.shape[-1]
    S = _broadcast(xb, tuple(indices.shape))
    idx = indices if tuple(indices.shape) == S else mx.broadcast_to(indices, S)
    pad = (1,) * (len(S) - len(xb)) + xb
    j = max((i + 1 for i, d in enumerate(pad) if d != 1), default=0)
    if pad[:j] != S[:j]:
        x = mx.broadcast_to(x, S + (M, K))
    return x, idx.reshape(-1), S


# ------------------------------------------------------------------------------ GPU instances
_CUDA_CTX = """  ds_ctx c;
  c.tid = threadIdx.x;
  c.nthreads = blockDim.x;
  c.bx = blockIdx.x;
  c.by = blockIdx.y;
"""
_METAL_CTX = """  ds_ctx c;
  c.tid = thread_position_in_threadgroup.x;
  c.nthreads = threads_per_threadgroup.x;
  c.bx = threadgroup_position_in_grid.x;
  c.by = threadgroup_position_in_grid.y;
"""
_SHAPES = """  const int P = idx_shape[0];
  int Xb = 1;
  for (int i = 0; i + 2 < (int)x_ndim; ++i) Xb *= x_shape[i];
  const int M = x_shape[x_ndim - 2];
  const int K = x_shape[x_ndim - 1];
"""
_CALLS = {
    "dense": "  ds_ig_dense<T>(c, x, idx, w, out, P, M, w_shape[1], K, w_shape[0], P / Xb);\n",
    "affine": "  ds_ig_affine<T, BITS>(c, x, idx, q, s, z, out, P, M, q_shape[1], K, q_shape[0], P / Xb,\n"
    "                        K / s_shape[2]);\n",
}
_INPUTS = {"dense": ("x", "idx", "w"), "affine": ("x", "idx", "q", "s", "z")}


@functools.lru_cache(maxsize=None)
def _body() -> str:
    files = ("ds_portable.h", "invariant_linear.h", "invariant_gather.h")
    return compact("".join((GPU_DIR / f).read_text() + "\n" for f in files))


def instance(lang: str, kind: str) -> Instance:
    """The `lang` (cuda | metal) instance of the dense or affine expert kernel."""
    ctx = _CUDA_CTX if lang == "cuda" else _METAL_CTX
    name = "ds_invariant_gather" if kind == "dense" else "ds_invariant_qgather"
    return Instance(name, _INPUTS[kind], ("out",), ctx + _SHAPES + _CALLS[kind], _body())


@functools.lru_cache(maxsize=None)
def _kernel(lang: str, kind: str):
    inst = instance(lang, kind)
    make = mx.fast.cuda_kernel if lang == "cuda" else mx.fast.metal_kernel
    return make(
        name=inst.name,
        input_names=list(inst.input_names),
        output_names=list(inst.output_names),
        source=inst.source,
        header=inst.header,
    )


def _grid(N: int, R: int) -> tuple:
    return (-(-N // COLS) * THREADS, -(-R // ROWS), 1)


def gather_gpu(x, weight, indices, lang: str = "cuda") -> mx.array:
    """The dense GPU instance: out [*S, M, N] (tests and benchmarks; layers go through call())."""
    x, idx, S = operands(x, indices)
    M, N = x.shape[-2], weight.shape[1]
    (out,) = _kernel(lang, "dense")(
        inputs=[x, idx, weight],
        template=[("T", x.dtype)],
        grid=_grid(N, idx.size * M),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[S + (M, N)],
        output_dtypes=[x.dtype],
    )
    return out


def gather_affine_gpu(x, wq, scales, biases, indices, bits: int, lang: str = "cuda") -> mx.array:
    """The quantized GPU instance (MLX's affine layout per expert): out [*S, M, N]."""
    x, idx, S = operands(x, indices)
    M, N = x.shape[-2], wq.shape[1]
    dt = x.dtype
    (out,) = _kernel(lang, "affine")(
        inputs=[x, idx, wq, scales.astype(dt), biases.astype(dt)],
        template=[("T", dt), ("BITS", bits)],
        grid=_grid(N, idx.size * M),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[S + (M, N)],
        output_dtypes=[dt],
    )
    return out


# ------------------------------------------------------------------------------------ dispatch
_paths: dict = {}


def gather_path() -> str:
    """cuda | metal | rowwise | mlx: how an expert product runs on the default device (see above)."""
    key = (str(mx.default_device()), os.environ.get("MLX_DSPARK_KERNELS", ""))
    path = _paths.get(key)
    if path is None:
        path = _paths[key] = _gather_path()
    return path


def _gather_path() -> str:
    if mx.default_device() == mx.cpu:
        return "mlx"
    if os.environ.get("MLX_DSPARK_KERNELS", "").strip().lower() == "reference":
        return "rowwise"
    if mx.cuda.is_available():
        return "cuda"
    if mx.metal.is_available():
        return "metal"
    return "rowwise"


def reset() -> None:
    """Forget the cached paths and the per-dtype scales (after MLX_DSPARK_KERNELS changed)."""
    _paths.clear()
    _cast.clear()


def _kind(layer) -> str | None:
    """dense | affine for a layer this op takes, else None (nvfp4 / mxfp modes, a global scale,
    3 / 5 / 6-bit packing, groups other than 32 / 64 / 128, K not a multiple of 8)."""
    if "scales" in layer:
        if getattr(layer, "mode", "affine") != "affine" or layer.get("global_scale") is not None:
            return None
        if layer.bits not in BITS or layer.group_size not in GROUPS or layer.get("biases") is None:
            return None
        w = layer["weight"]
        return "affine" if w.ndim == 3 and (w.shape[2] * 32 // layer.bits) % VEC == 0 else None
    w = layer.get("weight")
    return "dense" if w is not None and w.ndim == 3 and w.dtype in _FLOATS and w.shape[2] % VEC == 0 else None


_cast: dict = {}  # (id(scales array), dtype) -> (the array, its cast): scales in x's dtype, once


def _as(a: mx.array, dt) -> mx.array:
    if a.dtype == dt:
        return a
    key = (id(a), dt)
    hit = _cast.get(key)
    if hit is None or hit[0] is not a:
        hit = _cast[key] = (a, a.astype(dt))
    return hit[1]


def call(layer, x: mx.array, indices: mx.array) -> mx.array | None:
    """The invariant product of an mlx-lm SwitchLinear / QuantizedSwitchLinear (without its bias),
    or None where this op does not take it (MLX's own gather op runs)."""
    path = gather_path()
    if path == "mlx" or x.ndim < 2 or x.size == 0 or indices.size == 0:
        return None
    kind = _kind(layer)
    if kind is None or x.dtype not in _FLOATS:
        return None
    w = layer["weight"]
    K = w.shape[2] if kind == "dense" else w.shape[2] * 32 // layer.bits
    if x.shape[-1] != K or (kind == "dense" and x.dtype != w.dtype):
        return None
    if path == "rowwise":
        return _rowwise(layer, x, indices)
    if kind == "dense":
        x, idx, S = operands(x, indices)
        if -(-idx.size * x.shape[-2] // ROWS) > MAX_GRID_Y:
            return None
        return _launch(path, "dense", x, idx, S, [w], [("T", x.dtype)], w.shape[1])
    x, idx, S = operands(x, indices)
    if -(-idx.size * x.shape[-2] // ROWS) > MAX_GRID_Y:
        return None
    dt = x.dtype
    ins = [w, _as(layer["scales"], dt), _as(layer["biases"], dt)]
    return _launch(path, "affine", x, idx, S, ins, [("T", dt), ("BITS", layer.bits)], w.shape[1])


def _launch(lang, kind, x, idx, S, weights, template, N) -> mx.array:
    M = x.shape[-2]
    (out,) = _kernel(lang, kind)(
        inputs=[x, idx] + weights,
        template=template,
        grid=_grid(N, idx.size * M),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[S + (M, N)],
        output_dtypes=[x.dtype],
    )
    return out


def _rowwise(layer, x, indices) -> mx.array:
    """Each (token, expert) pair alone through MLX's own gather op: one shape per call."""
    x, idx, S = operands(x, indices)
    M, K = x.shape[-2:]
    xs = mx.broadcast_to(x, S + (M, K)).reshape(-1, 1, M, K)
    w = layer["weight"]
    rows = []
    for p in range(idx.size):
        i = idx[p : p + 1]
        if "scales" in layer:
            y = mx.gather_qmm(
                xs[p],
                w,
                layer["scales"],
                layer["biases"],
                rhs_indices=i,
                transpose=True,
                group_size=layer.group_size,
                bits=layer.bits,
            )
        else:
            y = mx.gather_mm(xs[p], w.swapaxes(-1, -2), rhs_indices=i)
        rows.append(y)
    return mx.concatenate(rows, axis=0).reshape(S + (M, w.shape[1]))
