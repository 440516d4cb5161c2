"""MLX quantized products that are wrong or not reproducible on this device: found at load, routed
around.

Measured on the H200 (MLX 0.32.4 CUDA, bench/results/invariance-h200.md): mx.quantized_matmul over
more than one row with K equal to one quantization group (K = group size = 128) returns NaN or
other values on each run, while M = 1 and K of two groups or more are reproducible; in float32
at group 128 it fails to launch ("cuGraphAddKernelNode ... invalid argument"). A target with
such a layer prefills differently on every run, so neither plain decoding nor any drafting mode
is reproducible, and every bitwise check (the load's width-invariance check, the rollback proof)
fails on it.

`check_model(model)` runs MLX's product once per distinct layer kind (bits, group size, mode,
dtype, K, N; the experts' gather_qmm too) at a few widths, on random inputs and the layer's own
weights: it must run, give the same bits on three runs, be finite and lie within a loose bound
of the dequantized float32 product (the bound catches garbage, not rounding: the CPU's
half-precision quantized product accumulates in half precision, ~0.2 relative at K = 4096). A
layer whose kind fails gets its own product (compat.OWN_PRODUCT: dequantize + dense matmul, the
form kernels/wide_gemm.py uses for wide prefills), which compat.py's routing calls outside the
invariant decode path (the prefill, and mlx-lm's own forward); decode and verify already run the
invariant kernels. Verdicts are kept per process.

MLX_DSPARK_QMM_CHECK = auto (default: on a GPU) | on (the CPU too) | off.
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn

from ..compat import OWN_PRODUCT, route_linears_to_invariant_op
from .wide_gemm import dense_quantized_linear, dense_switch_linear

ROWS = (2, 23, 100)  # widths a prefill chunk and a verify block take
RUNS = 3
SLICE = 256  # output columns (and experts: 4) compared with the dequantized product
_verdicts: dict[tuple, str | None] = {}


def setting() -> str:
    raw = os.environ.get("MLX_DSPARK_QMM_CHECK", "auto").strip().lower() or "auto"
    if raw not in ("auto", "on", "off"):
        from ..errors import UserError

        raise UserError(f"MLX_DSPARK_QMM_CHECK={raw!r}: expected auto, on or off")
    return raw


def enabled() -> bool:
    mode = setting()
    return mode == "on" or (mode == "auto" and mx.default_device() != mx.cpu)


def marked(layer) -> bool:
    return vars(layer).get(OWN_PRODUCT) is not None


def _bound(dtype) -> float:
    return 1e-2 if dtype == mx.float32 else 0.5


def _judge(product, ref: mx.array, slice_of, dtype, what: str) -> str | None:
    mx.eval(ref)
    try:
        runs = [product() for _ in range(RUNS)]
        mx.eval(runs)
    except RuntimeError as e:  # measured: float32 group 128 on CUDA fails to launch
        return f"{what}: fails to run ({str(e).splitlines()[0][:120]})"
    if not all(mx.array_equal(runs[0], y).item() for y in runs[1:]):
        return f"{what}: not the same on {RUNS} runs"
    y = slice_of(runs[0]).astype(mx.float32)
    if not mx.all(mx.isfinite(y)).item():
        return f"{what}: not finite"
    err = float((mx.abs(y - ref).max() / (mx.abs(ref).max() + 1e-30)).item())
    if err > _bound(dtype):
        return f"{what}: {err:.2g} from the dequantized product"
    return None


def _dequantized(layer, w, s, b) -> mx.array:
    return mx.dequantize(
        w, s, b, group_size=layer.group_size, bits=layer.bits, mode=getattr(layer, "mode", "affine")
    ).astype(mx.float32)


def _verdict(key: tuple, what: str, dtype, case) -> str | None:
    """The cached verdict for `key`, else `case(M)` -> (product, reference, slice_of) judged at
    each of ROWS until one fails."""
    if key not in _verdicts:
        why = None
        for M in ROWS:
            why = _judge(*case(M), dtype, f"{what}, {M} rows")
            if why:
                break
        _verdicts[key] = why
    return _verdicts[key]


def check_linear(layer) -> str | None:
    """None when MLX's quantized_matmul is reproducible and sane for this layer's kind, else why not."""
    w, s, b = layer["weight"], layer["scales"], layer.get("biases")
    mode, gs, bits = getattr(layer, "mode", "affine"), layer.group_size, layer.bits
    N, K, dtype = w.shape[0], gs * s.shape[-1], s.dtype
    n = min(N, SLICE)
    ref_w = _dequantized(layer, w[:n], s[:n], None if b is None else b[:n])

    def case(M):
        x = mx.random.normal((M, K), key=mx.random.key(1000 * M + K)).astype(dtype)

        def product():
            return mx.quantized_matmul(x, w, s, b, transpose=True, group_size=gs, bits=bits, mode=mode)

        return product, x.astype(mx.float32) @ ref_w.T, lambda y: y[:, :n]

    key = (str(mx.default_device()), "linear", bits, gs, mode, str(dtype), K, N)
    return _verdict(key, f"quantized_matmul {bits}-bit group {gs}, K {K}, N {N}", dtype, case)


def check_experts(layer) -> str | None:
    """The same for an mlx-lm QuantizedSwitchLinear (mx.gather_qmm over sorted rows, as its MoE
    blocks call it)."""
    w, s, b = layer["weight"], layer["scales"], layer.get("biases")
    mode, gs, bits = getattr(layer, "mode", "affine"), layer.group_size, layer.bits
    E, N, K, dtype = w.shape[0], w.shape[1], gs * s.shape[-1], s.dtype
    e, n = min(E, 4), min(N, SLICE)
    ref_w = _dequantized(layer, w[:e, :n], s[:e, :n], None if b is None else b[:e, :n])

    def case(M):
        x = mx.random.normal((M, 1, K), key=mx.random.key(1000 * M + K + 1)).astype(dtype)
        idx = mx.sort(mx.random.randint(0, e, (M,), key=mx.random.key(M)).astype(mx.uint32))

        def product():
            return mx.gather_qmm(
                x, w, s, b, rhs_indices=idx, transpose=True, group_size=gs, bits=bits, mode=mode, sorted_indices=True
            )

        ref = mx.einsum("mk,mnk->mn", x[:, 0].astype(mx.float32), ref_w[idx])
        return product, ref, lambda y: y[:, 0, :n]

    key = (str(mx.default_device()), "experts", bits, gs, mode, str(dtype), E, K, N)
    return _verdict(key, f"gather_qmm {bits}-bit group {gs}, {E} experts, K {K}, N {N}", dtype, case)


def _checkable(m) -> bool:
    return "scales" in m and getattr(m, "global_scale", None) is None and not isinstance(m["weight"], dict)


def check_model(model) -> list[str]:
    """Mark every quantized layer of `model` whose kind fails its check (and unmark the others);
    returns one line per failing kind (empty: MLX's products are used as they are)."""
    if not enabled():
        return []
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    found: dict[str, int] = {}
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and _checkable(m):
            why, dense = check_linear(m), dense_quantized_linear
        elif isinstance(m, QuantizedSwitchLinear) and _checkable(m):
            why, dense = check_experts(m), dense_switch_linear
        else:
            continue
        vars(m)[OWN_PRODUCT] = dense if why else None
        if why:
            found[why] = found.get(why, 0) + 1
    if found:
        route_linears_to_invariant_op()  # the routing that reads the marks
    return [f"{why} ({n} layer{'s' if n > 1 else ''})" for why, n in found.items()]


def reset() -> None:
    """Forget the verdicts (tests)."""
    _verdicts.clear()
