"""The GPU kernel bodies (kernels/gpu/*.h) and their per-language launchers.

Each kernel body is written once, over `gpu/ds_portable.h`. This module turns it into:
  * the CUDA instance: header + launcher for `mx.fast.cuda_kernel` (run on MLX's CUDA backend);
  * the Metal instance: header + launcher for `mx.fast.metal_kernel`. The full kernel text MLX
    generates around an instance is rebuilt on the test side (tests/kernel_text.py) for the
    Linux compile check. The metallib (metal/mlx_dspark.metal) includes the same headers.
A launcher only maps the language's thread indices and shared-memory declarations onto the
body's `ds_ctx` and pointers; every computation is in the body.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

GPU_DIR = Path(__file__).resolve().parent / "gpu"
BODY_FILES = ("ds_portable.h", "greedy_accept.h", "sampling_accept.h")

# Launch shapes (threads per threadgroup, elements of V per threadgroup in the greedy pass 1).
GA_THREADS = 256
GA_CHUNK = 4096
SA_THREADS = 1024
SA_THREADS_METAL = 512  # a Metal pipeline may allow fewer than 1024 threads; the body takes any 32k


@functools.lru_cache(maxsize=None)
def body_text() -> str:
    """The portability header and the accept bodies, concatenated (JIT compilers see no files)."""
    return body(*BODY_FILES)


@functools.lru_cache(maxsize=None)
def body(*files: str) -> str:
    """The kernel bodies in `files` (names in GPU_DIR), concatenated, as `compact` text."""
    return compact("".join((GPU_DIR / f).read_text() + "\n" for f in files))


def compact(text: str) -> str:
    """Kernel text without comments and blank lines. MLX copies an instance's header into the
    kernel text of every launch (host time on the decode path, once per linear layer); the
    compiler never needs the comments. The bodies have no string literals, so // starts a comment."""
    import re

    text = re.sub(r"[ \t]*//[^\n]*", "", text)
    return "\n".join(ln for ln in text.splitlines() if ln.strip()) + "\n"


