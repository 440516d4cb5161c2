"""Precision: the dtypes a target may be cast to, the default per backend, and the casts."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def default_dtype() -> str:
    """float32 on CPU (BLAS-backed matmuls; bf16 never uses BLAS), bfloat16 on a GPU."""
    return "float32" if mx.default_device() == mx.cpu else "bfloat16"


def cast_model(model: nn.Module, dtype) -> None:
    """Cast floating parameters (quantization scales and biases included) to `dtype`."""
    from mlx.utils import tree_map

    model.update(tree_map(lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p, model.parameters()))


def cast_scales_f32(model: nn.Module) -> None:
    """MLX's CPU quantized matmul crawls with fp16/bf16 scales; float32 scales run at full speed."""
    from mlx.utils import tree_flatten, tree_unflatten

    params = tree_flatten(model.parameters())
    fixed = [
        (k, v.astype(mx.float32)) for k, v in params if k.endswith((".scales", ".biases")) and v.dtype != mx.float32
    ]
    if fixed:
        model.update(tree_unflatten(fixed))


def weights_summary(model: nn.Module) -> tuple[str, list]:
    """(the floating dtypes of the weights, joined; the sorted (bits, group) of quantized modules)."""
    from mlx.utils import tree_flatten

    dtypes, quant = set(), set()
    for _, m in model.named_modules():
        bits = getattr(m, "bits", None)
        if bits is not None and hasattr(m, "scales"):
            quant.add((int(bits), int(getattr(m, "group_size", 0))))
    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            dtypes.add(str(p.dtype))
    return ",".join(sorted(dtypes)), sorted(quant)
