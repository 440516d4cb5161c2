"""The native extension: it is built from these sources, it loads, its primitives are real MLX
primitives used by the code, and its Metal branch (which only macOS builds) type-checks."""

from __future__ import annotations

import hashlib
import io
import subprocess
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_dspark import kernels
from mlx_dspark.kernels import native as _native

ROOT = Path(__file__).resolve().parents[1]


def source_hash(with_metal: bool) -> str:
    """What CMakeLists.txt computes: sha256 over 'relpath:sha256\\n' of the consumed sources."""
    files = [p for p in (ROOT / "csrc").iterdir() if p.is_file()] + [ROOT / "CMakeLists.txt"]
    if with_metal:
        files += list((ROOT / "metal").glob("*.metal")) + list((ROOT / "python/mlx_dspark/kernels/gpu").glob("*.h"))
    rels = sorted(str(p.relative_to(ROOT)) for p in files)
    manifest = "".join(f"{r}:{hashlib.sha256((ROOT / r).read_bytes()).hexdigest()}\n" for r in rels)
    return hashlib.sha256(manifest.encode()).hexdigest()


def test_extension_is_built_from_these_sources(ext):
    assert ext.source_hash == source_hash(ext.has_metal), (
        "the installed mlx_dspark._ext was built from other sources; rebuild: pip install --no-build-isolation -e ."
    )


def test_extension_matches_mlx(ext):
    assert ext.mlx_version == mx.__version__
    status = kernels.native_status()
    assert status["loaded"] and status["reason"] is None
    assert set(status["primitives"]) == {
        "DsparkGreedyAccept",
        "DsparkSamplingAccept",
        "DsparkInvariantLinear",
        "DsparkInvariantAttention",
        "DsparkDraftAttention",
        "DsparkDraftLinear",
        "DsparkRmsNorm",
        "DsparkSiluMul",
        "DsparkMarkovGreedy",
        "DsparkTargetRope",
    }
    assert status["kernels"]["greedy_accept"] == "native-cpu"


def primitive_names(*arrays) -> str:
    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    return dot.getvalue()


def test_primitives_are_in_the_graph(ext):
    lg = mx.random.normal((2, 3, 500))
    d = mx.zeros((2, 2), dtype=mx.int32)
    assert "DsparkGreedyAccept" in primitive_names(*ext.greedy_accept(lg, d))
    p = mx.softmax(lg, axis=-1)
    out = ext.sampling_accept(p, None, d, mx.zeros((2, 2)), mx.zeros((2,)))
    assert "DsparkSamplingAccept" in primitive_names(*out)
    q, kv = mx.zeros((1, 2, 3, 8)), mx.zeros((1, 1, 5, 8))
    assert "DsparkInvariantAttention" in primitive_names(ext.invariant_attention(q, kv, kv, scale=1.0))
    assert "DsparkSiluMul" in primitive_names(ext.silu_mul(lg, lg))
    # the verify loop's acceptor goes through it
    from mlx_dspark.decode.accept import GreedyAcceptor
    from mlx_dspark.decode.proposers import Draft

    calls = []
    real = ext.greedy_accept
    try:
        ext_fn = lambda *a, **k: calls.append(1) or real(*a, **k)  # noqa: E731
        _native._state["ext"] = type(
            "Spy",
            (),
            {"greedy_accept": staticmethod(ext_fn), "has_metal": False, "sampling_accept": ext.sampling_accept},
        )()
        n, nxt = GreedyAcceptor().verify(lg[0], Draft(tokens=[int(t) for t in mx.argmax(lg[0, :2], -1).tolist()]), [])
    finally:
        _native._state["ext"] = ext
    assert calls, "GreedyAcceptor.verify did not use the native primitive"
    ref = kernels.greedy_accept_reference(lg[:1], mx.argmax(lg[:1, :2], -1).astype(mx.int32))
    assert (n, nxt) == (ref[1].item(), ref[2].item())


def test_errors_are_clear(ext):
    with pytest.raises(ValueError, match=r"draft must be \[B, w-1\]"):
        ext.greedy_accept(mx.zeros((1, 3, 10)), mx.zeros((1, 3), dtype=mx.int32))
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        ext.greedy_accept(mx.zeros((1, 3, 10), dtype=mx.int32), mx.zeros((1, 2), dtype=mx.int32))
    with pytest.raises(ValueError, match="u_bonus has the wrong shape"):
        ext.sampling_accept(mx.zeros((1, 3, 10)), None, mx.zeros((1, 2), mx.int32), mx.zeros((1, 2)), mx.zeros((2,)))


