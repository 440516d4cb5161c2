"""The CUDA kernels' bodies go to MLX as #include lines (a few hundred bytes per launch, not the
12-19 kB body text that MLX would copy and hash at every launch), where NVRTC reads them."""

from __future__ import annotations

import shutil
import subprocess

import kernel_text as kt
import mlx.core as mx
import pytest

from mlx_dspark.kernels import gpu_source as gs
from mlx_dspark.kernels import invariant as inv
from mlx_dspark.kernels import invariant_linear as il


@pytest.fixture
def includes(monkeypatch):
    """gpu_source with the GPU probe answered `works`, and mx.fast.cuda_kernel recording its calls."""
    made = []
    state = {"works": True}
    monkeypatch.setattr(gs, "_includes_work", lambda: state["works"])
    gs.cuda_include_header.cache_clear()
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: made.append(kw) or kw)
    yield made, state
    gs.cuda_include_header.cache_clear()


def test_cuda_kernels_include_their_body_files(includes):
    made, _ = includes
    inst = il.instance("cuda", "dense", 3)
    gs.make_kernel("cuda", inst)
    header = made[-1]["header"]
    lines = header.splitlines()
    assert lines[0].startswith("// mlx-dspark bodies ")
    assert lines[1:] == [f'#include "{gs.GPU_DIR / f}"' for f in ("ds_portable.h", "invariant_linear.h")]
    assert len(header) < 400 < 10_000 < len(inst.header)
    assert made[-1]["source"] == inst.source and made[-1]["name"] == inst.name
    # the inline text is the same files, compacted
    assert inst.header == gs.compact("".join((gs.GPU_DIR / f).read_text() + "\n" for f in inst.files))


def test_metal_and_a_failed_probe_keep_the_inline_text(includes, monkeypatch):
    made, state = includes
    recorded = []
    monkeypatch.setattr(mx.fast, "metal_kernel", lambda **kw: recorded.append(kw) or kw)
    inst = inv.metal_instance()
    gs.make_kernel("metal", inst, ensure_row_contiguous=False)
    assert recorded[-1]["header"] == inst.header and recorded[-1]["ensure_row_contiguous"] is False
    state["works"] = False
    gs.make_kernel("cuda", inv.cuda_instance())
    assert made[-1]["header"] == inv.cuda_instance().header


def test_the_switch_and_an_unsayable_path_keep_the_inline_text(includes, monkeypatch):
    made, _ = includes
    inst = il.instance("cuda", "affine", 2)
    monkeypatch.setenv("MLX_DSPARK_CUDA_INCLUDE", "0")
    gs.make_kernel("cuda", inst)
    assert made[-1]["header"] == inst.header
    monkeypatch.delenv("MLX_DSPARK_CUDA_INCLUDE")
    gs.cuda_include_header.cache_clear()
    monkeypatch.setattr(gs, "GPU_DIR", gs.Path('/tmp/a "quoted" dir'))
    gs.make_kernel("cuda", inst)
    assert made[-1]["header"] == inst.header


def test_the_digest_follows_the_body_text(includes, tmp_path, monkeypatch):
    for f in ("ds_portable.h", "invariant_linear.h"):
        (tmp_path / f).write_text((gs.GPU_DIR / f).read_text())
    monkeypatch.setattr(gs, "GPU_DIR", tmp_path)
    first = gs.cuda_include_header(("ds_portable.h", "invariant_linear.h"))
    (tmp_path / "invariant_linear.h").write_text((tmp_path / "invariant_linear.h").read_text() + "\n// edited\n")
    gs.cuda_include_header.cache_clear()
    assert gs.cuda_include_header(("ds_portable.h", "invariant_linear.h")) != first


@pytest.mark.gpu
@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")
def test_on_cuda_the_include_form_is_taken_and_computes_the_inline_forms_bits(monkeypatch):
    gs._includes_work.cache_clear()
    gs.cuda_include_header.cache_clear()
    assert gs._includes_work() is True
    inst = il.instance("cuda", "affine", 2)
    assert gs.cuda_include_header(inst.files).count("#include") == 2
    with mx.stream(mx.gpu):
        mx.random.seed(5)
        x = mx.random.normal((7, 512)).astype(mx.bfloat16)
        quants = [mx.quantize(mx.random.normal((n, 512)).astype(mx.bfloat16), group_size=64, bits=4) for n in (96, 160)]
        got = il.affine_gpu_group(x, quants, 4, [None, None], kernel="v1")
        il._kernel.cache_clear()
        monkeypatch.setenv("MLX_DSPARK_CUDA_INCLUDE", "0")
        gs.cuda_include_header.cache_clear()
        inline = il.affine_gpu_group(x, quants, 4, [None, None], kernel="v1")
        for a, b in zip(got, inline):
            assert mx.array_equal(a, b).item()
    il._kernel.cache_clear()
    gs.cuda_include_header.cache_clear()


def test_the_probe_is_false_without_a_gpu():
    if mx.default_device() == mx.gpu and mx.cuda.is_available():
        pytest.skip("a CUDA GPU is here: the probe's answer is the GPU's")
    gs._includes_work.cache_clear()
    assert gs._includes_work() is False


def test_the_probe_runs_once_per_machine_and_install_place(monkeypatch, tmp_path):
    """The probe is an NVRTC compile (~2 s a process on the H200): its answer is kept in the cache
    root, keyed by MLX version, device and the header's place, so a later process reads it."""
    tried = []
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gs, "_try_include", lambda line: tried.append(line) or True)
    try:
        for _ in range(2):  # two "processes": the in-process memo is cleared between them
            gs._includes_work.cache_clear()
            assert gs._includes_work() is True
        assert len(tried) == 1
        moved = tmp_path / "moved"
        moved.mkdir()
        (moved / "ds_portable.h").write_text((gs.GPU_DIR / "ds_portable.h").read_text())
        monkeypatch.setattr(gs, "GPU_DIR", moved)
        gs._includes_work.cache_clear()
        assert gs._includes_work() is True and len(tried) == 2 and str(moved) in tried[1]
    finally:
        gs._includes_work.cache_clear()


@pytest.mark.skipif(not shutil.which("nvcc"), reason="needs nvcc")
def test_the_include_form_compiles_with_nvcc(includes, tmp_path):
    """The include form is a program a real CUDA compiler builds (nvcc, device code, sm_90)."""
    from test_moe_invariant_gather import NVCC_PRELUDE

    srcs = []
    for G in (1, 3):
        inst = il.instance("cuda", "dense", G)
        h = gs.cuda_include_header(inst.files)
        inc = gs.Instance(inst.name, inst.input_names, inst.output_names, inst.source, h, inst.files)
        ins = [("bfloat16", 2)] + [("bfloat16", 2)] * G + [("bfloat16", 1)] * G
        text = kt.cuda_kernel_text(inc, ins, ["bfloat16"] * G, [("T", "bfloat16"), ("HB", 1)])
        srcs.append(text.replace(f"custom_kernel_{inst.name}(", f"k{G}(", 1))
    (tmp_path / "k.cu").write_text(NVCC_PRELUDE + "".join(srcs))
    run = subprocess.run(
        [shutil.which("nvcc"), "-std=c++17", "-arch=sm_90", "-c", str(tmp_path / "k.cu"), "-o", str(tmp_path / "k.o")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
