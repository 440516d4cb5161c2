"""The GPU kernel bodies (kernels/gpu/*.h) and their per-language launchers.

Each kernel body is written once, over `gpu/ds_portable.h`. This module turns it into:
  * the CUDA instance: header + launcher for `mx.fast.cuda_kernel` (run on MLX's CUDA backend);
  * the Metal instance: header + launcher for `mx.fast.metal_kernel`, and the full kernel text
    MLX generates around them (`metal_kernel_text`, a copy of MLX's write_signature), which the
    Linux compile check parses. The metallib (metal/mlx_dspark.metal) includes the same headers.
A launcher only maps the language's thread indices and shared-memory declarations onto the
body's `ds_ctx` and pointers; every computation is in the body.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

GPU_DIR = Path(__file__).resolve().parent / "gpu"
BODY_FILES = ("ds_portable.h", "greedy_accept.h", "sampling_accept.h")

# Launch shapes (threads per threadgroup, elements of V per threadgroup in the greedy pass 1).
GA_THREADS = 256
GA_CHUNK = 4096
GA_MAX_W = 128  # DS_GA_MAX_W in greedy_accept.h
SA_THREADS = 1024
SA_THREADS_METAL = 512  # a Metal pipeline may allow fewer than 1024 threads; the body takes any 32k


@functools.lru_cache(maxsize=None)
def body_text() -> str:
    """The portability header and every kernel body, concatenated (JIT compilers see no files)."""
    return "".join((GPU_DIR / f).read_text() + "\n" for f in BODY_FILES)


@dataclass(frozen=True)
class Instance:
    """One kernel of one language, as `mx.fast.{metal,cuda}_kernel` takes it."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source: str
    header: str = field(default="", repr=False)


# ---------------------------------------------------------------------------------- Metal
_METAL_CTX = """  ds_ctx c;
  c.tid = thread_position_in_threadgroup.x;
  c.nthreads = threads_per_threadgroup.x;
  c.bx = threadgroup_position_in_grid.x;
  c.by = threadgroup_position_in_grid.y;
"""

METAL_GA_PARTIAL = _METAL_CTX + """  threadgroup float sv[32];
  threadgroup int si[32];
  const int V = logits_shape[2];
  const int R = logits_shape[0] * logits_shape[1];
  const int nch = (V + CH - 1) / CH;
  ds_ga_partial(c, logits, V, CH, nch, part, part + R * nch, sv, si);
"""

METAL_GA_FINALIZE = _METAL_CTX + """  threadgroup int s_tgt[DS_GA_MAX_W];
  const int w = dims[1];
  const int nch = dims[3];
  const int R = dims[0] * w;
  ds_ga_finalize(c, (int)c.bx, draft, w, nch, part, part + R * nch, target, accepted, bonus, s_tgt);
"""

METAL_SA = _METAL_CTX + """  threadgroup ds_i64 s64[36];
  threadgroup int s_i[4];
  threadgroup float sv[32];
  threadgroup int si[32];
  ds_sa_run<HAS_Q>(c, p, q, draft, u, ub, p_shape[1], p_shape[2], accepted, bonus, s64, s_i, sv, si);
"""


def metal_instances() -> dict[str, Instance]:
    h = body_text()
    return {
        "ga_partial": Instance("ds_ga_partial", ("logits",), ("part",), METAL_GA_PARTIAL, h),
        "ga_finalize": Instance("ds_ga_finalize", ("part", "draft", "dims"), ("target", "accepted", "bonus"),
                                METAL_GA_FINALIZE, h),
        "sa": Instance("ds_sa", ("p", "q", "draft", "u", "ub"), ("accepted", "bonus"), METAL_SA, h),
    }


# ----------------------------------------------------------------------------------- CUDA
_CUDA_CTX = """  ds_ctx c;
  c.tid = threadIdx.x;
  c.nthreads = blockDim.x;
  c.bx = blockIdx.x;
  c.by = blockIdx.y;
"""

