"""The native extension `mlx_dspark._ext`, or the reason it is not used.

`ext()` returns the loaded module or None. The first time it is None, one warning line says why
and that the pure-MLX kernels are used instead (NativeFallbackWarning). `kernels.native_status()`
is what `mlx-dspark doctor` prints. `MLX_DSPARK_KERNELS=reference` skips the extension altogether.
"""

from __future__ import annotations

import importlib
import os
import threading
import warnings

REBUILD_HINT = "pip install --no-build-isolation --force-reinstall --no-deps ."


class NativeFallbackWarning(RuntimeWarning):
    """The native kernels are unavailable; pure-MLX paths are used."""


_lock = threading.Lock()
_state: dict = {"tried": False, "ext": None, "reason": None, "warned": False}


def kernels_mode() -> str:
    """MLX_DSPARK_KERNELS: auto (default) | reference | jit (the runtime-compiled instances: Metal's
    mx.fast.metal_kernel, and CUDA's in every process, not only a long-lived one)."""
    mode = os.environ.get("MLX_DSPARK_KERNELS", "auto").strip().lower() or "auto"
    if mode not in ("auto", "reference", "jit"):
        raise ValueError(f"MLX_DSPARK_KERNELS={mode!r}: expected auto, reference or jit")
    return mode


def _load():
    try:
        import mlx.core as mx

        _ext = importlib.import_module("mlx_dspark._ext")
    except Exception as e:  # ImportError, or OSError from a libmlx that does not match
        return None, f"mlx_dspark._ext is not importable ({type(e).__name__}: {e})"
    built = getattr(_ext, "mlx_version", "?")
    if built != mx.__version__:
        return None, (
            f"mlx_dspark._ext was built against MLX {built} but MLX {mx.__version__} is "
            f"installed; rebuild it: {REBUILD_HINT}"
        )
    return _ext, None


def ext(warn: bool = True):
    """The native module, or None (warning once, when `warn`, why not)."""
    if _state["ext"] is not None:  # the fast path: loaded (and not forced off below)
        if os.environ.get("MLX_DSPARK_KERNELS", "").strip().lower() != "reference":
            return _state["ext"]
    if kernels_mode() == "reference":
        return None
    with _lock:
        if not _state["tried"]:
            _state["ext"], _state["reason"] = _load()
            _state["tried"] = True
        if _state["ext"] is None and warn and not _state["warned"]:
            _state["warned"] = True
            warnings.warn(
                f"mlx-dspark: native kernels unavailable, using pure-MLX kernels: {_state['reason']}",
                NativeFallbackWarning,
                stacklevel=3,
            )
        return _state["ext"]


def forget() -> None:
    """Forget the load attempt (tests; kernels.reset() also forgets the routes chosen)."""
    with _lock:
        _state.update(tried=False, ext=None, reason=None, warned=False)


def load_status() -> dict:
    """Is the extension loaded, and why not."""
    mode = kernels_mode()
    mod = ext(warn=False)
    reason = None
    if mod is None:
        reason = "MLX_DSPARK_KERNELS=reference" if mode == "reference" else _state["reason"]
    return {
        "loaded": mod is not None,
        "reason": reason,
        "module": getattr(mod, "__file__", None),
        "built_for_mlx": getattr(mod, "mlx_version", None),
        "metallib": bool(getattr(mod, "has_metal", False)),
        "primitives": list(getattr(mod, "primitives", ())),
        "mode": mode,
    }
