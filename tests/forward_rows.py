"""Test helper: where a target forward stops being width-invariant (used by the GPU kernel-path
tests to say which op moved when the load's self-check refused the kernels)."""

from __future__ import annotations

import mlx.core as mx
import pytest


def first_moving_op(target, n_prefix: int = 23, n_cont: int = 6) -> str:
    """Where a forward stops being width-invariant: the first op (the linears and attention the
    kernel path routes, and the norms and RoPE between them) whose row i in a width-n_cont forward
    differs from its output in the width-1 step of token i, over the self-check's prefix."""
    from mlx_dspark.kernels import invariant, invariant_gather, invariant_linear

    log: list = []

    def hook(label, fn):
        def wrapped(*a, **k):
            y = fn(*a, **k)
            if y is not None:
                log.append((label, y))
            return y

        return wrapped

    vocab = max(target.vocab_size, 2)
    ids = mx.array([[(31 * i + 7) % vocab for i in range(n_prefix + n_cont)]], dtype=mx.int32)

    def run(widths):
        cache = target.make_cache()
        mx.eval(target.forward(ids[:, :n_prefix], cache, last_only=True).logits)
        ops, at = [], n_prefix
        for w in widths:
            log.clear()
            logits = target.forward(ids[:, at : at + w], cache).logits
            mx.eval(logits, [y for _, y in log])
            ops.append(list(log) + [("logits", logits)])
            at += w
        return ops

    with pytest.MonkeyPatch.context() as m:
        m.setattr(target, "rollback_refusal", None)  # a wide forward is what is being diagnosed
        m.setattr(invariant_linear, "call", hook("linear", invariant_linear.call))
        m.setattr(invariant_gather, "call", hook("experts", invariant_gather.call))
        m.setattr(invariant, "invariant_attention", hook("attention", invariant.invariant_attention))
        m.setattr(mx.fast, "rms_norm", hook("rms_norm", mx.fast.rms_norm))
        m.setattr(mx.fast, "rope", hook("rope", mx.fast.rope))
        steps, again, (block,) = run([1] * n_cont), run([1] * n_cont), run([n_cont])
    if not all(mx.array_equal(a[-1][1], b[-1][1]).item() for a, b in zip(steps, again)):
        return "two runs of the same width-1 steps differ: the forward is not deterministic"
    if len(block) != len(steps[0]):
        return f"the width-{n_cont} forward runs {len(block)} ops, a step {len(steps[0])}"
    for k, (label, y) in enumerate(block):
        for i in range(n_cont):
            if not mx.array_equal(y[..., i : i + 1, :], steps[i][k][1]).item():
                return f"op {k} of {len(block)} ({label}, output {tuple(y.shape)}) first differs, at row {i}"
    return "no op's rows differ here (the self-check's other layout, or a nondeterministic forward)"
