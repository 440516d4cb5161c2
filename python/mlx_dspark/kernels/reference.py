"""Pure-MLX references of every kernel. They define the semantics the native paths must match."""

from __future__ import annotations

import mlx.core as mx


def greedy_accept_reference(logits: mx.array, draft: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Greedy verify-and-accept.

    logits [B, w, V] (row i predicts the token after position i), draft [B, w-1] int32.
    Returns (target_tokens [B, w] int32, accepted [B] int32, bonus [B] int32):
    target_tokens = argmax per row (first index on ties), accepted = length of the prefix where
    draft[j] == target_tokens[j], bonus = target_tokens[accepted].
    """
    target = mx.argmax(logits, axis=-1).astype(mx.int32)
    w = logits.shape[1]
    if w > 1:
        match = (draft.astype(mx.int32) == target[:, : w - 1]).astype(mx.int32)
        accepted = mx.sum(mx.cumprod(match, axis=1), axis=1).astype(mx.int32)
    else:
        accepted = mx.zeros((logits.shape[0],), dtype=mx.int32)
    bonus = mx.take_along_axis(target, accepted[:, None], axis=1)[:, 0]
    return target, accepted, bonus


# ------------------------------------------------------------------------ sampling accept
RESID_MIN_UNITS = 10995  # floor(1e-8 * 2**40): a residual with no more mass than this -> p_a
MASS_SCALE = float(2**40)  # masses are integers in units of 2**-40


def _mass(x: mx.array) -> mx.array:
    """(int64)(clamp(x, 0, 1) * 2**40), NaN -> 0; exact (a power-of-two scale, then truncation)."""
    x = mx.where(x > 0, x, 0.0)
    x = mx.where(x < 1, x, 1.0)
    return (x * MASS_SCALE).astype(mx.int64)


def sampling_accept_reference(
    p: mx.array, q: mx.array | None, draft: mx.array, u: mx.array, u_bonus: mx.array
) -> tuple[mx.array, mx.array]:
    """Speculative-sampling accept. Defines the semantics of `kernels.sampling_accept`.

    See `kernels.sampling_accept` for the full contract (shapes, rule, integer inverse CDF)."""
    B, w, V = p.shape
    k = w - 1
    p = p.astype(mx.float32)
    if q is not None:
        q = q.astype(mx.float32)
    if k > 0:
        d = draft.astype(mx.int32).reshape(B, k)
        valid = (d >= 0) & (d < V)
        dc = mx.clip(d, 0, V - 1)[..., None]
        pd = mx.where(valid, mx.take_along_axis(p[:, :k], dc, axis=-1)[..., 0], 0.0)
        if q is None:
            qd = mx.where(valid, 1.0, 0.0)
        else:
            qd = mx.where(valid, mx.take_along_axis(q, dc, axis=-1)[..., 0], 0.0)
        ok = (u.astype(mx.float32).reshape(B, k) * qd < pd).astype(mx.int32)
        accepted = mx.sum(mx.cumprod(ok, axis=1), axis=1).astype(mx.int32)
    else:
        accepted = mx.zeros((B,), dtype=mx.int32)

    pa = mx.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]  # [B, V]
    m_p = _mass(pa)
    if k > 0:
        a_c = mx.minimum(accepted, k - 1)
        if q is None:
            da = mx.take_along_axis(d, a_c[:, None], axis=1)  # [B, 1]
            qa = (mx.arange(V)[None] == da).astype(mx.float32)
        else:
            qa = mx.take_along_axis(q, a_c[:, None, None], axis=1)[:, 0]
        m_r = _mass(pa - qa)
        use_r = (accepted < k) & (mx.sum(m_r, axis=-1) > RESID_MIN_UNITS)
        m = mx.where(use_r[:, None], m_r, m_p)
    else:
        m = m_p
    cs = mx.cumsum(m, axis=-1)
    M = cs[:, -1]
    ubf = u_bonus.astype(mx.float32).reshape(B) * float(2**24)
    U = mx.where(ubf > 0, mx.where(ubf < 16777215.0, ubf, 16777215.0), 0.0).astype(mx.int64)
    T = mx.right_shift(M, 24) * U + mx.right_shift(mx.bitwise_and(M, 0xFFFFFF) * U, 24)
    pick = mx.argmax((cs > T[:, None]).astype(mx.int32), axis=-1)
    bonus = mx.where(M > 0, pick, mx.argmax(pa, axis=-1)).astype(mx.int32)
    return accepted, bonus
