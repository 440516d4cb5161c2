"""Ops with a native path and a pure-MLX reference, picked per backend.

  greedy_accept     native primitive (CPU; Metal metallib on Apple GPUs), CUDA instance of the
                    GPU body (mx.fast.cuda_kernel) on CUDA in a long-lived process, the
                    reference otherwise.
  sampling_accept   same paths.
  prefill_context   dequantize-once wide GEMM for quantized targets (pure MLX; wide_gemm.py).

`MLX_DSPARK_KERNELS=reference` forces the references everywhere; `=jit` takes the runtime-compiled
instances: mx.fast.metal_kernel on Metal instead of the metallib, and the CUDA instance in every
process (by default only a process that said `expect_long_run()`, the server, compiles them on
CUDA). Each kernel of a non-reference path is checked once per process against its reference on
a small random input before its first use; a kernel that fails (compile error, wrong answer) is
dropped with one warning and its reference used. Checked per kernel, not per path: on CUDA each
kernel is an NVRTC compile of ~2.5 s (H200), and a greedy generation never needs the sampling one.
"""

from __future__ import annotations

import os
import threading
import warnings

import mlx.core as mx

from . import native as _native
from .reference import greedy_accept_reference, sampling_accept_reference
from .wide_gemm import policy as wide_gemm_policy
from .wide_gemm import prefill_context

_FLOATS = (mx.float32, mx.float16, mx.bfloat16)
GPU_MAX_W = 128  # widest verify block the GPU kernels take

_checked: dict[tuple[str, str], bool] = {}  # (path, kernel) -> passed its self-check
_check_lock = threading.Lock()


def _backend() -> str:
    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.cuda.is_available():
        return "cuda"
    if mx.metal.is_available():
        return "metal"
    return "gpu"


_long_lived = False


def expect_long_run(on: bool = True) -> None:
    """Say that this process serves for long (`serve` does): on CUDA the accept kernels are
    runtime-compiled (NVRTC, ~2.5 s each on the H200, not kept across processes by MLX 0.32) to
    save ~20 us (greedy) / ~0.65 ms (sampling) a round, which only a long-lived process earns
    back; one-shot runs take the references there unless MLX_DSPARK_KERNELS=jit."""
    global _long_lived
    _long_lived = on
    _routes.clear()


def _path(warn: bool = True) -> str:
    """The path both accept kernels take on the default device (before the self-check)."""
    mode = _native.kernels_mode()
    if mode == "reference":
        return "reference"
    backend = _backend()
    if backend == "cuda":
        return "cuda" if mode == "jit" or _long_lived else "reference"
    if backend == "metal":
        if mode == "jit":
            return "metal-jit"
        mod = _native.ext(warn)
        return "native-metal" if mod is not None and mod.has_metal else "reference"
    if backend == "cpu":
        return "native-cpu" if _native.ext(warn) is not None else "reference"
    return "reference"


def _call(path: str, kernel: str, *args):
    if path == "native-cpu" or path == "native-metal":
        fn = getattr(_native.ext(warn=False), kernel)
        return tuple(fn(*args, stream=mx.cpu if path == "native-cpu" else mx.gpu))
    from . import gpu

    return getattr(gpu, kernel)(*args, lang="cuda" if path == "cuda" else "metal")


def _check_inputs(kernel: str) -> tuple:
    """Small random inputs of `kernel` with rejections at different points in its two rows."""
    k1, k2, k3 = mx.random.split(mx.random.key(7), 3)
    lg = mx.random.normal((2, 5, 3001), key=k1)
    d = mx.argmax(lg, axis=-1)[:, :4].astype(mx.int32)
    d = mx.where(mx.arange(4)[None] == mx.array([[2], [4]]), 0, d)
    if kernel == "greedy_accept":
        return ((lg, d),)
    p = mx.softmax(lg, axis=-1)
    q = mx.softmax(mx.random.normal((2, 4, 3001), key=k2), axis=-1)
    u = mx.random.uniform(shape=(2, 4), key=k3)
    ub = mx.array([0.3, 0.9])
    return tuple((p, qq, d, u, ub) for qq in (q, None))


_REFERENCES = {"greedy_accept": greedy_accept_reference, "sampling_accept": sampling_accept_reference}


