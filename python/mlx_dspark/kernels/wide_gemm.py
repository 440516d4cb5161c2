"""Dequantize-once wide GEMM for the prefill of quantized targets (pure MLX ops).

Inside `prefill_context(target, width)` with width >= the threshold, each nn.QuantizedLinear of
the target computes `x @ dequantize(W).T (+ bias)` for inputs of at least `min_rows` rows: its
weight is dequantized once per forward and the product runs as a dense GEMM (cuBLAS / Metal
steel / BLAS) instead of the quantized matmul. Narrow inputs (decode, verify) keep the quantized
kernel. The switch is per instance (the instance's class is swapped for a subclass while a
prefill runs: compat.retype_modules) and per thread (a verify on another thread never takes the
dense path).

Numerics (tests/test_kernels_wide_gemm.py, tests/test_kernels_cuda.py, bench/results/):
  * CUDA (H200, bf16, Qwen3-4B projections): bit-identical to mx.quantized_matmul at 512 and
    2048 rows, and after a 36-layer stack at 2048 tokens; NOT at <= 256 rows (max rel diff
    ~3e-3 there: MLX picks another quantized kernel) -- so the CUDA threshold is 512 rows;
  * CPU float32 with MLX's bundled reference BLAS: bit-identical;
  * CPU float32 with OpenBLAS: max |diff| ~ 2e-6 x max |output| (GEMM accumulation order);
  * CPU bf16/fp16 (GEMM in float32): more accurate than the CPU quantized kernel, which
    accumulates in half precision; differences up to that kernel's own error.
Policy (MLX_DSPARK_WIDE_GEMM = auto | on | off; MLX_DSPARK_WIDE_GEMM_MIN rows):
auto turns it on for CUDA from 512 rows (2.6x at 2048 rows, 1.3x at 512, slower below: see
bench/results/kernels-cuda.md) and for CPU from 16 rows when a fast BLAS is loaded (OpenBLAS
preloaded, or macOS Accelerate; 2.7x at 16 rows, 10-30x from 64), with the CPU GEMM in float32.
Metal is off in auto until measured on a Mac (MLX_DSPARK_WIDE_GEMM=on to try, from 512 rows).

MoE experts (mlx-lm's QuantizedSwitchLinear, mx.gather_qmm) are NOT covered by default: the
dense form (`dense_switch_linear`: dequantize every expert once + mx.gather_mm over the same rows)
measured slower on the CPU at Qwen3-30B-A3B-like shapes (0.2-0.5x at 64-256 tokens: dequantizing
128 experts costs more than the ~16 rows each expert gets) and is not bitwise gather_qmm there
(max |diff| ~5e-6, bundled BLAS and OpenBLAS alike; bitwise only at toy shapes with the bundled
BLAS): bench/results/moe-wide-gemm-cpu.md. MLX_DSPARK_WIDE_GEMM_EXPERTS=on turns it on (to
measure a GPU: bench/bench_moe_wide_gemm.py), skipping layers whose dequantized experts would
pass MLX_DSPARK_WIDE_GEMM_EXPERT_MB (256) or that carry a global scale (nvfp4).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from ..compat import retype_modules

DEFAULT_MIN_ROWS = {"cpu": 16, "gpu": 512}  # measured crossovers (see the docstring)
_tls = threading.local()
_lock = threading.Lock()
_swapped: dict[int, tuple[int, list]] = {}  # id(model) -> (active contexts, swapped layers)


def _fast_cpu_blas() -> bool:
    if sys.platform == "darwin":
        return True
    from ..blas import fast_blas  # the BLAS libmlx calls, not any BLAS mapped in (numpy's)

    return fast_blas()


def policy() -> dict:
    """{"enabled": bool, "min_rows": int, "compute": "model" | "float32", "why": str} for the
    default device."""
    mode = os.environ.get("MLX_DSPARK_WIDE_GEMM", "auto").strip().lower() or "auto"
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"MLX_DSPARK_WIDE_GEMM={mode!r}: expected auto, on or off")
    cpu = mx.default_device() == mx.cpu
    out = _policy(mode, cpu)
    experts = os.environ.get("MLX_DSPARK_WIDE_GEMM_EXPERTS", "auto").strip().lower() or "auto"
    if experts not in ("auto", "on", "off"):
        raise ValueError(f"MLX_DSPARK_WIDE_GEMM_EXPERTS={experts!r}: expected auto, on or off")
    out["experts"] = out["enabled"] and experts == "on"  # auto: off (slower and not bitwise, measured)
    out["experts_why"] = (
        "MoE experts keep gather_qmm: the dense form measured slower at real MoE shapes and is not bitwise"
        if not out["experts"]
        else "MLX_DSPARK_WIDE_GEMM_EXPERTS=on"
    )
    return out


def _policy(mode: str, cpu: bool) -> dict:
    min_rows = int(os.environ.get("MLX_DSPARK_WIDE_GEMM_MIN", DEFAULT_MIN_ROWS["cpu" if cpu else "gpu"]))
    compute = "float32" if cpu else "model"
    if mode != "auto":
        return {
            "enabled": mode == "on",
            "min_rows": min_rows,
            "compute": compute,
            "why": f"MLX_DSPARK_WIDE_GEMM={mode}",
        }
    if cpu:
        fast = _fast_cpu_blas()
        return {
            "enabled": fast,
            "min_rows": min_rows,
            "compute": compute,
            "why": "fast BLAS loaded" if fast else "reference BLAS: the dense GEMM would not be faster",
        }
    if mx.cuda.is_available():
        return {
            "enabled": True,
            "min_rows": min_rows,
            "compute": compute,
            "why": "CUDA: measured faster (and bit-identical) from 512 rows",
        }
    return {"enabled": False, "min_rows": min_rows, "compute": compute, "why": "not measured on this backend"}


def dense_quantized_linear(layer: nn.QuantizedLinear, x: mx.array, compute: str = "model") -> mx.array:
    """What `layer(x)` computes, as dequantize-once + dense matmul."""
    w = mx.dequantize(
        layer["weight"],
        layer["scales"],
        layer.get("biases"),
        group_size=layer.group_size,
        bits=layer.bits,
        mode=getattr(layer, "mode", "affine"),
    )
    out_dtype = mx.result_type(x, w)
    if compute == "float32" and out_dtype != mx.float32:
        y = mx.matmul(x.astype(mx.float32), w.astype(mx.float32).T).astype(out_dtype)
    else:
        y = mx.matmul(x, w.T)
    if "bias" in layer:
        y = y + layer["bias"]
    return y


class WideQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear whose wide calls, on a thread inside prefill_context, run dense."""

    def __call__(self, x):
        cfg = getattr(_tls, "cfg", None)
        if cfg is not None and x.size // x.shape[-1] >= cfg["min_rows"]:
            return dense_quantized_linear(self, x, cfg["compute"])
        return nn.QuantizedLinear.__call__(self, x)