METAL_CPP_STUB = r"""
// metal-cpp stand-in: declarations only, enough for MLX's Metal headers and csrc/eval_gpu.cpp.
#pragma once
#include <cstddef>
namespace NS {
using UInteger = unsigned long;
enum StringEncoding : UInteger { ASCIIStringEncoding = 1, UTF8StringEncoding = 4 };
template <class T> class SharedPtr { public: T* get() const; T* operator->() const; explicit operator bool() const; };
template <class T> SharedPtr<T> TransferPtr(T*);
template <class T> SharedPtr<T> RetainPtr(T*);
class Object { public: void release(); void retain(); };
class String : public Object { public: static String* string(const char*, StringEncoding); const char* utf8String() const; };
class AutoreleasePool : public Object {};
class Error : public Object { public: String* localizedDescription() const; };
}
namespace MTL {
struct Size { Size(NS::UInteger, NS::UInteger, NS::UInteger); NS::UInteger width, height, depth; };
enum class DataType : NS::UInteger { None = 0, Bool, Int, Float };
class Resource : public NS::Object {};
class Allocation : public NS::Object {};
class Buffer : public Resource {};
class Fence : public NS::Object {};
class Function : public NS::Object {};
class LinkedFunctions : public NS::Object {};
class Library : public NS::Object {};
class ResidencySet : public NS::Object {};
class ComputePipelineState : public NS::Object { public: NS::UInteger maxTotalThreadsPerThreadgroup() const; };
class ComputeCommandEncoder : public NS::Object {
 public:
  void setComputePipelineState(const ComputePipelineState*);
  void setBytes(const void*, NS::UInteger, NS::UInteger);
  void setThreadgroupMemoryLength(NS::UInteger, NS::UInteger);
  void setBuffer(const Buffer*, NS::UInteger, NS::UInteger);
};
class CommandBuffer : public NS::Object {};
class CommandQueue : public NS::Object {};
class Device : public NS::Object {};
}
"""


def parse_metal_branch(tmp_path, source: str) -> list[str]:
    import clang.cindex as ci

    (tmp_path / "Metal").mkdir(exist_ok=True)
    (tmp_path / "Metal" / "Metal.hpp").write_text(METAL_CPP_STUB)
    mlx_inc = Path(list(__import__("mlx").__path__)[0]) / "include"
    gcc_inc = subprocess.run(["g++", "-print-file-name=include"], capture_output=True, text=True).stdout.strip()
    tu = ci.Index.create().parse(
        str(ROOT / "csrc" / "eval_gpu.cpp"),
        args=[
            "-x",
            "c++",
            "-std=c++20",
            "-fsyntax-only",
            "-D_METAL_",
            "-DDSPARK_METALLIB=1",
            f"-I{tmp_path}",
            f"-I{mlx_inc}",
            f"-I{ROOT / 'csrc'}",
            "-isystem",
            gcc_inc,
        ],
        unsaved_files=[(str(ROOT / "csrc" / "eval_gpu.cpp"), source)],
    )
    return [
        (str(d.location.file), d.location.line, d.spelling) for d in tu.diagnostics if d.severity >= ci.Diagnostic.Error
    ]


def test_metal_eval_gpu_typechecks(tmp_path):
    """csrc/eval_gpu.cpp's Metal branch against MLX's real Metal headers (metal-cpp stubbed). A
    deliberately wrong call appended to the same translation unit must be reported (and nothing
    else: every error must come from the appended lines)."""
    src = (ROOT / "csrc" / "eval_gpu.cpp").read_text()
    assert "#ifdef _METAL_" in src
    n = src.count("\n") + 1
    broken = src + (
        "\nnamespace dspark {\nvoid ds_broken(mx::metal::CommandEncoder& enc) {\n  enc.set_bytez(1, 2);\n}\n}\n"
    )
    errs = parse_metal_branch(tmp_path, broken)
    assert any("set_bytez" in msg for _, _, msg in errs), errs
    assert all(f.endswith("eval_gpu.cpp") and line > n for f, line, _ in errs), errs