def _self_check(path: str, kernel: str) -> bool:
    """Run `kernel` of `path` once against its reference; False (and one warning) if not equal."""
    with _check_lock:
        if (path, kernel) in _checked:
            return _checked[(path, kernel)]
        try:
            got, want = (), ()
            for args in _check_inputs(kernel):
                got += tuple(_call(path, kernel, *args))
                want += tuple(_REFERENCES[kernel](*args))
            mx.eval(got, want)
            ok = all(mx.array_equal(a, b).item() for a, b in zip(got, want))
            why = "its results differ from the reference"
        except Exception as e:  # a kernel that does not compile or launch
            ok, why = False, f"{type(e).__name__}: {e}"
        if not ok:
            warnings.warn(
                f"mlx-dspark: the {path} {kernel} kernel failed its self-check ({why}); using the pure-MLX reference",
                _native.NativeFallbackWarning,
                stacklevel=4,
            )
        _checked[(path, kernel)] = ok
        return ok


_routes: dict = {}  # (kernel, MLX_DSPARK_KERNELS, default device is CPU) -> checked path


def _route(kernel: str) -> str:
    """The checked path of `kernel` on the default device, cached (the accept kernels run every round)."""
    key = (kernel, os.environ.get("MLX_DSPARK_KERNELS"), mx.default_device() == mx.cpu)
    path = _routes.get(key)
    if path is None:
        path = _path()
        if path != "reference" and not _self_check(path, kernel):
            path = "reference"
        _routes[key] = path
    return path


def _choose(kernel: str, w: int, dtype) -> str:
    path = _route(kernel)
    if path == "reference" or dtype not in _FLOATS or (w > GPU_MAX_W and path != "native-cpu"):
        return "reference"
    return path


def kernel_paths() -> dict:
    """Which path each kernel takes on the default device (for `doctor`)."""
    path = _path(warn=False)
    if path == "reference" and _backend() == "cuda" and _native.kernels_mode() == "auto":
        path = "reference (CUDA compiles the kernels in `serve`, or with MLX_DSPARK_KERNELS=jit)"

    def shown(kernel: str) -> str:
        return "reference (self-check failed)" if _checked.get((path, kernel)) is False else path

    wg = wide_gemm_policy()
    from . import invariant

    ext = _native.ext(warn=False)
    cpu_native = mx.default_device() == mx.cpu and ext is not None
    attention = invariant.attention_path()
    if attention == "reference" and mx.default_device() == mx.cpu:
        attention = {
            "native": "native-cpu (float32)",
            "rows": "rows (MLX's attention, one call per row)",
            "reference": "reference",
        }[invariant.cpu_route()]
    return {
        "backend": _backend(),
        "greedy_accept": shown("greedy_accept"),
        "sampling_accept": shown("sampling_accept"),
        "decode_attention": attention,
        "draft_ops": f"native-cpu ({ext.draft_ops_isa()})" if cpu_native else "MLX's ops",
        "draft_products": _draft_products(ext) if cpu_native else "MLX's matmul",
        "target_rope_norms": _target_ops(ext) if cpu_native else "MLX's ops",
        "wide_gemm": (
            f"on (>= {wg['min_rows']} rows, {wg['compute']} GEMM): {wg['why']}"
            if wg["enabled"]
            else f"off: {wg['why']}"
        ),
    }


def _target_ops(ext) -> str:
    """What a target's decode forward on the CPU runs for RoPE and RMS norms (kernels/target_ops.py)."""
    from . import target_ops

    if not hasattr(ext, "rope"):
        return "MLX's ops (the extension predates the native RoPE)"
    return "native-cpu (float32)" if target_ops.enabled() else "MLX's ops (MLX_DSPARK_TARGET_OPS=off)"


def _draft_products(ext) -> str:
    """How a drafter pass multiplies its float32 weights on the CPU (kernels/native_products.py)."""
    from . import native_products

    if not hasattr(ext, "draft_linear"):
        return "native-cpu float32 row kernel"
    if not native_products.panels_on():
        return "native-cpu float32 row kernel (MLX_DSPARK_DRAFT_PANELS=off)"
    return f"native-cpu float16 panels ({ext.draft_linear_isa()})"