# One launch: pass 1 in every block; the last block of batch element b to finish (an atomic count
# after a device fence) runs pass 2 for b. The counts live in `cnt`, the previous call's
# `cnt_next` (all zero): chaining them makes MLX order the calls (each one depends on the last),
# so no two launches share a counter and no fill launch is needed; block (0, 0) zeroes
# `cnt_next` for the next call. `part` is scratch: pidx [B*w*nch] | pval [B*w*nch].
CUDA_GA_FUSED = _CUDA_CTX + """  __shared__ float sv[32];
  __shared__ int si[32];
  __shared__ int s_tgt[DS_GA_MAX_W];
  __shared__ int s_last;
  const int B = logits_shape[0];
  const int w = logits_shape[1];
  const int V = logits_shape[2];
  const int nch = (V + CH - 1) / CH;
  const int R = B * w;
  int* count = (int*)cnt;
  if (c.bx == 0 && c.by == 0) {
    for (int i = (int)c.tid; i < cnt_shape[0]; i += (int)c.nthreads) cnt_next[i] = 0;
  }
  ds_ga_partial(c, logits, V, CH, nch, part, part + R * nch, sv, si);
  const int b = (int)c.by / w;
  if (c.tid == 0) {
    __threadfence();
    s_last = atomicAdd(count + b, 1) == w * nch - 1;
  }
  __syncthreads();
  if (s_last) {
    __threadfence();
    ds_ga_finalize(c, b, draft, w, nch, (volatile int*)part, (volatile int*)(part + R * nch), target,
                   accepted, bonus, s_tgt);
  }
"""

CUDA_GA_PARTIAL = _CUDA_CTX + """  __shared__ float sv[32];
  __shared__ int si[32];
  const int V = logits_shape[2];
  const int R = logits_shape[0] * logits_shape[1];
  const int nch = (V + CH - 1) / CH;
  ds_ga_partial(c, logits, V, CH, nch, part, part + R * nch, sv, si);
"""

CUDA_GA_FINALIZE = _CUDA_CTX + """  __shared__ int s_tgt[DS_GA_MAX_W];
  const int w = dims[1];
  const int nch = dims[3];
  const int R = dims[0] * w;
  ds_ga_finalize(c, (int)c.bx, draft, w, nch, part, part + R * nch, target, accepted, bonus, s_tgt);
"""

CUDA_SA = _CUDA_CTX + """  __shared__ ds_i64 s64[36];
  __shared__ int s_i[4];
  __shared__ float sv[32];
  __shared__ int si[32];
  ds_sa_run<HAS_Q>(c, p, q, draft, u, ub, p_shape[1], p_shape[2], accepted, bonus, s64, s_i, sv, si);
"""


def cuda_instances() -> dict[str, Instance]:
    h = body_text()
    return {
        "ga_fused": Instance("ds_ga_fused", ("logits", "draft", "cnt"),
                             ("target", "accepted", "bonus", "part", "cnt_next"), CUDA_GA_FUSED, h),
        "ga_partial": Instance("ds_ga_partial", ("logits",), ("part",), CUDA_GA_PARTIAL, h),
        "ga_finalize": Instance("ds_ga_finalize", ("part", "draft", "dims"), ("target", "accepted", "bonus"),
                                CUDA_GA_FINALIZE, h),
        "sa": Instance("ds_sa", ("p", "q", "draft", "u", "ub"), ("accepted", "bonus"), CUDA_SA, h),
    }


# ------------------------------------------------- the text MLX generates around an instance
METAL_ATTRIBUTES = (  # mlx/backend/common/metal_kernel.cpp, in MLX's order
    ("dispatch_quadgroups_per_threadgroup", "uint"), ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"), ("grid_origin", "uint3"), ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"), ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"), ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"), ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"), ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"), ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"), ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"), ("threads_per_simdgroup", "uint"), ("threads_per_threadgroup", "uint3"),
)
METAL_TYPES = {"float32": "float", "float16": "half", "bfloat16": "bfloat16_t", "int32": "int",
               "uint32": "uint", "bool": "bool", "int64": "int64_t", "uint8": "uint8_t"}
