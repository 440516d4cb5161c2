"""Width-invariant decoding: a verify round, a plain step and plain decoding give bit-identical
logits and write bit-identical KV entries.

Why rows differ at all: a GPU (and OpenBLAS on a CPU) picks its matmul, quantized-matmul and
attention kernels by shape, so the same row computed inside a width-8 verify forward and alone in
a width-1 step goes through different reduction orders, and a near-tie in the logits can flip
(measured on the H200: 12 of 15 prompts). Two ways to remove the dependence, tried in this order:

  * kernels (the default where the native forward is not invariant): every decode forward (plain
    step, verify round, the prompt's last token) runs at its real width, with the linear layers
    and the lm_head computed by kernels/invariant_linear.py (each row reduces in one fixed order
    that never looks at the number of rows; MLX's own single-row kernels batched over the rows
    are not invariant on CUDA: measured) and attention over the cache by kernels/invariant.py
    (each query row reduces over its own causal keys in fixed chunks). A plain step reads each
    weight once, as a gemv does. On a GPU each of these forwards runs as a compiled graph
    (models/compiled_decode.py): the load's self-check below proves that graph.
  * fixed width (the fallback, e.g. for a layer kind the kernels do not take): every decode forward
    runs at ONE width W, padded with copies of its last token (the pad positions are written to
    the cache and trimmed off at once), so every op always sees M = W; attention still runs the
    invariant op. Exact, but a plain step pays for a width-W forward.

Norms, RoPE and elementwise ops are row-wise; the load self-check below proves the whole forward,
it does not assume any of this. Prefill (all prompt tokens but the last) keeps MLX's fast kernels:
every mode shares it.

Which path a target gets is decided once at load by `choose()`, by measurement: the native
forward where it is already width-invariant (CPU float32), unless on the CPU the kernels pass too
and are clearly faster (timed: MLX's bundled reference BLAS); otherwise the kernels, if they pass;
otherwise fixed width, if it passes; otherwise the native one with a warning that the drafting
modes may differ from plain decoding.
MLX_DSPARK_INVARIANT=auto (default) | kernels | fixed | force (= fixed, no check) | off.
MLX_DSPARK_DECODE_WIDTH=W (default 16) for the fixed-width path.
"""

from __future__ import annotations

import os
import warnings

import mlx.core as mx

from . import compiled_decode

DEFAULT_WIDTH = 16


def decode_width() -> int:
    raw = os.environ.get("MLX_DSPARK_DECODE_WIDTH", "").strip()
    try:
        return max(int(raw), 1) if raw else DEFAULT_WIDTH
    except ValueError:
        return DEFAULT_WIDTH


def setting() -> str:
    raw = os.environ.get("MLX_DSPARK_INVARIANT", "auto").strip().lower()
    return raw if raw in ("auto", "kernels", "fixed", "force", "off") else "auto"


def fixed_width_ok(cache: list) -> bool:
    """Pad positions can be written and trimmed off: every layer has mlx-lm's plain KV cache."""
    return all(type(c).__name__ in ("KVCache", "QuantizedKVCache") for c in cache)


def forward_fixed(target, tokens: mx.array, cache: list, taps, width: int):
    """target's forward of tokens [B, w], run as ceil(w / width) blocks of exactly `width`
    positions (the last one padded with its last token); returns (logits, hidden)."""
    from ..kernels import invariant

    w = tokens.shape[1]
    logits, hidden = [], []
    for s in range(0, w, width):
        blk = tokens[:, s : s + width]
        n = blk.shape[1]
        if n < width:
            blk = mx.concatenate([blk, mx.repeat(blk[:, -1:], width - n, axis=1)], axis=1)
        with invariant.active():
            out = target._forward_native(blk, cache, taps, False)
        if n < width:
            target.trim(cache, width - n)
        logits.append(out.logits[:, :n])
        if out.hidden is not None:
            hidden.append(out.hidden[:, :n])
    cat = lambda xs: xs[0] if len(xs) == 1 else mx.concatenate(xs, axis=1)
    return cat(logits), (cat(hidden) if hidden else None)


