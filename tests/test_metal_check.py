"""Compile checks of the GPU kernel instances on Linux, with libclang (`pip install libclang`).

The Metal instances (the full text mx.fast.metal_kernel generates around each launcher, and the
metallib source metal/mlx_dspark.metal) are parsed as C++17 under a stub of the Metal standard
library in which the address spaces are real clang address spaces, so a `constant` buffer passed
where a `device` pointer is expected fails too. The CUDA instances are parsed the same way under
a CUDA stub, so a typo in the CUDA branch fails here rather than on the GPU machine. This is not
a Metal compiler: builtins are declarations, and Metal-only rules (threadgroup variables at
kernel scope) are not checked. Deliberately broken bodies show the check can fail.
"""

from __future__ import annotations

import re
from pathlib import Path

import kernel_text as kt
import pytest

from mlx_dspark.kernels import gpu_source as gs

try:
    import clang.cindex as ci
except ImportError as e:  # the check must not pass silently: CI installs the `test` extra
    raise ImportError("tests/test_metal_check.py needs libclang: pip install libclang") from e

ROOT = Path(__file__).resolve().parents[1]

METAL_STUB = r"""
// Metal standard library stand-in: types, address spaces and builtins as declarations.
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#define thread
#define METAL_FUNC inline
typedef unsigned int uint; typedef unsigned short ushort; typedef unsigned char uchar;
typedef unsigned long ulong; typedef _Float16 half; typedef __bf16 bfloat16_t; typedef __bf16 bfloat;
typedef long int64_t; typedef unsigned long uint64_t; typedef int int32_t; typedef unsigned uint32_t;
typedef unsigned long size_t; typedef unsigned char uint8_t;
#define DS_VEC(T, N) typedef T T##N __attribute__((ext_vector_type(N)));
#define DS_VECS(T) DS_VEC(T, 2) DS_VEC(T, 3) DS_VEC(T, 4)
DS_VECS(float) DS_VECS(half) DS_VECS(int) DS_VECS(uint) DS_VECS(short) DS_VECS(ushort) DS_VECS(bool)
typedef float packed_float4 __attribute__((ext_vector_type(4)));
typedef half packed_half4 __attribute__((ext_vector_type(4)));
typedef ushort packed_ushort4 __attribute__((ext_vector_type(4)));
namespace metal {
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
void threadgroup_barrier(mem_flags);
void simdgroup_barrier(mem_flags);
template <class T> T simd_shuffle(T, ushort);
template <class T> T simd_shuffle_xor(T, ushort);
template <class T> T simd_shuffle_down(T, ushort);
template <class T> T simd_shuffle_up(T, ushort);
template <class T> T simd_broadcast(T, ushort);
template <class T> T simd_sum(T);
template <class T> T simd_max(T);
template <class T> T simd_min(T);
template <class T, class U> T as_type(U);
template <class T> bool isnan(T);
template <class T> T min(T, T);
template <class T> T max(T, T);
template <class T> T floor(T);
template <class T> T exp(T);
float fma(float, float, float);
}
using namespace metal;
"""

CUDA_STUB = r"""
// CUDA stand-in (what NVRTC and MLX's default header provide), declarations only.
#define __CUDACC__ 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __grid_constant__
typedef int int32_t; typedef unsigned uint32_t; typedef long long int64_t; typedef unsigned char uint8_t;
struct dim3 { unsigned x, y, z; };
extern const dim3 threadIdx, blockIdx, blockDim, gridDim;
void __syncthreads();
void __threadfence();
int atomicAdd(int*, int);
unsigned __shfl_sync(unsigned, unsigned, int, int = 32);
unsigned __shfl_xor_sync(unsigned, unsigned, int, int = 32);
unsigned __shfl_up_sync(unsigned, unsigned, unsigned, int = 32);
unsigned __shfl_down_sync(unsigned, unsigned, unsigned, int = 32);
unsigned __float_as_uint(float);
float __uint_as_float(unsigned);
struct __half { unsigned short x; };
struct __nv_bfloat16 { unsigned short x; };
float __half2float(__half);
float __bfloat162float(__nv_bfloat16);
__half __float2half(float);
__nv_bfloat16 __float2bfloat16(float);
float __fmaf_rn(float, float, float);
struct float4 { float x, y, z, w; };
struct uint4 { unsigned x, y, z, w; };
__half __ushort_as_half(unsigned short);
namespace cooperative_groups {}
namespace mlx { namespace core { namespace cu {
template <class T, int N> struct small_array { T v[N]; T operator[](int i) const; };
using Shape = small_array<int32_t, 8>;
using Strides = small_array<int64_t, 8>;
}}}
"""