CUDA_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "int32": "int32_t",
              "uint32": "uint32_t", "bool": "bool", "int64": "int64_t", "uint8": "uint8_t"}


def _tmpl_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def metal_kernel_text(inst: Instance, inputs: list[tuple[str, int, int]], outputs: list[str],
                      template: list[tuple[str, object]] = ()) -> str:
    """The Metal source `mx.fast.metal_kernel` compiles for `inst` (minus MLX's utils prefix).

    inputs: (dtype name, ndim, size) per input; outputs: dtype name per output;
    template: (name, int | bool | dtype name). Mirrors write_signature() and the explicit
    instantiation in mlx/backend/common/metal_kernel.cpp (MLX 0.32)."""
    src = inst.source
    name = "custom_kernel_" + inst.name
    s = inst.header
    if template:
        kinds = ["bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "typename" for _, v in template]
        s += "template <" + ", ".join(f"{k} {n}" for k, (n, _) in zip(kinds, template)) + ">\n"
    s += f"[[kernel]] void {name}(\n"
    params, idx = [], 0
    for n, (dt, nd, size) in zip(inst.input_names, inputs):
        loc = "constant" if size < 8 else "device"
        params.append(f"  const {loc} {METAL_TYPES[dt]}{'&' if nd == 0 else '*'} {n} [[buffer({idx})]]")
        idx += 1
        if nd > 0:
            for suf, ty in (("_shape", "const constant int*"), ("_strides", "const constant int64_t*"),
                            ("_ndim", "const constant int&")):
                if n + suf in src:
                    params.append(f"  {ty} {n}{suf} [[buffer({idx})]]")
                    idx += 1
    for n, dt in zip(inst.output_names, outputs):
        params.append(f"  device {METAL_TYPES[dt]}* {n} [[buffer({idx})]]")
        idx += 1
    params += [f"  {ty} {a} [[{a}]]" for a, ty in METAL_ATTRIBUTES if a in src]
    s += ",\n".join(params) + ") {\n" + src + "\n}\n"
    if template:
        targs = "<" + ", ".join(_tmpl_value(v) if not isinstance(v, str) else METAL_TYPES[v]
                                for _, v in template) + ">"
        s += f'\ntemplate [[host_name("{name}")]] [[kernel]] decltype({name}{targs}) {name}{targs};\n'
    return s


def cuda_kernel_text(inst: Instance, inputs: list[tuple[str, int]], outputs: list[str],
                     template: list[tuple[str, object]] = ()) -> str:
    """The CUDA source `mx.fast.cuda_kernel` compiles for `inst` (minus MLX's default header),
    as build_kernel() in mlx/backend/cuda/custom_kernel.cpp writes it."""
    src = inst.source
    s = inst.header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    s += f"__global__ void custom_kernel_{inst.name}(\n"
    params = []
    for n, (dt, nd) in zip(inst.input_names, inputs):
        params.append(f"    const {CUDA_TYPES[dt]}* {n}")
        if nd > 0:
            for suf, ty in (("_shape", "const __grid_constant__ Shape"), ("_strides", "const __grid_constant__ Strides"),
                            ("_ndim", "const __grid_constant__ int")):
                if n + suf in src:
                    params.append(f"    {ty} {n}{suf}")
    params += [f"    {CUDA_TYPES[dt]}* {n}" for n, dt in zip(inst.output_names, outputs)]
    s += ",\n".join(params) + ") {\n"
    for n, v in template:
        if isinstance(v, bool):
            s += f"  constexpr bool {n} = {_tmpl_value(v)};\n"
        elif isinstance(v, int):
            s += f"  constexpr int {n} = {v};\n"
        else:
            s += f"  using {n} = {CUDA_TYPES[v]};\n"
    s += "\n" + src + "\n}\n\n} // namespace mlx::core::cu\n"
    return s