def dense_switch_linear(layer, x: mx.array, indices: mx.array, sorted_indices: bool, compute: str = "model"):
    """What QuantizedSwitchLinear(x, indices, sorted_indices) computes, as dequantize-once +
    mx.gather_mm over the same rows and experts."""
    w = mx.dequantize(
        layer["weight"],
        layer["scales"],
        layer.get("biases"),
        group_size=layer.group_size,
        bits=layer.bits,
        mode=getattr(layer, "mode", "affine"),
    )
    out_dtype = mx.result_type(x, w)
    if compute == "float32" and out_dtype != mx.float32:
        x, w = x.astype(mx.float32), w.astype(mx.float32)
    y = mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices).astype(out_dtype)
    if "bias" in layer:
        y = y + mx.expand_dims(layer["bias"][indices], -2)
    return y


def _expert_bytes_ok(layer) -> bool:
    cap = float(os.environ.get("MLX_DSPARK_WIDE_GEMM_EXPERT_MB", "256")) * 2**20
    E, O, I = layer.num_experts, layer.output_dims, layer.input_dims  # noqa: E741
    return E * O * I * 4 <= cap


class WideQuantizedSwitchLinear(QuantizedSwitchLinear):
    """QuantizedSwitchLinear whose wide calls, on a thread inside prefill_context with experts
    on, run dequantize-once + gather_mm."""

    def __call__(self, x, indices, sorted_indices=False):
        cfg = getattr(_tls, "cfg", None)
        if (
            cfg is not None
            and cfg.get("experts")
            and indices.size >= cfg["min_rows"]
            and getattr(self, "global_scale", None) is None
            and _expert_bytes_ok(self)
        ):
            return dense_switch_linear(self, x, indices, sorted_indices, cfg["compute"])
        return QuantizedSwitchLinear.__call__(self, x, indices, sorted_indices)


_WIDE = {nn.QuantizedLinear: WideQuantizedLinear, QuantizedSwitchLinear: WideQuantizedSwitchLinear}


def _quantized_linears(model: nn.Module, experts: bool = False) -> list:
    kinds = (nn.QuantizedLinear, WideQuantizedLinear) + (
        (QuantizedSwitchLinear, WideQuantizedSwitchLinear) if experts else ()
    )
    return [m for _, m in model.named_modules() if type(m) in kinds]


def _retype(layers: list, wide: bool) -> None:
    for base, w in _WIDE.items():
        group = [m for m in layers if type(m) in (base, w)]
        if group:
            retype_modules(group, w if wide else base)


@contextlib.contextmanager
def prefill_context(target, width: int, cfg: dict | None = None):
    """Run the wrapped forward with the dense path for the target's quantized linears."""
    cfg = cfg or policy()
    model = getattr(target, "model", target)
    if not cfg["enabled"] or width < cfg["min_rows"] or getattr(_tls, "cfg", None) is not None:
        yield
        return
    key = id(model)
    with _lock:
        count, layers = _swapped.get(key, (0, None))
        if layers is None:
            layers = _quantized_linears(model, experts=bool(cfg.get("experts")))
            _retype(layers, wide=True)
        _swapped[key] = (count + 1, layers)
    _tls.cfg = cfg
    try:
        yield
    finally:
        _tls.cfg = None
        with _lock:
            count, layers = _swapped[key]
            if count == 1:
                _retype(layers, wide=False)
                del _swapped[key]
            else:
                _swapped[key] = (count - 1, layers)
