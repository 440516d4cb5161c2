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
while kernels.invariant.active() is on; None means "MLX's own op" (and the self-check judges). On a
GPU a small model's decode is host-bound (kernels/invariant_linear.py says why), so what a layer's
launch needs is decided once per layer, and SwitchGLU's up and gate projections (same x, same idx)
run as one launch (`pair`, opened by compat.py around SwitchGLU).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import weakref

import mlx.core as mx

from .gpu_source import Instance, make_kernel
from .gpu_source import instance as gpu_instance
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


def _call_source(kind: str, G: int) -> str:
    second = "1" if G > 1 else "0"  # an unused second weight repeats the first (never read: N_1 = 0)
    o1 = f"o{second}"
    if kind == "dense":
        n1 = f"w{second}_shape[1]" if G > 1 else "0"
        return (
            f"  ds_ig_dense<T, {G}>(c, x, idx, w0, w{second}, o0, {o1}, P, M, w0_shape[1], {n1}, K, w0_shape[0],"
            " P / Xb);\n"
        )
    n1 = f"q{second}_shape[1]" if G > 1 else "0"
    return (
        f"  ds_ig_affine<T, BITS, {G}>(c, x, idx, q0, s0, z0, q{second}, s{second}, z{second}, o0, {o1}, P, M,"
        f" q0_shape[1], {n1}, K, q0_shape[0], P / Xb, K / s0_shape[2]);\n"
    )


def _inputs(kind: str, G: int) -> tuple:
    per = ("w",) if kind == "dense" else ("q", "s", "z")
    return ("x", "idx") + tuple(f"{n}{g}" for g in range(G) for n in per)


BODY_FILES = ("ds_portable.h", "invariant_linear.h", "invariant_gather.h")


def instance(lang: str, kind: str, group: int = 1) -> Instance:
    """The `lang` (cuda | metal) instance of the dense or affine expert kernel over `group` (1 or 2)
    weights that take the same x and idx."""
    ctx = _CUDA_CTX if lang == "cuda" else _METAL_CTX
    name = ("ds_invariant_gather" if kind == "dense" else "ds_invariant_qgather") + f"_g{group}"
    outs = tuple(f"o{g}" for g in range(group))
    return gpu_instance(name, _inputs(kind, group), outs, ctx + _SHAPES + _call_source(kind, group), BODY_FILES)


@functools.lru_cache(maxsize=None)
def _kernel(lang: str, kind: str, group: int = 1):
    return make_kernel(lang, instance(lang, kind, group))