def rows_match(target, n_prefix: int = 23, n_cont: int = 6) -> bool:
    """Plain steps, one verify block and a split block over the same prefix give bitwise equal
    logits (the split block's second half also reads the KV its first half wrote). The prefix is
    prefilled once and each variant starts from it after a trim, as verify rounds do (a cache
    that cannot trim that far is prefilled again): on MLX's reference BLAS a prefill costs seconds."""
    vocab = max(target.vocab_size, 2)
    ids = mx.array([[(31 * i + 7) % vocab for i in range(n_prefix + n_cont)]], dtype=mx.int32)
    prefix, cont = ids[:, :n_prefix], ids[:, n_prefix:]
    cache = None

    def prefilled():
        nonlocal cache
        # (recurrent and sliding-window layers roll back only their last forward: prefill again)
        if cache is not None and target.can_trim(cache, n_cont) and not any(hasattr(c, "rewind") for c in cache):
            target.trim(cache, target.cache_len(cache) - n_prefix)
            return cache
        cache = target.make_cache()
        mx.eval(target.forward(prefix, cache, last_only=True).logits)
        return cache

    a = prefilled()
    steps = mx.concatenate([target.forward(cont[:, j : j + 1], a).logits for j in range(n_cont)], axis=1)
    mx.eval(steps)
    b = prefilled()
    block = target.forward(cont, b).logits
    mx.eval(block)
    c = prefilled()
    half = n_cont // 2 + 1
    split = mx.concatenate([target.forward(cont[:, :half], c).logits, target.forward(cont[:, half:], c).logits], axis=1)
    mx.eval(split)
    return bool(mx.array_equal(steps, block).item()) and bool(mx.array_equal(steps, split).item())


_warned: set = set()


def _verdict_key(target, mode: str) -> dict:
    """Everything the verdict depends on: the software, the device (and BLAS), the architecture
    and precision of the weights, and the settings."""
    from .._version import __version__
    from ..blas import active_blas
    from ..kernels import native
    from ..machine import device_name
    from .precision import weights_summary

    tc = target.config.get("text_config", target.config)
    dtypes, quant = weights_summary(target.model)
    return {
        "v": 5,  # 3: the CPU may choose the kernels where they are faster; 4: compiled decode steps; 5: kernel prefill
        "mlx": mx.__version__,
        "mlx_dspark": __version__,
        "native_ext": native.ext(warn=False) is not None,
        "device": device_name(),
        "blas": active_blas()["name"] if mx.default_device() == mx.cpu else None,
        "config": {k: v for k, v in sorted(tc.items()) if isinstance(v, (int, float, str, bool, type(None)))},
        "dtypes": dtypes,
        "quant": quant,
        "kv_bits": target.kv_bits,
        "dense_products": getattr(target, "dense_products", []),
        "mode": mode,
        "width": decode_width(),
        "env": {
            k: os.environ.get(k, "")
            for k in ("MLX_DSPARK_KERNELS", "MLX_DSPARK_GDN_KERNEL", "MLX_DSPARK_IL_KERNEL", "MLX_DSPARK_COMPILE")
        },
    }


def _verdict_file(key: dict):
    from ..paths import fact_file

    return fact_file("invariance", key)


def _cached_verdict(key: dict) -> str | None:
    from ..paths import read_fact

    verdict = read_fact("invariance", key)
    return verdict if verdict in VERDICTS else None


def _store_verdict(key: dict, verdict: str) -> None:
    from ..paths import write_fact

    write_fact("invariance", key, verdict)


VERDICTS = ("native", "kernels", "kernels+prefill", "fixed-width", "none")