def greedy_accept(logits: mx.array, draft: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Greedy verify-and-accept, one kernel.

    logits [B, w, V] float32/float16/bfloat16 (row j predicts the token after position j),
    draft [B, w-1] int32. Returns (target_tokens [B, w], accepted [B], bonus [B]), int32:
    target_tokens = argmax of each row in mx.argmax order (NaN first, then the largest value,
    first index on ties), accepted = length of the prefix where draft[b, j] == target[b, j],
    bonus = target_tokens[b, accepted[b]]. Exactly greedy_accept_reference.
    """
    B, w, V = logits.shape
    path = _choose("greedy_accept", w, logits.dtype)
    if path == "reference" or B * w * V == 0 or (path != "native-cpu" and B * w > 65535):
        return greedy_accept_reference(logits, draft)
    return _call(path, "greedy_accept", logits, draft)


def sampling_accept(
    p: mx.array, q: mx.array | None, draft: mx.array, u: mx.array, u_bonus: mx.array
) -> tuple[mx.array, mx.array]:
    """Speculative-sampling accept (lossless sampling), one kernel per batch row.

    Inputs (B batch rows, k = w - 1 drafted tokens, V vocabulary):
      p        [B, w, V] float32: the target's processed distribution per verify row (row j is
               the distribution of the token after position j; any truncation/temperature
               already applied; need not sum to 1; values are clamped to [0, 1]).
      q        [B, k, V] float32, the drafter's distribution that draft[:, j] was sampled from;
               or None for deterministic proposals (lookup): q_j is one-hot at draft[:, j].
      draft    [B, k] int32, the drafted tokens.
      u        [B, k] float32 uniforms in [0, 1), one per draft, independent of the drafter's.
      u_bonus  [B] float32 uniform in [0, 1) for the bonus draw.
    Returns (accepted [B], bonus [B]) int32:
      accepted = a, the number of leading drafts accepted: draft j is accepted iff
               u[j] * q_j(d_j) < p_j(d_j), computed in float32 (q_j(d_j) = 1 when q is None;
               q_j(d_j) = 0 accepts iff p_j(d_j) > 0; a token outside [0, V) is rejected);
               a is the first rejected j, or k when all are accepted.
      bonus  = the token after the accepted drafts, drawn by inverse CDF with u_bonus from
               x = max(p_a - q_a, 0) if a < k (q_a = one-hot(d_a) when q is None), falling
               back to x = p_a when that residual's mass is <= 1e-8; x = p_k if a == k.
    Inverse CDF, exactly: masses are integers m_i = floor(clamp(x_i, 0, 1) * 2^40) (NaN -> 0),
    M = sum(m) (the residual "mass <= 1e-8" test is M <= floor(1e-8 * 2^40) = 10995),
    U = min(floor(u_bonus * 2^24), 2^24 - 1), T = floor(M * U / 2^24), and bonus is the
    smallest i with m_0 + ... + m_i > T (a token of zero mass is never returned). If M == 0,
    bonus = argmax(p_a). Integer sums make every backend return the same token; the draw
    differs from the float CDF only by the 2^-40 quantization of each probability.
    Exactly sampling_accept_reference.
    """
    B, w, V = p.shape
    path = _choose("sampling_accept", w, mx.float32)
    if path == "reference" or B * w * V == 0:
        return sampling_accept_reference(p, q, draft, u, u_bonus)
    return _call(path, "sampling_accept", p, q, draft, u, u_bonus)


def native_status() -> dict:
    """What `doctor` shows: is the extension loaded, why not, and each kernel's path here."""
    return {**_native.load_status(), "kernels": kernel_paths()}


def reset() -> None:
    """Forget the extension's load attempt and the routes chosen (tests)."""
    from . import invariant_linear

    _native.forget()
    _routes.clear()
    _checked.clear()
    invariant_linear.reset()


__all__ = [
    "native_status",
    "reset",
    "expect_long_run",
    "greedy_accept",
    "greedy_accept_reference",
    "kernel_paths",
    "prefill_context",
    "sampling_accept",
    "sampling_accept_reference",
    "wide_gemm_policy",
]