def _launch(lang: str, kind: str, x, idx, S: tuple, weights: list, template: list, Ns: tuple) -> list:
    """One launch over len(Ns) weights (their arrays flattened in `weights`): output g [*S, M, Ns[g]]."""
    M = x.shape[-2]
    return _kernel(lang, kind, len(Ns))(
        inputs=[x, idx] + weights,
        template=template,
        grid=(-(-sum(Ns) // COLS) * THREADS, -(-idx.size * M // ROWS), 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[S + (M, n) for n in Ns],
        output_dtypes=[x.dtype] * len(Ns),
    )


def gather_gpu(x, weight, indices, lang: str = "cuda", second=None) -> mx.array | list:
    """The dense GPU instance: out [*S, M, N] (tests and benchmarks; layers go through call());
    with `second` (a weight of the same E and K), both outputs of one launch."""
    x, idx, S = operands(x, indices)
    ws = [weight] + ([second] if second is not None else [])
    outs = _launch(lang, "dense", x, idx, S, ws, [("T", x.dtype)], tuple(w.shape[1] for w in ws))
    return outs if second is not None else outs[0]


def gather_affine_gpu(x, wq, scales, biases, indices, bits: int, lang: str = "cuda", second=None):
    """The quantized GPU instance (MLX's affine layout per expert): out [*S, M, N]; with `second`
    = (wq, scales, biases) of the same E, K, bits and group, both outputs of one launch."""
    x, idx, S = operands(x, indices)
    dt = x.dtype
    qs = [(wq, scales, biases)] + ([second] if second is not None else [])
    ins = [a for q, sc, z in qs for a in (q, sc.astype(dt), z.astype(dt))]
    outs = _launch(lang, "affine", x, idx, S, ins, [("T", dt), ("BITS", bits)], tuple(q[0].shape[1] for q in qs))
    return outs if second is not None else outs[0]


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
    """Forget the cached paths and per-layer plans (after MLX_DSPARK_KERNELS changed)."""
    _paths.clear()
    _plans.clear()


class _Plan:
    """What a layer's launch needs, decided once per layer (and weight): kind, its arrays (scales and
    biases in x's dtype, cast once per dtype), N, K, E, and what a second weight must match."""

    def __init__(self, layer, kind: str):
        self.kind = kind
        self.weight = layer["weight"]
        self.E, self.N = self.weight.shape[:2]
        self.bits = layer.bits if kind == "affine" else 0
        self.group = layer.group_size if kind == "affine" else 0
        self.K = self.weight.shape[2] * 32 // self.bits if self.bits else self.weight.shape[2]
        self.dtype = self.weight.dtype if kind == "dense" else None  # affine: any float x
        self._quant = (layer["scales"], layer["biases"]) if kind == "affine" else None
        self._cast: dict = {}

    def takes(self, x: mx.array) -> bool:
        return x.shape[-1] == self.K and x.dtype in _FLOATS and (self.dtype is None or x.dtype == self.dtype)

    def arrays(self, dt) -> list:
        if self.kind == "dense":
            return [self.weight]
        got = self._cast.get(dt)
        if got is None:
            s, z = self._quant
            got = self._cast[dt] = [self.weight, s.astype(dt), z.astype(dt)]
        return got

    def template(self, dt) -> list:
        return [("T", dt)] + ([("BITS", self.bits)] if self.kind == "affine" else [])

    def pairs_with(self, other) -> bool:
        return (self.kind, self.E, self.K, self.bits, self.group, self.dtype) == (
            other.kind,
            other.E,
            other.K,
            other.bits,
            other.group,
            other.dtype,
        )


_plans: dict = {}  # id(layer) -> (weakref to the layer, its weight, plan or None)


def _plan(layer):
    hit = _plans.get(id(layer))
    if hit is None or hit[0]() is not layer or hit[1] is not layer.get("weight"):
        if hit is None or hit[0]() is not layer:
            weakref.finalize(layer, _plans.pop, id(layer), None)
        kind = _kind(layer)
        hit = _plans[id(layer)] = (
            weakref.ref(layer),
            layer.get("weight"),
            None if kind is None else _Plan(layer, kind),
        )
    return hit[2]


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


# ------------------------------------------------------------------------- the gate / up pair
_local = threading.local()


@contextlib.contextmanager
def pair(first, second):
    """Inside this block (this thread), `first` called on (x, idx) also computes `second` on the
    same arrays in the same launch, and `second` called next on those very arrays takes that output
    (compat.py opens it around mlx-lm's SwitchGLU, whose up and gate projections take one x and one
    idx). Every output column is the same arithmetic as its layer alone."""
    prev = getattr(_local, "pair", None)
    _local.pair = [first, second, None]  # the third: (x, idx, second's output) once computed
    try:
        yield
    finally:
        _local.pair = prev


def call(layer, x: mx.array, indices: mx.array) -> mx.array | None:
    """The invariant product of an mlx-lm SwitchLinear / QuantizedSwitchLinear (without its bias),
    or None where this op does not take it (MLX's own gather op runs)."""
    path = gather_path()
    if path == "mlx" or x.ndim < 2 or x.size == 0 or indices.size == 0:
        return None
    plan = _plan(layer)
    if plan is None or not plan.takes(x):
        return None
    if path == "rowwise":
        return _rowwise(layer, x, indices)
    hint = getattr(_local, "pair", None)
    if hint is not None and layer is hint[1] and hint[2] is not None:
        hx, hidx, y = hint[2]
        hint[2] = None
        if hx is x and hidx is indices:
            return y
    xo, idx, S = operands(x, indices)
    if -(-idx.size * xo.shape[-2] // ROWS) > MAX_GRID_Y:
        return None
    dt = x.dtype
    if hint is not None and layer is hint[0]:
        other = _plan(hint[1])
        if other is not None and other.takes(x) and plan.pairs_with(other):
            y, y2 = _launch(
                path, plan.kind, xo, idx, S, plan.arrays(dt) + other.arrays(dt), plan.template(dt), (plan.N, other.N)
            )
            hint[2] = (x, indices, y2)
            return y
    return _launch(path, plan.kind, xo, idx, S, plan.arrays(dt), plan.template(dt), (plan.N,))[0]


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