IGNORED = ("automatic variable qualified with an address space",)  # Metal threadgroup locals


def parse(src: str, stub: str, label: str, extra_args=()) -> list[str]:
    """Errors (and warnings) clang reports for `src` with `stub` force-included."""
    src = re.sub(r"template \[\[host_name\([^)]*\)\]\] \[\[kernel\]\]", "template", src)
    main, stub_path = f"/ds_check/{label}.cpp", "/ds_check/stub.h"
    tu = ci.Index.create().parse(
        main,
        args=[
            "-x",
            "c++",
            "-std=c++17",
            "-fsyntax-only",
            "-nostdinc",
            "-nostdinc++",
            "-include",
            stub_path,
            "-Wno-unknown-attributes",
            "-Wno-ignored-attributes",
            "-Wno-pragma-once-outside-header",
            *extra_args,
        ],
        unsaved_files=[(main, src), (stub_path, stub)],
    )
    return [
        f"{label}:{d.location.line}:{d.location.column}: {d.spelling}"
        for d in tu.diagnostics
        if d.severity >= ci.Diagnostic.Warning and not any(s in d.spelling for s in IGNORED)
    ]


# inputs as (dtype, ndim, size): sizes below 8 go to Metal's constant address space
def metal_cases():
    inst = gs.metal_instances()
    for dt in ("float32", "float16", "bfloat16"):
        yield (
            f"ga_partial_{dt}",
            kt.metal_kernel_text(inst["ga_partial"], [(dt, 3, 5 * 151936)], ["int32"], [("CH", gs.GA_CHUNK)]),
        )
    for size in (4, 64):
        yield (
            f"ga_finalize_{size}",
            kt.metal_kernel_text(
                inst["ga_finalize"], [("int32", 1, 999), ("int32", 2, size), ("int32", 1, 4)], ["int32"] * 3
            ),
        )
        for has_q in (True, False):
            yield (
                f"sa_{size}_{has_q}",
                kt.metal_kernel_text(
                    inst["sa"],
                    [
                        ("float32", 3, 999),
                        ("float32", 3 if has_q else 1, 999 if has_q else 1),
                        ("int32", 2, size),
                        ("float32", 2, size),
                        ("float32", 1, size // 4),
                    ],
                    ["int32", "int32"],
                    [("HAS_Q", has_q)],
                ),
            )


def cuda_cases():
    inst = gs.cuda_instances()
    for dt in ("float32", "float16", "bfloat16"):
        yield (
            f"cuda_ga_fused_{dt}",
            kt.cuda_kernel_text(
                inst["ga_fused"], [(dt, 3), ("int32", 2), ("int32", 1)], ["int32"] * 5, [("CH", gs.GA_CHUNK)]
            ),
        )
        yield (
            f"cuda_ga_partial_{dt}",
            kt.cuda_kernel_text(inst["ga_partial"], [(dt, 3)], ["int32"], [("CH", gs.GA_CHUNK)]),
        )
    yield (
        "cuda_ga_finalize",
        kt.cuda_kernel_text(inst["ga_finalize"], [("int32", 1), ("int32", 2), ("int32", 1)], ["int32"] * 3),
    )
    for has_q in (True, False):
        yield (
            f"cuda_sa_{has_q}",
            kt.cuda_kernel_text(
                inst["sa"],
                [("float32", 3), ("float32", 3), ("int32", 2), ("float32", 2), ("float32", 1)],
                ["int32", "int32"],
                [("HAS_Q", has_q)],
            ),
        )


@pytest.mark.parametrize("label,src", list(metal_cases()), ids=lambda x: x if len(x) < 40 else "")
def test_metal_instance_parses(label, src):
    assert parse(src, METAL_STUB, label) == []


@pytest.mark.parametrize("label,src", list(cuda_cases()), ids=lambda x: x if len(x) < 40 else "")
def test_cuda_instance_parses(label, src):
    assert parse(src, CUDA_STUB, label) == []


def test_metallib_source_parses():
    src = (ROOT / "metal" / "mlx_dspark.metal").read_text()
    errs = parse(src, METAL_STUB, "mlx_dspark_metal", ["-DDS_METAL_STUB", "-I", str(gs.GPU_DIR)])
    assert errs == []


BROKEN = {  # a launcher with one mistake each, and the diagnostic it must produce
    "typo": ("ds_ga_partial(c, logits, V, CH, nch, part, part + R * nchh, sv, si);", "nchh"),
    "undeclared": ("ds_ga_partial(c, logits, V, CH, nch, part, part + R * nch, sv, si); simd_summ(V);", "simd_summ"),
    "wrong_type": (
        "ds_ga_partial(c, logits, V, CH, nch, part, part + R * nch, sv, si); c.tid.x = 0;",
        "member reference",
    ),
    "address_space": (
        "ds_ga_partial(c, logits, V, CH, nch, part, part + R * nch, sv, si); const device int* d2 = dims_c;",
        "constant int const",
    ),
}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_broken_metal_body_fails(kind):
    line, expect = BROKEN[kind]
    good = gs.metal_instances()["ga_partial"]
    call = "ds_ga_partial(c, logits, V, CH, nch, part, part + R * nch, sv, si);"
    assert call in good.source
    bad = gs.Instance(
        good.name, good.input_names + ("dims_c",), good.output_names, good.source.replace(call, line), good.header
    )
    src = kt.metal_kernel_text(bad, [("float32", 3, 10**6), ("int32", 1, 4)], ["int32"], [("CH", gs.GA_CHUNK)])
    errs = parse(src, METAL_STUB, "broken_" + kind)
    assert errs, f"the broken body ({kind}) parsed cleanly"
    assert any(expect in e for e in errs), errs


def test_broken_shared_body_fails():
    """A mistake in a kernel body (not a launcher) fails both languages."""
    body = gs.body_text().replace("ds_warp_sum64(s);", "ds_warp_sum64(s, 1);")
    assert body != gs.body_text()
    inst = gs.metal_instances()["sa"]
    bad = gs.Instance(inst.name, inst.input_names, inst.output_names, inst.source, body)
    src = kt.metal_kernel_text(
        bad,
        [("float32", 3, 999), ("float32", 3, 999), ("int32", 2, 99), ("float32", 2, 99), ("float32", 1, 9)],
        ["int32"] * 2,
        [("HAS_Q", True)],
    )
    assert any("ds_warp_sum64" in e or "too many arguments" in e for e in parse(src, METAL_STUB, "bad_body"))
    cinst = gs.cuda_instances()["sa"]
    cbad = gs.Instance(cinst.name, cinst.input_names, cinst.output_names, cinst.source, body)
    csrc = kt.cuda_kernel_text(
        cbad,
        [("float32", 3), ("float32", 3), ("int32", 2), ("float32", 2), ("float32", 1)],
        ["int32"] * 2,
        [("HAS_Q", True)],
    )
    assert parse(csrc, CUDA_STUB, "bad_body_cuda")
