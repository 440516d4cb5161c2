"""Width-invariant linear layers: y = x W^T (+ bias) whose every row is computed with the same
arithmetic whatever the number of rows, so a verify round's row equals a plain step's bitwise.

Why it is needed: MLX picks its matmul and quantized-matmul kernels by the number of rows M
(a gemv at M = 1, a tiled GEMM above; cuBLAS and OpenBLAS pick further by M), and each reduces
in its own order. Padding every decode forward to one fixed width also removes the shape change,
but a plain step then pays for a width-W GEMM (H200, bf16: 196 -> 111 tok/s). These kernels keep
the real width: a row's sum runs in one fixed order that does not look at M, and the weight row is
read from memory once for all rows (small-M products are memory-bound), so M = 1 costs a gemv.

Paths (`linear_path()`), per backend:
  cuda       the GPU body (kernels/gpu/invariant_linear.h) through mx.fast.cuda_kernel
  metal      the same body through mx.fast.metal_kernel (compile-checked on Linux)
  native     CPU: the C++ primitive of mlx_dspark._ext (csrc/invariant_linear.cpp), dense weights
  rowwise    CPU without the extension: each row its own M = 1 product (invariant, M x the cost)
Quantized weights on the CPU keep MLX's quantized_matmul: its rows are computed one by one
(measured bitwise at M = 1..17, bits 4 / 8, groups 32 / 64 / 128); the load self-check proves it.

`call(layer, x)` is what compat.py's routing calls for nn.Linear, nn.QuantizedLinear and the
embeddings' as_linear while kernels.invariant.active() is on; None means "no invariant path for
this layer here" (MLX's own op runs, and the self-check judges the forward).
"""

from __future__ import annotations

import functools
import os
import weakref

import mlx.core as mx
import mlx.nn as nn

from . import native as _native
from .gpu_source import GPU_DIR, Instance

THREADS = 128  # DS_IL_THREADS
VEC = 8  # DS_IL_VEC: K must be a multiple of it
COLS = THREADS // 32  # output columns per threadgroup
BITS = (2, 4, 8)
GROUPS = (32, 64, 128)
_FLOATS = (mx.float32, mx.float16, mx.bfloat16)


# ------------------------------------------------------------------------------- reference
def invariant_linear_reference(
    x: mx.array,
    weight: mx.array,
    scales: mx.array | None = None,
    biases: mx.array | None = None,
    bias: mx.array | None = None,
    group_size: int = 64,
    bits: int = 0,
) -> mx.array:
    """The kernels' semantics: sum_k x[m, k] w[n, k] in float32 (+ bias), rounded once to x's
    dtype, w = the dense weight or scale * q + bias of MLX's affine quantization. Any order of
    the sum: the kernels' exact order is in invariant_linear.h."""
    if bits:
        w = mx.dequantize(
            weight, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size, bits=bits
        )
    else:
        w = weight.astype(mx.float32)
    y = x.astype(mx.float32) @ w.T
    if bias is not None:
        y = y + bias.astype(mx.float32)
    return y.astype(x.dtype)


def rowwise(x2: mx.array, product) -> mx.array:
    """Each row of x2 [M, K] through `product` alone (M = 1 calls): invariant, M times the reads."""
    if x2.shape[0] == 1:
        return product(x2)
    return mx.concatenate([product(x2[m : m + 1]) for m in range(x2.shape[0])], axis=0)


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
_DENSE = "  ds_il_dense<T, HAS_BIAS>(c, x, w, bias, out, x_shape[0], w_shape[0], x_shape[1]);\n"
_AFFINE = (
    "  ds_il_affine<T, BITS, HAS_BIAS>(c, x, wq, scales, biases, bias, out, x_shape[0], wq_shape[0], x_shape[1],\n"
    "                                  x_shape[1] / scales_shape[1]);\n"
)
DENSE_INPUTS = ("x", "w", "bias")
AFFINE_INPUTS = ("x", "wq", "scales", "biases", "bias")