@dataclass(frozen=True)
class Instance:
    """One kernel of one language, as `mx.fast.{metal,cuda}_kernel` takes it. `files`: the body
    files (in GPU_DIR) that `header` is the text of, so that make_kernel can include them instead."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source: str
    header: str = field(default="", repr=False)
    files: tuple[str, ...] = ()


def instance(name: str, inputs, outputs, source: str, files: tuple[str, ...]) -> Instance:
    """An Instance whose header is the body text of `files`."""
    return Instance(name, tuple(inputs), tuple(outputs), source, body(*files), tuple(files))


# --------------------------------------------------------------------- making the kernels
# MLX's cuda_kernel writes the header into the kernel text of every launch and hashes that text
# again when it evaluates the launch (to find the compiled module): with a body of 12-19 kB, that
# is most of the 5-8 us of host time a launch costs on top of MLX's own ops (H200 profile,
# bench/results/invariance-h200.md), and a small model's decode pays it ~150 times a step. NVRTC
# reads #include files from disk, so on CUDA the header is the files' #include lines (plus their
# digest, so a changed body is a new module): the same program, a few hundred bytes per launch.


def _include_line(path: Path) -> str | None:
    p = str(path)
    if not p.isascii() or any(ch in p for ch in '"\\\n'):  # not sayable in an #include "..."
        return None
    return f'#include "{p}"\n'


@functools.lru_cache(maxsize=None)
def cuda_include_header(files: tuple[str, ...]) -> str | None:
    """The #include form of `files`' header, or None where it cannot be written or does not work
    here (MLX_DSPARK_CUDA_INCLUDE=0 turns it off)."""
    if not files or os.environ.get("MLX_DSPARK_CUDA_INCLUDE", "1").strip() == "0" or not _includes_work():
        return None
    lines = [_include_line(GPU_DIR / f) for f in files]
    if None in lines:
        return None
    digest = hashlib.sha1("".join((GPU_DIR / f).read_text() for f in files).encode()).hexdigest()[:16]
    return f"// mlx-dspark bodies {digest}\n" + "".join(lines)


@functools.lru_cache(maxsize=None)
def _includes_work() -> bool:
    """Whether NVRTC, through mx.fast.cuda_kernel, compiles and runs a kernel whose header is an
    #include of ds_portable.h: tried once per machine, MLX version and install place (the probe is
    an NVRTC compile, ~2 s a process on the H200), then read from the cache root."""
    import mlx.core as mx

    from ..machine import device_name
    from ..paths import read_fact, write_fact

    line = _include_line(GPU_DIR / "ds_portable.h")
    if line is None:
        return False
    key = {"mlx": mx.__version__, "device": device_name(), "include": line}
    known = read_fact("kernels", key)
    if isinstance(known, bool):
        return known
    works = _try_include(line)
    write_fact("kernels", key, works)
    return works


def _try_include(line: str) -> bool:
    import mlx.core as mx

    try:
        probe = mx.fast.cuda_kernel(
            name="ds_include_probe",
            input_names=["x"],
            output_names=["y"],
            source="  y[0] = ds_fma(ds_to_float(x[0]), 2.0f, 1.0f);\n",
            header=line,
        )
        (y,) = probe(
            inputs=[mx.array([3.0], dtype=mx.float32)],
            grid=(1, 1, 1),
            threadgroup=(1, 1, 1),
            output_shapes=[(1,)],
            output_dtypes=[mx.float32],
        )
        return float(y.item()) == 7.0
    except Exception:  # an NVRTC that does not read files: the inline text works everywhere
        return False


def host_zeros(shape: tuple, dtype):
    """Zeros made on the host, not by a lazy op: a placeholder input cached across calls may be
    used by another thread than the one that made it (serve's engine thread), and MLX keeps a
    stream per thread, so a lazy array from one thread cannot be evaluated in another."""
    import mlx.core as mx
    import numpy as np

    return mx.array(np.zeros(shape, dtype=np.float32).tolist(), dtype=dtype)


def make_kernel(lang: str, inst: Instance, ensure_row_contiguous: bool = True):
    """The `mx.fast.cuda_kernel` (lang "cuda") or `mx.fast.metal_kernel` of `inst`; on CUDA the
    body files are #included where that works (see above), else their text is inlined."""
    import mlx.core as mx

    header = inst.header
    if lang == "cuda":
        make = mx.fast.cuda_kernel
        header = cuda_include_header(inst.files) or header
    else:
        make = mx.fast.metal_kernel
    return make(
        name=inst.name,
        input_names=list(inst.input_names),
        output_names=list(inst.output_names),
        source=inst.source,
        header=header,
        ensure_row_contiguous=ensure_row_contiguous,
    )


# ---------------------------------------------------------------------------------- Metal
_METAL_CTX = """  ds_ctx c;
  c.tid = thread_position_in_threadgroup.x;
  c.nthreads = threads_per_threadgroup.x;
  c.bx = threadgroup_position_in_grid.x;
  c.by = threadgroup_position_in_grid.y;
"""

METAL_GA_PARTIAL = (
    _METAL_CTX
    + """  threadgroup float sv[32];
  threadgroup int si[32];
  const int V = logits_shape[2];
  const int R = logits_shape[0] * logits_shape[1];
  const int nch = (V + CH - 1) / CH;
  ds_ga_partial(c, logits, V, CH, nch, part, part + R * nch, sv, si);
"""
)

METAL_GA_FINALIZE = (
    _METAL_CTX
    + """  threadgroup int s_tgt[DS_GA_MAX_W];
  const int w = dims[1];
  const int nch = dims[3];
  const int R = dims[0] * w;
  ds_ga_finalize(c, (int)c.bx, draft, w, nch, part, part + R * nch, target, accepted, bonus, s_tgt);
"""
)

METAL_SA = (
    _METAL_CTX
    + """  threadgroup ds_i64 s64[36];
  threadgroup int s_i[4];
  threadgroup float sv[32];
  threadgroup int si[32];
  ds_sa_run<HAS_Q>(c, p, q, draft, u, ub, p_shape[1], p_shape[2], accepted, bonus, s64, s_i, sv, si);
"""
)


def metal_instances() -> dict[str, Instance]:
    f = BODY_FILES
    return {
        "ga_partial": instance("ds_ga_partial", ("logits",), ("part",), METAL_GA_PARTIAL, f),
        "ga_finalize": instance(
            "ds_ga_finalize", ("part", "draft", "dims"), ("target", "accepted", "bonus"), METAL_GA_FINALIZE, f
        ),
        "sa": instance("ds_sa", ("p", "q", "draft", "u", "ub"), ("accepted", "bonus"), METAL_SA, f),
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
CUDA_GA_FUSED = (
    _CUDA_CTX
    + """  __shared__ float sv[32];
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
)

CUDA_GA_PARTIAL = (
    _CUDA_CTX
    + """  __shared__ float sv[32];
  __shared__ int si[32];
  const int V = logits_shape[2];
  const int R = logits_shape[0] * logits_shape[1];
  const int nch = (V + CH - 1) / CH;
  ds_ga_partial(c, logits, V, CH, nch, part, part + R * nch, sv, si);
"""
)

CUDA_GA_FINALIZE = (
    _CUDA_CTX
    + """  __shared__ int s_tgt[DS_GA_MAX_W];
  const int w = dims[1];
  const int nch = dims[3];
  const int R = dims[0] * w;
  ds_ga_finalize(c, (int)c.bx, draft, w, nch, part, part + R * nch, target, accepted, bonus, s_tgt);
"""
)

CUDA_SA = (
    _CUDA_CTX
    + """  __shared__ ds_i64 s64[36];
  __shared__ int s_i[4];
  __shared__ float sv[32];
  __shared__ int si[32];
  ds_sa_run<HAS_Q>(c, p, q, draft, u, ub, p_shape[1], p_shape[2], accepted, bonus, s64, s_i, sv, si);
"""
)


def cuda_instances() -> dict[str, Instance]:
    f = BODY_FILES
    return {
        "ga_fused": instance(
            "ds_ga_fused",
            ("logits", "draft", "cnt"),
            ("target", "accepted", "bonus", "part", "cnt_next"),
            CUDA_GA_FUSED,
            f,
        ),
        "ga_partial": instance("ds_ga_partial", ("logits",), ("part",), CUDA_GA_PARTIAL, f),
        "ga_finalize": instance(
            "ds_ga_finalize", ("part", "draft", "dims"), ("target", "accepted", "bonus"), CUDA_GA_FINALIZE, f
        ),
        "sa": instance("ds_sa", ("p", "q", "draft", "u", "ub"), ("accepted", "bonus"), CUDA_SA, f),
    }