def choose(target) -> str:
    """Decide the decode path by measurement (target.invariant_kernels, target.decode_width); return
    the verdict: native | kernels | fixed-width | forced | off | none (no invariant path: drafting
    modes may differ). The measured verdict is kept on disk ($MLX_DSPARK_CACHE/invariance, keyed by
    the software, device, BLAS, architecture, precision and settings) and reused at the next load;
    MLX_DSPARK_INVARIANT_CACHE=refresh measures again, =off neither reads nor writes it."""
    mode = setting()
    _disable(target)
    if mode == "off":
        return "off"
    if mode == "force":
        _enable_fixed(target)
        return "forced"
    cache = os.environ.get("MLX_DSPARK_INVARIANT_CACHE", "auto").strip().lower()
    key = _verdict_key(target, mode) if cache != "off" else None
    verdict = _cached_verdict(key) if cache == "auto" else None
    if verdict is not None:
        _apply(target, verdict)
        return verdict
    verdict = _measure(target, mode)
    if key is not None:
        _store_verdict(key, verdict)
    return verdict


def _apply(target, verdict: str) -> None:
    if verdict in ("kernels", "kernels+prefill"):
        _enable_kernels(target)
        target.kernel_prefill = verdict == "kernels+prefill"
    elif verdict == "fixed-width":
        _enable_fixed(target)
    elif verdict == "none":
        _warn_none(target)


def _measure(target, mode: str) -> str:
    if mode == "auto" and rows_match(target):
        if not _kernels_pay_on_cpu(target):
            return "native"
        target.kernel_prefill = _kernels_prefill_faster(target)
        return "kernels+prefill" if target.kernel_prefill else "kernels"
    if mode in ("auto", "kernels"):
        _enable_kernels(target)
        if rows_match(target):
            return "kernels"
        _disable(target)
    if mode in ("auto", "fixed") and fixed_width_ok(target.make_cache()):
        _enable_fixed(target)
        if rows_match(target):
            return "fixed-width"
        _disable(target)
    _warn_none(target)
    return "none"


# Where the native forward is invariant already (CPU float32), the kernels path is the other exact
# choice; on MLX's bundled reference BLAS the C++ invariant linear (csrc/invariant_linear.cpp) runs a
# decode forward about 2x faster than the BLAS (bench/results/invariance-cpu.md), with OpenBLAS it
# may not. So it is timed here, once per verdict, and taken only where it is clearly faster.
KERNELS_MARGIN = 0.85  # kernels' time / native's at most this
KERNELS_MIN_PARAMS = 20_000_000  # below it a forward costs milliseconds either way: not timed


def _kernels_pay_on_cpu(target) -> bool:
    from mlx.utils import tree_flatten

    from ..kernels import invariant_linear

    if mx.default_device() != mx.cpu or invariant_linear.linear_path() != "native":
        return False
    if sum(v.size for _, v in tree_flatten(target.model.parameters())) < KERNELS_MIN_PARAMS:
        return False
    native_s = _forward_cost(target)
    _enable_kernels(target)
    try:
        if rows_match(target) and _forward_cost(target) <= KERNELS_MARGIN * native_s:
            return True
    except Exception:  # a kernels forward that fails here is simply not taken
        pass
    _disable(target)
    return False


def _kernels_prefill_faster(target, n: int = 32) -> bool:
    """Whether a prompt prefills faster through the invariant kernels than through MLX's matmuls,
    timed on `n` tokens after a short warm-up of each. On MLX's bundled reference BLAS the kernels
    prefill ~10x faster (a native run there costs seconds, so it is repeated only when the call is
    close); with OpenBLAS they are slower at prompt widths, and prefill stays native."""
    import time

    vocab = max(target.vocab_size, 2)
    ids = mx.array([[(13 * i + 5) % vocab for i in range(n)]], dtype=mx.int32)

    def timed(through_kernels: bool, width: int) -> float:
        target.kernel_prefill = through_kernels
        t0 = time.perf_counter()
        mx.eval(target.forward(ids[:, :width], target.make_cache(), last_only=True).logits)
        return time.perf_counter() - t0

    try:
        timed(True, 8), timed(False, 8)
        t_kernels = min(timed(True, n), timed(True, n))
        t_native = timed(False, n)
        if 0.5 * KERNELS_MARGIN * t_native < t_kernels <= KERNELS_MARGIN * t_native:
            t_native = min(t_native, timed(False, n))  # close: one more native run
    finally:
        target.kernel_prefill = False
    return t_kernels <= KERNELS_MARGIN * t_native


