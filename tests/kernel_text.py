"""The kernel text MLX generates around a GPU kernel instance: a copy of MLX's signature writer
(mlx/backend/common/metal_kernel.cpp and its CUDA twin, MLX 0.32.x), so the tests can compile-check
the Metal and CUDA instances of kernels/gpu/*.h on Linux without MLX's GPU backends."""

from __future__ import annotations

from mlx_dspark.kernels.gpu_source import Instance

METAL_ATTRIBUTES = (  # mlx/backend/common/metal_kernel.cpp, in MLX's order
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)
METAL_TYPES = {
    "float32": "float",
    "float16": "half",
    "bfloat16": "bfloat16_t",
    "int32": "int",
    "uint32": "uint",
    "bool": "bool",
    "int64": "int64_t",
    "uint8": "uint8_t",
}
CUDA_TYPES = {
    "float32": "float",
    "float16": "__half",
    "bfloat16": "__nv_bfloat16",
    "int32": "int32_t",
    "uint32": "uint32_t",
    "bool": "bool",
    "int64": "int64_t",
    "uint8": "uint8_t",
}


def _tmpl_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def metal_kernel_text(
    inst: Instance, inputs: list[tuple[str, int, int]], outputs: list[str], template: list[tuple[str, object]] = ()
) -> str:
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
            for suf, ty in (
                ("_shape", "const constant int*"),
                ("_strides", "const constant int64_t*"),
                ("_ndim", "const constant int&"),
            ):
                if n + suf in src:
                    params.append(f"  {ty} {n}{suf} [[buffer({idx})]]")
                    idx += 1
    for n, dt in zip(inst.output_names, outputs):
        params.append(f"  device {METAL_TYPES[dt]}* {n} [[buffer({idx})]]")
        idx += 1
    params += [f"  {ty} {a} [[{a}]]" for a, ty in METAL_ATTRIBUTES if a in src]
    s += ",\n".join(params) + ") {\n" + src + "\n}\n"
    if template:
        targs = "<" + ", ".join(_tmpl_value(v) if not isinstance(v, str) else METAL_TYPES[v] for _, v in template) + ">"
        s += f'\ntemplate [[host_name("{name}")]] [[kernel]] decltype({name}{targs}) {name}{targs};\n'
    return s


def cuda_kernel_text(
    inst: Instance, inputs: list[tuple[str, int]], outputs: list[str], template: list[tuple[str, object]] = ()
) -> str:
    """The CUDA source `mx.fast.cuda_kernel` compiles for `inst` (minus MLX's default header),
    as build_kernel() in mlx/backend/cuda/custom_kernel.cpp writes it."""
    src = inst.source
    s = inst.header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    s += f"__global__ void custom_kernel_{inst.name}(\n"
    params = []
    for n, (dt, nd) in zip(inst.input_names, inputs):
        params.append(f"    const {CUDA_TYPES[dt]}* {n}")
        if nd > 0:
            for suf, ty in (
                ("_shape", "const __grid_constant__ Shape"),
                ("_strides", "const __grid_constant__ Strides"),
                ("_ndim", "const __grid_constant__ int"),
            ):
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


def run_gpu_body_on_cpu(emulation: str, tmp_path) -> None:
    """Compile tests/emulation/<emulation> (a GPU kernel body on CPU threads, metal_emu.h) with g++
    and run it; fails the test unless it exits 0 and prints "OK". g++ is needed anyway: MLX's CPU
    backend compiles its kernels with it."""
    import shutil
    import subprocess
    from pathlib import Path

    from mlx_dspark.kernels.gpu_source import GPU_DIR

    gxx = shutil.which("g++")
    assert gxx, "g++ is needed (MLX's CPU backend compiles its kernels with it)"
    src = Path(__file__).parent / "emulation" / emulation
    exe = tmp_path / "emu"
    subprocess.run(
        [gxx, "-std=c++20", "-O1", "-pthread", "-I", str(GPU_DIR), str(src), "-o", str(exe)],
        check=True,
        capture_output=True,
        text=True,
    )
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.startswith("OK"), run.stdout + run.stderr