@functools.lru_cache(maxsize=None)
def _body() -> str:
    return "".join((GPU_DIR / f).read_text() + "\n" for f in ("ds_portable.h", "invariant_linear.h"))


def instance(lang: str, kind: str) -> Instance:
    """The `lang` (cuda | metal) instance of the dense or affine kernel."""
    ctx = _CUDA_CTX if lang == "cuda" else _METAL_CTX
    if kind == "dense":
        return Instance("ds_invariant_linear", DENSE_INPUTS, ("out",), ctx + _DENSE, _body())
    return Instance("ds_invariant_qlinear", AFFINE_INPUTS, ("out",), ctx + _AFFINE, _body())


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


_placeholders: dict = {}


def _no_bias(dtype) -> mx.array:
    z = _placeholders.get(dtype)
    if z is None:
        z = _placeholders[dtype] = mx.zeros((1,), dtype=dtype)
    return z


def _launch(kern, inputs, template, M: int, N: int, dtype) -> mx.array:
    (out,) = kern(
        inputs=inputs,
        template=template,
        grid=(-(-N // COLS) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(M, N)],
        output_dtypes=[dtype],
    )
    return out


def dense_gpu(x2, weight, bias=None, lang: str = "cuda") -> mx.array:
    """The GPU instance on x2 [M, K] (tests and benchmarks; layers go through call())."""
    return _dense_gpu_plan(weight, bias, lang)(x2)


def affine_gpu(x2, wq, scales, biases, bits: int, bias=None, lang: str = "cuda") -> mx.array:
    """The quantized GPU instance on x2 [M, K] (tests and benchmarks; layers go through call())."""
    return _affine_gpu_plan(wq, scales, biases, bits, bias, lang)(x2)


# ------------------------------------------------------------------------------------ dispatch
_paths: dict = {}


def linear_path() -> str:
    """cuda | metal | native | rowwise: how this module's dense product runs on the default device."""
    key = (str(mx.default_device()), os.environ.get("MLX_DSPARK_KERNELS", ""))
    path = _paths.get(key)
    if path is None:
        path = _paths[key] = _linear_path()
    return path


def _linear_path() -> str:
    forced = os.environ.get("MLX_DSPARK_KERNELS", "").strip().lower() == "reference"
    if mx.default_device() == mx.cpu or forced:
        if not forced and _native.ext(warn=False) is not None and hasattr(_native.ext(warn=False), "invariant_linear"):
            return "native"
        return "rowwise"
    if mx.cuda.is_available():
        return "cuda"
    if mx.metal.is_available():
        return "metal"
    return "rowwise"


def dense(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array | None:
    """x [..., K] @ weight[N, K].T (+ bias), invariant in the rows; None where not supported."""
    return _dense_plan(weight, bias, linear_path())(x)


def affine(x, wq, scales, biases, group_size: int, bits: int, bias=None) -> mx.array | None:
    """The quantized twin of dense() (MLX's affine layout); None where not supported (on the CPU:
    MLX's quantized_matmul computes rows one by one already)."""
    path = linear_path()
    if path not in ("cuda", "metal") or bits not in BITS or group_size not in GROUPS or wq.ndim != 2:
        return None
    return _affine_gpu_plan(wq, scales, biases, bits, bias, path)(x)


_plans: dict = {}  # (id(layer), as_linear) -> (weakref to the layer, weight, device, plan or None)


def call(layer, x: mx.array, as_linear: bool = False) -> mx.array | None:
    """The invariant product of an mlx.nn layer (Linear, QuantizedLinear, or an Embedding /
    QuantizedEmbedding used as the tied lm_head), or None where it has no invariant path.

    Hot path: a decode step calls this for every linear layer, so what can be decided once per
    layer (kind, weights, path, launch shape) is, and cached until the layer's weight changes."""
    key = (id(layer), as_linear)
    hit = _plans.get(key)
    device = mx.default_device()
    if hit is None or hit[0]() is not layer or hit[1] is not layer.get("weight") or hit[2] != device:
        if hit is None or hit[0]() is not layer:  # the entry goes when the layer does
            weakref.finalize(layer, _plans.pop, key, None)
        hit = _plans[key] = (weakref.ref(layer), layer.get("weight"), device, _plan(layer, as_linear))
    plan = hit[3]
    return None if plan is None else plan(x)


def _plan(layer, as_linear: bool):
    """A function x -> the layer's invariant product (None for an input it does not take), or
    None for a layer kind with no invariant path here."""
    bias = None if as_linear or "bias" not in layer else layer["bias"]
    if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        if getattr(layer, "mode", "affine") != "affine":
            return None
        wq, scales, biases = layer["weight"], layer["scales"], layer["biases"]
        bits, group = layer.bits, layer.group_size
        path = linear_path()
        if path not in ("cuda", "metal") or bits not in BITS or group not in GROUPS or wq.ndim != 2:
            return None  # MLX's own op
        return _affine_gpu_plan(wq, scales, biases, bits, bias, path)
    if isinstance(layer, (nn.Linear, nn.Embedding)):
        return _dense_plan(layer["weight"], bias, linear_path())
    return None


def reset() -> None:
    """Forget the cached paths and per-layer plans (after MLX_DSPARK_KERNELS or the extension changed)."""
    _paths.clear()
    _plans.clear()


def _dense_plan(weight: mx.array, bias, path: str):
    if weight.ndim != 2 or weight.dtype not in _FLOATS or weight.shape[1] % VEC:
        return lambda x: None
    if path in ("cuda", "metal"):
        return _dense_gpu_plan(weight, bias, path)
    N, K = weight.shape
    dt = weight.dtype
    if path == "native":
        fn = _native.ext(warn=False).invariant_linear

        def product(x2):
            return fn(x2, weight, bias)
    else:

        def one(r):
            out = r @ weight.T
            return out + bias if bias is not None else out

        def product(x2):
            return rowwise(x2, one)

    def plan(x):
        if x.dtype != dt or x.shape[-1] != K or x.size == 0:
            return None
        y = product(x.reshape(-1, K))
        return y if x.ndim == 2 else y.reshape(*x.shape[:-1], N)

    return plan


def _dense_gpu_plan(weight: mx.array, bias, lang: str):
    N, K = weight.shape
    dt = weight.dtype
    kern = _kernel(lang, "dense")
    b = bias.astype(dt) if bias is not None else _no_bias(dt)
    template = [("T", dt), ("HAS_BIAS", bias is not None)]

    def plan(x):
        if x.dtype != dt or x.shape[-1] != K or x.size == 0:
            return None
        M = x.size // K
        out = _launch(kern, [x.reshape(M, K), weight, b], template, M, N, dt)
        return out if x.ndim == 2 else out.reshape(*x.shape[:-1], N)

    return plan


def _affine_gpu_plan(wq, scales, biases, bits: int, bias, lang: str):
    N, K = wq.shape[0], wq.shape[1] * 32 // bits
    kern = _kernel(lang, "affine")
    fixed: dict = {}  # x dtype -> (the inputs after x, the template)

    def plan(x):
        dt = x.dtype
        if dt not in _FLOATS or x.shape[-1] != K or x.size == 0 or K % VEC:
            return None
        got = fixed.get(dt)
        if got is None:
            b = bias.astype(dt) if bias is not None else _no_bias(dt)
            got = fixed[dt] = (
                [wq, scales.astype(dt), biases.astype(dt), b],
                [("T", dt), ("BITS", bits), ("HAS_BIAS", bias is not None)],
            )
        M = x.size // K
        out = _launch(kern, [x.reshape(M, K)] + got[0], got[1], M, N, dt)
        return out if x.ndim == 2 else out.reshape(*x.shape[:-1], N)

    return plan
