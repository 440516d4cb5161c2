"""The JIT instances of the GPU kernel bodies: CUDA through mx.fast.cuda_kernel, Metal through
mx.fast.metal_kernel. Launch shapes and output layouts match gpu_source.py's launchers."""

from __future__ import annotations

import functools
import threading

import mlx.core as mx

from .gpu_source import (
    GA_CHUNK,
    GA_THREADS,
    SA_THREADS,
    SA_THREADS_METAL,
    cuda_instances,
    host_zeros,
    make_kernel,
    metal_instances,
)


@functools.lru_cache(maxsize=None)
def _kernel(lang: str, key: str):
    return make_kernel(lang, (cuda_instances() if lang == "cuda" else metal_instances())[key])


_placeholders: dict = {}
_chain: dict = {}  # (stream, size) -> the counts the next fused greedy launch uses
_chain_lock = threading.Lock()


def _draft_or_placeholder(draft: mx.array, B: int, k: int) -> mx.array:
    if k == 0:  # no draft: a cached one-element-per-row placeholder keeps the inputs non-empty
        z = _placeholders.get(B)
        if z is None:
            z = _placeholders[B] = host_zeros((B, 1), mx.int32)
        return z
    if draft.dtype != mx.int32:
        draft = draft.astype(mx.int32)
    return draft if draft.shape == (B, k) else draft.reshape(B, k)


def greedy_accept(logits: mx.array, draft: mx.array, lang: str = "cuda", fused: bool = True):
    """(target [B, w], accepted [B], bonus [B]) int32. CUDA: one launch (`fused`) or two."""
    B, w, V = logits.shape
    R = B * w
    nch = -(-V // GA_CHUNK)
    d = _draft_or_placeholder(draft, B, w - 1)
    shapes = [(B, w), (B,), (B,), (2 * R * nch,)]
    if lang == "cuda" and fused:
        size = max(16, 1 << (B - 1).bit_length())
        key = (str(mx.default_stream(mx.default_device())), size)
        with _chain_lock:
            cnt = _chain.get(key)
            if cnt is None:
                cnt = mx.zeros((size,), dtype=mx.int32)
            target, accepted, bonus, _, nxt = _kernel("cuda", "ga_fused")(
                inputs=[logits, d, cnt],
                template=[("CH", GA_CHUNK)],
                grid=(nch * GA_THREADS, R, 1),
                threadgroup=(GA_THREADS, 1, 1),
                output_shapes=shapes + [(size,)],
                output_dtypes=[mx.int32] * 5,
            )
            _chain[key] = nxt
        return target, accepted, bonus
    (part,) = _kernel(lang, "ga_partial")(
        inputs=[logits],
        template=[("CH", GA_CHUNK)],
        grid=(nch * GA_THREADS, R, 1),
        threadgroup=(GA_THREADS, 1, 1),
        output_shapes=shapes[3:],
        output_dtypes=[mx.int32],
    )
    dims = mx.array([B, w, V, nch], dtype=mx.int32)
    return tuple(
        _kernel(lang, "ga_finalize")(
            inputs=[part, d, dims],
            grid=(B * GA_THREADS, 1, 1),
            threadgroup=(GA_THREADS, 1, 1),
            output_shapes=shapes[:3],
            output_dtypes=[mx.int32] * 3,
        )
    )


def _f32(a: mx.array) -> mx.array:
    return a if a.dtype == mx.float32 else a.astype(mx.float32)


def _zeros(shape) -> mx.array:
    z = _placeholders.get(shape)
    if z is None:
        z = _placeholders[shape] = host_zeros(shape, mx.float32)
    return z


def sampling_accept(
    p: mx.array, q: mx.array | None, draft: mx.array, u: mx.array, u_bonus: mx.array, lang: str = "cuda"
):
    """(accepted [B], bonus [B]) int32; one threadgroup per batch element."""
    B, w, V = p.shape
    k = w - 1
    has_q = q is not None and k > 0
    nt = SA_THREADS if lang == "cuda" else SA_THREADS_METAL
    uu = _f32(u if u.shape == (B, k) else u.reshape(B, k)) if k > 0 else _zeros((B, 1))
    ub = _f32(u_bonus if u_bonus.shape == (B,) else u_bonus.reshape(B))
    accepted, bonus = _kernel(lang, "sa")(
        inputs=[_f32(p), _f32(q) if has_q else _zeros((1,)), _draft_or_placeholder(draft, B, k), uu, ub],
        template=[("HAS_Q", has_q)],
        grid=(B * nt, 1, 1),
        threadgroup=(nt, 1, 1),
        output_shapes=[(B,), (B,)],
        output_dtypes=[mx.int32, mx.int32],
    )
    return accepted, bonus
