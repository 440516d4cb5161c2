"""Width-invariant attention under a boolean mask: query row i attends over exactly the keys its
mask row lets it see, in key order, computed as that row alone over those keys would be.

Why it is needed: a verify round over a sliding-window cache (models/sliding.py) attends over one
gathered layout in which every query's keys sit in its plain ring order, the others masked out,
so mlx-lm calls mx.fast.scaled_dot_product_attention with an array mask [w, L]. The invariant
causal op (kernels/invariant.py) takes only "causal" / no mask, and MLX's own masked attention
reduces in a shape-dependent order (on a GPU, and on the CPU with OpenBLAS), so gemma3 / gemma4
failed the load self-check there. Row i of the plain step is the invariant op over the ring's n_i
keys; here row i is the same op over the same n_i keys in the same order (its visible keys,
compacted), so the two are bit-identical.

Paths (`kernels.invariant.attention_path()`):
  cuda / metal  the body of kernels/gpu/invariant_attention.h (ds_ia_row, unchanged) through a
                launcher that gives row i its own key list (the compacted keys) and length n_i
  reference     the CPU: each row alone over its visible keys as the CPU's plain step computes a
                row (invariant.one_row: the native op, or MLX's single-query attention without the
                extension), or, with MLX_DSPARK_KERNELS=reference, the pure-MLX chunked reference
The compaction (which keys each row sees) is read from the mask once per mask array and cached:
sliding.py builds each layout's mask once and reuses it.
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx
import numpy as np

from . import invariant as inv
from .gpu_source import Instance, make_kernel
from .gpu_source import instance as gpu_instance

_CALL = """  const int H = q_shape[1];
  const int W = q_shape[2];
  const int D = q_shape[3];
  const int Hkv = k_shape[1];
  const int i = (int)c.bx;
  const int b = (int)c.by / H;
  const int h = (int)c.by - b * H;
  const int kvh = h / (H / Hkv);
  ds_ia_row<T>(c, q, b * q_strides[0] + h * q_strides[1] + i * q_strides[2], q_strides[3],
               k, b * k_strides[0] + kvh * k_strides[1] + i * k_strides[2], k_strides[3], k_strides[4],
               v, b * v_strides[0] + kvh * v_strides[1] + i * v_strides[2], v_strides[3], v_strides[4],
               D, lens[i], scale[0], out, (((ds_i64)b * H + h) * W + i) * D, sq, sp, red);
"""
INPUTS, OUTPUTS = ("q", "k", "v", "lens", "scale"), ("out",)


def instance(lang: str) -> Instance:
    """q [B, H, w, D]; k / v [B, Hkv, w, L, D] (row i's keys, compacted, any strides); lens [w] int32."""
    launch = inv._CUDA_LAUNCH if lang == "cuda" else inv._METAL_LAUNCH
    return gpu_instance("ds_invariant_masked_attention", INPUTS, OUTPUTS, launch + _CALL, inv.BODY_FILES)


@functools.lru_cache(maxsize=None)
def _kernel(lang: str):
    return make_kernel(lang, instance(lang), ensure_row_contiguous=False)


class Rows:
    """What a [w, L] boolean mask lets each row see: per row its visible key positions in order."""

    def __init__(self, mask: mx.array):
        m = np.array(mask.astype(mx.bool_)).reshape(mask.shape[-2], mask.shape[-1])
        self.visible = [np.flatnonzero(r).astype(np.int32) for r in m]
        self.lens = [len(v) for v in self.visible]
        width = max(self.lens) if self.lens else 0
        pad = np.zeros((len(self.visible), max(width, 1)), dtype=np.int32)
        for i, v in enumerate(self.visible):
            pad[i, : len(v)] = v
        self.index = mx.array(pad)  # [w, Lmax]: row i's keys first, then padding (never read)
        self.lens_mx = mx.array(np.array(self.lens, dtype=np.int32))
        self.each = [mx.array(v) for v in self.visible]


_rows: dict = {}  # id(mask) -> (mask, Rows): sliding.py reuses a layout's mask array


def rows_of(mask: mx.array) -> Rows:
    hit = _rows.get(id(mask))
    if hit is None or hit[0] is not mask:
        if len(_rows) > 4096:
            _rows.clear()
        hit = _rows[id(mask)] = (mask, Rows(mask))
    return hit[1]


def supported(q: mx.array, k: mx.array, v: mx.array, mask) -> bool:
    """A boolean mask [w, L] (or with leading ones) over keys k [B, Hkv, L, D], w = q's queries."""
    return (
        isinstance(mask, mx.array)
        and mask.dtype == mx.bool_
        and mask.ndim >= 2
        and all(d == 1 for d in mask.shape[:-2])
        and mask.shape[-2] == q.shape[2]
        and mask.shape[-1] == k.shape[2]
        and inv.supported(q, k, v)
    )


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array) -> mx.array:
    rows = rows_of(mask)
    if min(rows.lens) == 0:  # a row that sees nothing: MLX's own (it defines that case)
        return inv._MLX_SDPA(q, k, v, scale=scale, mask=mask)
    path = inv.attention_path()
    if path in ("cuda", "metal"):
        return masked_gpu(q, k, v, scale, rows, path)
    forced = os.environ.get("MLX_DSPARK_KERNELS", "").strip().lower() == "reference"
    out = []
    for i, idx in enumerate(rows.each):
        qi, ki, vi = q[:, :, i : i + 1], mx.take(k, idx, axis=2), mx.take(v, idx, axis=2)
        if forced:
            out.append(inv.invariant_attention_reference(qi, ki, vi, scale))
        else:
            out.append(inv.one_row(qi, ki, vi, scale))
    return mx.concatenate(out, axis=2)


def compact(k: mx.array, rows: Rows) -> mx.array:
    """k [B, Hkv, L, D] -> [B, Hkv, w, Lmax, D]: row i's visible keys first, in order."""
    B, Hkv, _, D = k.shape
    w, lmax = rows.index.shape
    return mx.take(k, rows.index.reshape(-1), axis=2).reshape(B, Hkv, w, lmax, D)


def masked_gpu(q, k, v, scale: float, rows: Rows, lang: str = "cuda") -> mx.array:
    B, H, w, D = q.shape
    s = inv._scales.get(scale)
    if s is None:
        s = inv._scales[scale] = mx.array([scale], dtype=mx.float32)
    (out,) = _kernel(lang)(
        inputs=[q, compact(k, rows), compact(v, rows), rows.lens_mx, s],
        template=[("T", q.dtype)],
        grid=(w * inv.CHUNK, B * H, 1),
        threadgroup=(inv.CHUNK, 1, 1),
        output_shapes=[(B, H, w, D)],
        output_dtypes=[q.dtype],
    )
    return out
