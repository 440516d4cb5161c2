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
this layer here" (MLX's own op runs, and the self-check judges the forward). On a GPU a small
model's decode is host-bound (each launch costs several times MLX's own product to build:
bench/profile_invariant_host.py), so sibling layers that take the same input (q/k/v, gate/up:
`group_siblings`) run as one launch over up to 3 weights.

GPU bodies (`MLX_DSPARK_IL_KERNEL`, read when a layer's plan is made: reset() after changing it):
  v1 (default)   kernels/gpu/invariant_linear.h: one warp per output column, rows in blocks of 4
  v2c1/v2c2/v2c4 kernels/gpu/invariant_linear_v2.h: v1's arithmetic bit for bit (so the outputs
                 are v1's), 16-byte loads, C = 1 / 2 / 4 columns per warp sharing each x load, rows
                 in passes of 8 / 4 / 1
  v2             v2 with C by the launch's columns (`v2_cols`): the largest C of 4, 2 that still
                 leaves V2_MIN_WARPS warps (about 4 per SM on an H200's 132), else 1
"""

from __future__ import annotations

import functools
import os
import weakref

import mlx.core as mx
import mlx.nn as nn

from . import native as _native
from .gpu_source import Instance, host_zeros, make_kernel
from .gpu_source import instance as gpu_instance

THREADS = 128  # DS_IL_THREADS
VEC = 8  # DS_IL_VEC: K must be a multiple of it
COLS = THREADS // 32  # output columns per threadgroup
BITS = (2, 4, 8)
GROUPS = (32, 64, 128)
_FLOATS = (mx.float32, mx.float16, mx.bfloat16)
KERNELS = ("v1", "v2", "v2c1", "v2c2", "v2c4")  # MLX_DSPARK_IL_KERNEL
V2_MIN_WARPS = 512
# Metal passes a buffer of fewer than 8 elements in the `constant` address space and the bodies
# take one pointer type per role: placeholders have 8 elements, and Metal groups no layer whose
# arrays are smaller (_metal_groupable).
MIN_DEVICE_ELEMS = 8


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


def _names(G: int, fmt: str) -> tuple[str, ...]:
    return tuple(fmt.format(g) for g in range(G))


def _inputs(kind: str, G: int) -> tuple[str, ...]:
    if kind == "dense":
        return ("x",) + _names(G, "w{}") + _names(G, "b{}")
    return ("x",) + tuple(n for g in range(G) for n in (f"q{g}", f"s{g}", f"z{g}")) + _names(G, "b{}")


def _call_source(kind: str, G: int, v2: bool = False) -> str:
    def pick(fmt, g):  # weight g, or weight 0 again where the body takes fewer than 3
        return fmt.format(g if g < G else 0)

    n = ", ".join(f"{pick('w{}', g)}_shape[0]" if g < G else "0" for g in range(1, 3))
    b = ", ".join(pick("b{}", g) for g in range(3))
    o = ", ".join(pick("o{}", g) for g in range(3))
    # x [..., K] as it comes (no reshape ops on the decode path): M = the product of the rest
    rows = (
        "  int M = 1;\n"
        "  for (int i = 0; i + 1 < (int)x_ndim; ++i) M *= x_shape[i];\n"
        "  const int K = x_shape[x_ndim - 1];\n"
    )
    if kind == "dense":
        w = ", ".join(pick("w{}", g) for g in range(3))
        fn = "ds_il2_dense<T, C" if v2 else "ds_il_dense<T"
        return rows + f"  {fn}, {G}, HB>(c, x, {w}, {b}, {o}, M, w0_shape[0], {n}, K);\n"
    q = ", ".join(f"{pick('q{}', g)}, {pick('s{}', g)}, {pick('z{}', g)}" for g in range(3))
    n = ", ".join(f"{pick('q{}', g)}_shape[0]" if g < G else "0" for g in range(1, 3))
    fn = "ds_il2_affine<T, BITS, C" if v2 else "ds_il_affine<T, BITS"
    return rows + f"  {fn}, {G}, HB>(c, x, {q}, {b}, {o}, M, q0_shape[0], {n}, K, K / s0_shape[1]);\n"


def _files(v2: bool = False) -> tuple[str, ...]:
    return ("ds_portable.h", "invariant_linear_v2.h" if v2 else "invariant_linear.h")


def instance(lang: str, kind: str, group: int = 1, v2: bool = False) -> Instance:
    """The `lang` (cuda | metal) instance of the dense or affine kernel over `group` weights; `v2`:
    the v2 body (template C: columns per warp, besides v1's T, BITS, HB)."""
    ctx = _CUDA_CTX if lang == "cuda" else _METAL_CTX
    name = ("ds_invariant_linear" if kind == "dense" else "ds_invariant_qlinear") + ("2" if v2 else "") + f"_g{group}"
    src = ctx + _call_source(kind, group, v2)
    return gpu_instance(name, _inputs(kind, group), _names(group, "o{}"), src, _files(v2))


@functools.lru_cache(maxsize=None)
def _kernel(lang: str, kind: str, group: int = 1):
    return make_kernel(lang, instance(lang, kind, group))


@functools.lru_cache(maxsize=None)
def _kernel_v2(lang: str, kind: str, group: int = 1):
    """The v2 kernel (one per kind and group; C is a template argument of each launch)."""
    return make_kernel(lang, instance(lang, kind, group, v2=True))


_placeholders: dict = {}


def _no_bias(dtype) -> mx.array:
    z = _placeholders.get(dtype)
    if z is None:  # never read (HB says so), but a device buffer on Metal like the real biases
        z = _placeholders[dtype] = host_zeros((MIN_DEVICE_ELEMS,), dtype)
    return z


def kernel_choice() -> str:
    """MLX_DSPARK_IL_KERNEL (KERNELS; default v1): the GPU body new plans launch."""
    k = os.environ.get("MLX_DSPARK_IL_KERNEL", "").strip().lower() or "v1"
    if k not in KERNELS:
        import warnings

        warnings.warn(f"MLX_DSPARK_IL_KERNEL={k!r} is not one of {', '.join(KERNELS)}: using v1", stacklevel=2)
        return "v1"
    return k


def v2_cols(Ns, kernel: str = "v2") -> int:
    """C, the columns per warp of a v2 launch over output widths Ns: v2cC's C, or for "v2" the
    largest of 4, 2 that leaves at least V2_MIN_WARPS warps (small launches keep their warps), else 1."""
    if kernel.startswith("v2c"):
        return int(kernel[3:])
    for C in (4, 2):
        if sum(-(-n // C) for n in Ns) >= V2_MIN_WARPS:
            return C
    return 1


def grid(Ns, C: int = 1) -> tuple:
    """The launch grid over output widths Ns: ceil(N_g / C) warps per weight (v1: C = 1, one warp
    per column), THREADS per threadgroup."""
    warps = sum(-(-n // C) for n in Ns)
    return (-(-warps // (THREADS // 32)) * THREADS, 1, 1)


def _launch(kern, inputs, template, lead: tuple, Ns: tuple, dtypes: list, grid_=None) -> list:
    """One launch; x = inputs[0] is [*lead, K] as it comes, output g is [*lead, Ns[g]]; grid_:
    a v2 plan's grid (v1's is computed here)."""
    return kern(
        inputs=inputs,
        template=template,
        grid=grid_ or (-(-sum(Ns) // COLS) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[lead + (n,) for n in Ns],
        output_dtypes=dtypes,
    )


# Tests and benchmarks (layers go through call()); kernel: a name of KERNELS, None for the env's.
def dense_gpu(x2, weight, bias=None, lang: str = "cuda", kernel: str | None = None) -> mx.array:
    """The GPU instance on x2 [M, K]."""
    return _dense_gpu_plan([weight], [bias], lang, kernel)(x2)[0]


def affine_gpu(x2, wq, scales, biases, bits: int, bias=None, lang: str = "cuda", kernel: str | None = None):
    """The quantized GPU instance on x2 [M, K]."""
    return _affine_gpu_plan([(wq, scales, biases)], bits, [bias], lang, kernel)(x2)[0]


def dense_gpu_group(x2, weights, biases, lang: str = "cuda", kernel: str | None = None) -> list:
    """Several dense weights over one input in one launch."""
    return _dense_gpu_plan(list(weights), list(biases), lang, kernel)(x2)


def affine_gpu_group(x2, quants, bits: int, biases, lang: str = "cuda", kernel: str | None = None) -> list:
    """Several affine weights (wq, scales, biases) over one input in one launch."""
    return _affine_gpu_plan(list(quants), bits, list(biases), lang, kernel)(x2)


def layer_plan(layer, kernel: str | None = None, as_linear: bool = False):
    """x -> the layer's product on the GPU path with `kernel` (one launch, no sibling grouping), or
    None where it has none (benchmarks: each kernel's plan built once, timed side by side). A list
    of layers: their one launch (as a sibling group), x -> the list of their outputs."""
    if isinstance(layer, (list, tuple)):
        return _gpu_plan(list(layer), as_linear, linear_path(), kernel)
    got = _gpu_plan([layer], as_linear, linear_path(), kernel)
    return None if got is None else _first(got)


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
    return _first(_affine_gpu_plan([(wq, scales, biases)], bits, [bias], path))(x)


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
    path = linear_path()
    if not as_linear and path in ("cuda", "metal"):
        sib = _sibling_of.get(id(layer))
        if sib is not None and sib[0]() is layer:
            if sib[1].valid():
                return sib[1].member(sib[2])
            _sibling_of.pop(id(layer), None)  # a sibling went or took another weight: alone from now
    got = _gpu_plan([layer], as_linear, path)
    if got is not None or path in ("cuda", "metal"):
        return None if got is None else _first(got)
    if isinstance(layer, (nn.Linear, nn.Embedding)):
        bias = None if as_linear or "bias" not in layer else layer["bias"]
        return _dense_plan(layer["weight"], bias, path)
    return None  # quantized on the CPU: MLX's own op


def _first(group_plan):
    def plan(x):
        outs = group_plan(x)
        return None if outs is None else outs[0]

    return plan


def _gpu_plan(layers: list, as_linear: bool, path: str, kernel: str | None = None):
    """One launch over these layers' weights (one input, len(layers) outputs), or None where the
    layers are not all of one kind this path takes (different kinds, bits, groups, dtypes, K)."""
    if path not in ("cuda", "metal") or not layers:
        return None
    biases = [None if as_linear or "bias" not in lay else lay["bias"] for lay in layers]
    if path == "metal" and len(layers) > 1 and not _metal_groupable(layers, biases):
        return None
    first = layers[0]
    if isinstance(first, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        ok = all(
            type(lay) is type(first)
            and getattr(lay, "mode", "affine") == "affine"
            and lay.bits == first.bits
            and lay.group_size == first.group_size
            and lay["weight"].ndim == 2
            and lay["weight"].shape[1] == first["weight"].shape[1]
            for lay in layers
        )
        if not ok or first.bits not in BITS or first.group_size not in GROUPS:
            return None
        quants = [(lay["weight"], lay["scales"], lay["biases"]) for lay in layers]
        return _affine_gpu_plan(quants, first.bits, biases, path, kernel)
    if isinstance(first, (nn.Linear, nn.Embedding)):
        w0 = first["weight"]
        ok = all(
            type(lay) is type(first)
            and lay["weight"].ndim == 2
            and lay["weight"].dtype == w0.dtype
            and lay["weight"].shape[1] == w0.shape[1]
            for lay in layers
        )
        if not ok or w0.ndim != 2 or w0.dtype not in _FLOATS or w0.shape[1] % VEC:
            return None
        return _dense_gpu_plan([lay["weight"] for lay in layers], biases, path, kernel)
    return None


def _metal_groupable(layers: list, biases: list) -> bool:
    """Every array a Metal group launch passes is a device buffer (>= MIN_DEVICE_ELEMS elements):
    the body takes the G weights' pointers of one role as one type, and a `constant` one among
    `device` ones does not compile."""
    arrays = [b for b in biases if b is not None]
    arrays += [lay[k] for lay in layers for k in ("weight", "scales", "biases") if k in lay]
    return all(a.size >= MIN_DEVICE_ELEMS for a in arrays)


# ------------------------------------------------------------------------- sibling layers
# Layers of one parent that a forward calls on the same input, in this order: mlx-lm's attention
# (q/k/v) and gated MLPs (gate/up) under the names its model families use.
SIBLINGS = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("wq", "wk", "wv"),
    ("w1", "w3"),
)
_sibling_of: dict = {}  # id(layer) -> (weakref to the layer, its _Siblings, index in it)


class _Siblings:
    """G <= 3 layers that take the same input: the first one called computes all of them in one
    launch (each output column the same arithmetic as the layer alone: the body is per column),
    the others take their output when they are called with that same input array."""

    def __init__(self, layers: list, path: str):
        self.refs = [weakref.ref(lay) for lay in layers]
        self.weights = [lay.get("weight") for lay in layers]
        self.plan = _gpu_plan(layers, False, path)
        self.x = None
        self.outs: list = []

    def valid(self) -> bool:
        layers = [r() for r in self.refs]
        return all(lay is not None and lay.get("weight") is w for lay, w in zip(layers, self.weights))

    def member(self, i: int):
        """Layer i's plan (call() re-plans a layer whose weight changed; valid() then fails)."""

        def plan(x):
            if self.x is x and self.outs[i] is not None:
                y, self.outs[i] = self.outs[i], None
                if not any(o is not None for o in self.outs):
                    self.x = None
                return y
            outs = self.plan(x)
            if outs is None:
                return None
            self.x, self.outs = x, list(outs)
            y, self.outs[i] = self.outs[i], None
            return y

        return plan


def group_siblings(model) -> int:
    """Find the sibling layers (SIBLINGS) of `model` that one GPU launch can compute together and
    route them so (call()); returns the number of groups. Without a GPU path: nothing to do."""
    path = linear_path()
    if path not in ("cuda", "metal"):
        return 0
    n = 0
    for _, module in model.named_modules():
        for names in SIBLINGS:
            layers = [module.get(name) for name in names]
            if any(lay is None for lay in layers) or not isinstance(layers[0], (nn.Linear, nn.QuantizedLinear)):
                continue
            known = [_sibling_of.get(id(lay)) for lay in layers]
            if all(k is not None and k[0]() is lay and k[1] is known[0][1] for k, lay in zip(known, layers)):
                if known[0][1].valid():  # grouped already (a path switched back): keep it and its plans
                    n += 1
                    continue
            if _gpu_plan(layers, False, path) is None:
                continue
            group = _Siblings(layers, path)
            for i, lay in enumerate(layers):
                key = id(lay)
                if key not in _sibling_of:
                    weakref.finalize(lay, _sibling_of.pop, key, None)
                _sibling_of[key] = (weakref.ref(lay), group, i)
                _plans.pop((key, False), None)
            n += 1
    return n


def reset() -> None:
    """Forget the cached paths, per-layer plans and sibling groups (after MLX_DSPARK_KERNELS or
    the extension changed)."""
    _paths.clear()
    _plans.clear()
    _sibling_of.clear()


def _dense_plan(weight: mx.array, bias, path: str):
    if weight.ndim != 2 or weight.dtype not in _FLOATS or weight.shape[1] % VEC:
        return lambda x: None
    if path in ("cuda", "metal"):
        return _first(_dense_gpu_plan([weight], [bias], path))
    N, K = weight.shape
    dt = weight.dtype
    if path == "native":
        fn = _native.ext(warn=False).invariant_linear

        def plan(x):  # the op takes [..., M, K] as it comes: no reshape nodes around it
            if x.dtype != dt or x.shape[-1] != K or x.size == 0:
                return None
            return fn(x, weight, bias) if x.ndim > 1 else fn(x[None], weight, bias)[0]

        return plan
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


def _gpu_kernel(lang: str, kind: str, G: int, Ns: tuple, kernel: str | None):
    """(kernel, its C template entries, grid) for a launch over output widths Ns; kernel: a name
    of KERNELS, None for MLX_DSPARK_IL_KERNEL's."""
    kernel = kernel or kernel_choice()
    if kernel == "v1":
        return _kernel(lang, kind, G), [], None
    C = v2_cols(Ns, kernel)
    return _kernel_v2(lang, kind, G), [("C", C)], grid(Ns, C)


def _dense_gpu_plan(weights: list, biases: list, lang: str, kernel: str | None = None):
    G = len(weights)
    K = weights[0].shape[1]
    dt = weights[0].dtype
    Ns = tuple(w.shape[0] for w in weights)
    kern, cols, grid_ = _gpu_kernel(lang, "dense", G, Ns, kernel)
    fixed = list(weights) + [b.astype(dt) if b is not None else _no_bias(dt) for b in biases]
    template = [("T", dt)] + cols + [("HB", sum(1 << g for g, b in enumerate(biases) if b is not None))]
    dtypes = [dt] * G

    def plan(x):
        if x.dtype != dt or x.shape[-1] != K or x.size == 0:
            return None
        if grid_ is None:  # v1 (bench/profile_invariant_host.py stands in for _launch's six arguments)
            return _launch(kern, [x] + fixed, template, x.shape[:-1], Ns, dtypes)
        return _launch(kern, [x] + fixed, template, x.shape[:-1], Ns, dtypes, grid_)

    return plan


def _affine_gpu_plan(quants: list, bits: int, biases: list, lang: str, kernel: str | None = None):
    G = len(quants)
    K = quants[0][0].shape[1] * 32 // bits
    Ns = tuple(q[0].shape[0] for q in quants)
    kern, cols, grid_ = _gpu_kernel(lang, "affine", G, Ns, kernel)
    hb = sum(1 << g for g, b in enumerate(biases) if b is not None)
    fixed: dict = {}  # x dtype -> (the inputs after x, the template)

    def plan(x):
        dt = x.dtype
        if dt not in _FLOATS or x.shape[-1] != K or x.size == 0 or K % VEC:
            return None
        got = fixed.get(dt)
        if got is None:
            ins = [a for wq, s, z in quants for a in (wq, s.astype(dt), z.astype(dt))]
            ins += [b.astype(dt) if b is not None else _no_bias(dt) for b in biases]
            got = fixed[dt] = (ins, [("T", dt), ("BITS", bits)] + cols + [("HB", hb)], [dt] * G)
        if grid_ is None:
            return _launch(kern, [x] + got[0], got[1], x.shape[:-1], Ns, got[2])
        return _launch(kern, [x] + got[0], got[1], x.shape[:-1], Ns, got[2], grid_)

    return plan