def _forward_cost(target, n_prefix: int = 8, widths: tuple = (1, 4), reps: int = 3) -> float:
    """Seconds of one decode forward at each of `widths` over a short cache (best of `reps`), summed.
    (A short prefix: the prefill is not what is timed, and on MLX's reference BLAS it is slow.)"""
    import time

    vocab = max(target.vocab_size, 2)
    ids = mx.array([[(17 * i + 3) % vocab for i in range(n_prefix + max(widths))]], dtype=mx.int32)
    cache = target.make_cache()
    mx.eval(target.forward(ids[:, :n_prefix], cache, last_only=True).logits)
    total = 0.0
    for w in widths:
        best = float("inf")
        for _ in range(reps + 1):  # the first one warms up
            t0 = time.perf_counter()
            mx.eval(target.forward(ids[:, n_prefix : n_prefix + w], cache).logits)
            best = min(best, time.perf_counter() - t0)
            target.trim(cache, w)
        total += best
    return total


def _warn_none(target) -> None:
    key = (str(mx.default_device()), target.model_type, target.kv_bits)
    if key not in _warned:
        _warned.add(key)
        what = "with a quantized KV cache (--kv-bits) " if target.kv_bits else ""
        warnings.warn(
            f"{target.model_type} on {mx.default_device()} {what}does not compute a verify row with the same "
            "arithmetic as a plain step: the drafting modes may differ from --mode baseline (near-ties "
            "can flip); baseline is exact",
            stacklevel=4,
        )


PATHS = ("native", "kernels", "fixed")


def path_of(target) -> str:
    """native | kernels | fixed: the decode path the target runs now."""
    return "kernels" if target.invariant_kernels else "fixed" if target.decode_width else "native"


def set_path(target, path: str) -> None:
    """Switch the target's decode path without a check (benchmarks compare them on one model)."""
    if path not in PATHS:
        raise ValueError(f"decode path {path!r}: expected one of {', '.join(PATHS)}")
    _disable(target)
    if path == "kernels":
        _enable_kernels(target)
    elif path == "fixed":
        _enable_fixed(target)


def _disable(target) -> None:
    target.decode_width = 0
    target.invariant_kernels = False
    target.kernel_prefill = False
    target.compiled_decode = None


def _enable_kernels(target) -> None:
    from ..compat import (
        route_causal_attention_to_invariant_op,
        route_linears_to_invariant_op,
        route_target_norm_and_rope,
    )
    from ..kernels import invariant_linear

    route_causal_attention_to_invariant_op()
    route_linears_to_invariant_op()
    route_target_norm_and_rope()  # the CPU's decode forward: RoPE and RMS norms as one op each
    invariant_linear.group_siblings(target.model)  # q/k/v and gate/up: one launch each on a GPU
    target.invariant_kernels = True
    compiled_decode.attach(target)


def _enable_fixed(target) -> None:
    from ..compat import route_causal_attention_to_invariant_op

    route_causal_attention_to_invariant_op()
    target.decode_width = decode_width()


def forward_kernels(target, tokens: mx.array, cache: list, taps):
    """target's forward at its real width with the invariant linears and attention: the compiled
    graph of that width (models/compiled_decode.py) where the target has one and the cache is the
    plain KV cache it takes, else built op by op."""
    from ..kernels import invariant

    compiled = target.compiled_decode
    if compiled is not None and compiled_decode.cache_fits(cache, tokens):
        return compiled(tokens, cache, taps)
    with invariant.active():
        out = target._forward_native(tokens, cache, taps, False)
    return out.logits, out.hidden
