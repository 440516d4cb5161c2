"""Width-invariant linear layers: y = x W^T (+ bias) whose every row is computed with the same
arithmetic whatever the number of rows, so a verify round's row equals a plain step's bitwise.

Why it is needed: MLX picks its matmul and quantized-matmul kernels by the number of rows M
(a gemv at M = 1, a tiled GEMM above; cuBLAS and OpenBLAS pick further by M), and each reduces
in its own order. Padding every decode forward to one fixed width also removes the shape change,
but a plain step then pays for a width-W GEMM (H200, bf16: 196 -> 111 tok/s). These kernels keep
the real width: a row's sum runs in one fixed order that does not look at M, and the weight row is
read from memory once for all rows (small-M products are memory-bound), so M = 1 costs a gemv.

Strategies (`strategies()`, tried in order by the load self-check):
  gemv       GPUs: MLX's own single-row kernels (gemv / qmv), every row its own batch element of
             one call; a plain step is then exactly MLX's own M = 1 product
  kernel     this module's kernels, by path below

Paths of the kernel strategy (`linear_path()`), per backend:
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


def batched_rows(x2: mx.array, product) -> mx.array:
    """Each row of x2 [M, K] as its own batch element of ONE call: `product` gets [M, 1, K], so
    MLX runs its single-row kernel (gemv / qmv) for every row, the same one a plain step runs.
    Invariant where that kernel's configuration depends on the weight's shape only, not on the
    batch (measured at load by the self-check, never assumed)."""
    return product(x2[:, None, :])[:, 0, :]


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


def _launch(lang, kind, inputs, template, M, N, dtype):
    (out,) = _kernel(lang, kind)(
        inputs=inputs,
        template=template,
        grid=(-(-N // COLS) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(M, N)],
        output_dtypes=[dtype],
    )
    return out


def dense_gpu(x2, weight, bias=None, lang: str = "cuda") -> mx.array:
    M, _ = x2.shape
    N = weight.shape[0]
    has_bias = bias is not None
    b = bias.astype(x2.dtype) if has_bias else _no_bias(x2.dtype)
    return _launch(lang, "dense", [x2, weight, b], [("T", x2.dtype), ("HAS_BIAS", has_bias)], M, N, x2.dtype)


def affine_gpu(x2, wq, scales, biases, bits: int, bias=None, lang: str = "cuda") -> mx.array:
    M, _ = x2.shape
    N = wq.shape[0]
    has_bias = bias is not None
    b = bias.astype(x2.dtype) if has_bias else _no_bias(x2.dtype)
    return _launch(
        lang,
        "affine",
        [x2, wq, scales.astype(x2.dtype), biases.astype(x2.dtype), b],
        [("T", x2.dtype), ("BITS", bits), ("HAS_BIAS", has_bias)],
        M,
        N,
        x2.dtype,
    )


# ------------------------------------------------------------------------------------ dispatch
STRATEGIES = ("gemv", "kernel")  # how `call` computes: MLX's single-row kernels batched, or ours
_paths: dict = {}


def strategies() -> tuple[str, ...]:
    """The strategies the load self-check tries on the default device, cheapest first: on a GPU
    MLX's own single-row kernels batched over the rows (a plain step then costs exactly what it
    costs without invariance), then this module's kernels; on the CPU this module's kernels."""
    return ("kernel",) if mx.default_device() == mx.cpu else STRATEGIES


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


def _fits(x: mx.array, K: int) -> bool:
    return x.dtype in _FLOATS and x.shape[-1] == K and K % VEC == 0 and x.size > 0


def dense(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array | None:
    """x [..., K] @ weight[N, K].T (+ bias), invariant in the rows; None where not supported."""
    K = weight.shape[-1]
    if weight.ndim != 2 or weight.dtype != x.dtype or not _fits(x, K):
        return None
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    path = linear_path()
    if path in ("cuda", "metal"):
        y = dense_gpu(x2, weight, bias, lang=path)
    elif path == "native":
        y = _native.ext(warn=False).invariant_linear(x2, weight, bias)
    else:

        def one(r):
            out = r @ weight.T
            return out + bias if bias is not None else out

        y = rowwise(x2, one)
    return y.reshape(*lead, weight.shape[0])


def affine(x, wq, scales, biases, group_size: int, bits: int, bias=None) -> mx.array | None:
    """The quantized twin of dense() (MLX's affine layout); None where not supported."""
    K = wq.shape[-1] * 32 // bits if bits in BITS else -1
    if wq.ndim != 2 or bits not in BITS or group_size not in GROUPS or not _fits(x, K):
        return None
    path = linear_path()
    if path not in ("cuda", "metal"):
        return None  # the CPU quantized_matmul computes rows one by one already
    lead = x.shape[:-1]
    y = affine_gpu(x.reshape(-1, K), wq, scales, biases, bits, bias, lang=path)
    return y.reshape(*lead, wq.shape[0])


def _gemv(layer, x: mx.array, as_linear: bool) -> mx.array | None:
    bias = None if as_linear else layer.get("bias") if "bias" in layer else None
    K = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        wq, s, b = layer["weight"], layer["scales"], layer.get("biases")
        mode = getattr(layer, "mode", "affine")
        y = batched_rows(
            x2,
            lambda r: mx.quantized_matmul(
                r, wq, s, b, transpose=True, group_size=layer.group_size, bits=layer.bits, mode=mode
            ),
        )
    else:
        w = layer["weight"]
        y = batched_rows(x2, lambda r: r @ w.T)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, y.shape[-1])


def call(layer, x: mx.array, as_linear: bool = False, strategy: str = "kernel") -> mx.array | None:
    """The invariant product of an mlx.nn layer (Linear, QuantizedLinear, or an Embedding /
    QuantizedEmbedding used as the tied lm_head) by `strategy`, or None where it has none."""
    if strategy == "gemv":
        if not isinstance(layer, (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding)):
            return None
        return _gemv(layer, x, as_linear)
    if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        if getattr(layer, "mode", "affine") != "affine":
            return None
        bias = None if as_linear else layer.get("bias") if "bias" in layer else None
        return affine(x, layer["weight"], layer["scales"], layer["biases"], layer.group_size, layer.bits, bias)
    if isinstance(layer, (nn.Linear, nn.Embedding)):
        bias = None if as_linear else layer.get("bias") if "bias" in layer else None
        return dense(x, layer["weight"], bias)
    return None
