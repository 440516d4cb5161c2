"""The native row kernel as the drafter's matmul on the CPU: a faster product for a few rows.

A drafter pass multiplies a handful of rows (the block's 7 or 15 slots, a few context rows) by
each weight. MLX's CPU matmul hands that to BLAS sgemm, which is slow at small M: the 35 dense
linears of the demo's 5-layer drafter over 7 rows take 24 ms through OpenBLAS and 98 ms through
the reference BLAS that MLX's Linux wheel bundles, against 4.4-4.8 ms through the native kernel
of kernels/invariant_linear.py (csrc/invariant_linear.cpp: one pass over each weight row for all
rows; bench/bench_drafter_pass.py). The target's own decode already runs on that kernel.

A float32 weight runs from float16 panels instead (kernels/draft_linear.py, csrc/draft_linear.cpp):
the pass streams every drafter weight once a round, so half the bytes and a tile that feeds each
weight vector to all of its rows cut the products by ~1.3-1.9x (bench/results/cpu-ops.md). The
weights are packed at the drafter's load (`prepack`), or at their first product;
MLX_DSPARK_DRAFT_PANELS=off keeps the float32 row kernel.

Inside `native_products()` (this thread only) float linear layers on the CPU run through these:
compat.py's routing of nn.Linear and the embeddings' as_linear (a tied head), and `dense()` for
the draft vocabulary's gathered heads (models/draft_vocab.py). Everywhere else, and for training
(the native op has no gradient), MLX's own matmul runs. Drafts need no exactness (the target
verifies every one), so this changes no output; it makes the drafter's rows independent of how
many run together, as the target's are.

With a fast BLAS a wide product (a long prompt's context rows, ingested in chunks) keeps BLAS,
which wins there on some machines (bench/results/invariance-cpu.md, kernel prefill: the kernel at
1.02x OpenBLAS's speed at 32 rows, 0.66x at 256, 0.55x at 1024, on an AMD EPYC); with the reference
BLAS the kernel wins at every width.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref

import mlx.core as mx
import mlx.nn as nn

MAX_ROWS_FAST_BLAS = 64  # above this many rows a fast BLAS keeps the product
# A weight larger than this keeps the float32 kernel: a float16 copy of a big target's tied head (a
# drafter without a draft vocabulary multiplies by it) would cost more memory than its pass saves.
MAX_PANEL_ELEMENTS = 1 << 26

_local = threading.local()
_fast_blas: list[bool] = []  # memo: whether MLX's BLAS in this process is a fast one


@contextlib.contextmanager
def native_products():
    """Route float linear products through the native row kernel inside this block (this thread),
    where the CPU runs them (`available()`). nn.Linear reads the flag through compat.py's routing,
    which the caller installs once (compat.route_linears_to_invariant_op)."""
    prev = getattr(_local, "on", False)
    _local.on = available()
    try:
        yield
    finally:
        _local.on = prev


def is_on() -> bool:
    return getattr(_local, "on", False)


def available() -> bool:
    """The native kernel computes this device's dense products: the CPU, with the extension built."""
    from . import invariant_linear

    return invariant_linear.linear_path() == "native"


def _takes(rows: int) -> bool:
    if rows <= MAX_ROWS_FAST_BLAS:
        return True
    if not _fast_blas:
        from ..blas import fast_blas

        _fast_blas.append(fast_blas())
    return not _fast_blas[0]


def linear(layer, x: mx.array, as_linear: bool = False) -> mx.array | None:
    """The layer's product through a native kernel, or None (MLX's op runs): a quantized layer,
    a dtype the kernels do not take, or a wide product with a fast BLAS."""
    if not _takes(x.size // max(1, x.shape[-1])):
        return None
    if type(layer) in (nn.Linear, nn.Embedding):
        bias = None if as_linear or "bias" not in layer else layer["bias"]
        y = _from_panels(x, layer["weight"], bias)
        if y is not None:
            return y
    from . import invariant_linear

    return invariant_linear.call(layer, x, as_linear=as_linear)


def dense(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array | None:
    """x @ weight.T (+ bias) through a native kernel inside native_products(), else None."""
    if not is_on() or not _takes(x.size // max(1, x.shape[-1])):
        return None
    y = _from_panels(x, weight, bias)
    if y is not None:
        return y
    from . import invariant_linear

    return invariant_linear.dense(x, weight, bias)


# A float32 weight's float16 panels (kernels/draft_linear.py), packed at its first product in a
# drafter pass: id(weight) -> (weakref to the weight, panels or None where it does not pack). The
# entry goes with the weight, so a weight that training replaces is packed again.
_packs: dict = {}


def panels_on() -> bool:
    """MLX_DSPARK_DRAFT_PANELS=off keeps a drafter's float32 weights on the float32 kernel (A/B)."""
    return os.environ.get("MLX_DSPARK_DRAFT_PANELS", "on").strip().lower() not in ("0", "off", "no", "false")


def _panels(weight: mx.array) -> mx.array | None:
    key = id(weight)
    hit = _packs.get(key)
    if hit is None or hit[0]() is not weight:
        from . import draft_linear

        weakref.finalize(weight, _packs.pop, key, None)
        panels = draft_linear.pack(weight) if weight.size <= MAX_PANEL_ELEMENTS else None
        hit = _packs[key] = (weakref.ref(weight), panels)
    return hit[1]


def prepack(weights) -> None:
    """Pack these float32 weights now (a drafter's load on the CPU: models/drafters.py), so that
    its first pass does not pay for it (~0.25 s for the demo drafter)."""
    if available() and panels_on():
        for w in weights:
            if w.dtype == mx.float32 and w.ndim == 2:
                _panels(w)


def _from_panels(x: mx.array, weight: mx.array, bias: mx.array | None) -> mx.array | None:
    if weight.dtype != mx.float32 or x.dtype != mx.float32 or weight.ndim != 2 or not panels_on():
        return None
    panels = _panels(weight)
    if panels is None:
        return None
    from . import draft_linear

    return draft_linear.draft_linear(x, panels, weight.shape[0], bias)


__all__ = ["MAX_ROWS_FAST_BLAS", "available", "dense", "is_on", "linear", "native_products", "panels_on", "prepack"]
