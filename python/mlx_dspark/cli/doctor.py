"""`mlx-dspark doctor`: what this installation can do, and what it falls back on."""

from __future__ import annotations

import json
import os
import platform
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="check the installation: backend, native kernels, BLAS, demo model")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def collect() -> dict:
    import mlx.core as mx

    from .._version import __version__

    info: dict = {
        "mlx_dspark": __version__,
        "python": sys.version.split()[0],
        "platform": f"{platform.system()} {platform.machine()}",
        "mlx": mx.__version__,
    }
    try:
        import mlx_lm

        info["mlx_lm"] = getattr(mlx_lm, "__version__", "installed")
    except ImportError:
        info["mlx_lm"] = None
    try:
        import mlx_vlm

        info["mlx_vlm"] = getattr(mlx_vlm, "__version__", "installed")
    except ImportError:
        info["mlx_vlm"] = None
    from ..compat import shims

    info["shims"] = shims()  # compat.py's adjustments of other packages: for which versions, when, active here
    dev = mx.default_device()
    info["device"] = str(dev)
    info["metal"] = bool(getattr(mx, "metal", None) and mx.metal.is_available())
    info["cuda"] = bool(getattr(mx, "cuda", None) and mx.cuda.is_available())
    try:
        from ..kernels import native_status

        info["native"] = native_status()
    except ImportError:
        info["native"] = {"loaded": False, "reason": "this build has no native loader"}
    if dev == mx.cpu:
        info["blas"] = blas_report()
    try:
        from ..models.demo import demo_info

        info["demo_model"] = demo_info()
    except ImportError:
        info["demo_model"] = None
    except Exception as e:  # report, never crash the doctor
        info["demo_model"] = {"available": False, "reason": str(e)}
    return info


def gemm_gflops(reps: int = 2) -> float:
    """Measured float32 GEMM speed of MLX's CPU matmul (a decode-sized product)."""
    import time

    import mlx.core as mx

    a, b = mx.random.normal((128, 576)), mx.random.normal((576, 1536))
    mx.eval(a @ b)
    t = time.perf_counter()
    for _ in range(reps):
        mx.eval(a @ b)
    return 2 * 128 * 576 * 1536 * reps / (time.perf_counter() - t) / 1e9


def blas_report() -> dict:
    """One answer: the BLAS MLX's float32 matmuls call in this process (doctor runs with the
    same preload as generate/serve/benchmark), its measured speed, and what to do."""
    from ..blas import INSTALL_HINT, active_blas, find_openblas

    a = active_blas()
    out = {"in_use": a["name"], "path": a["path"], "fast": a["fast"], "gemm_gflops": round(gemm_gflops(), 1)}
    if a["fast"]:
        out["note"] = f"{a['name']}: fast float32 CPU matmuls"
    elif os.environ.get("MLX_DSPARK_OPENBLAS") == "0":
        out["note"] = "reference BLAS (slow): MLX_DSPARK_OPENBLAS=0 turned the OpenBLAS preload off"
    elif find_openblas():
        out["note"] = (
            f"reference BLAS (slow) in this process; {find_openblas()} exists but is not preloaded "
            "(MLX_DSPARK_OPENBLAS=0 set, or not run through the mlx-dspark CLI)"
        )
    else:
        out["note"] = f"reference BLAS (slow): speculation cannot pay on CPU; {INSTALL_HINT}"
    return out


def _shim_line(s: dict) -> str:
    """One compat.py adjustment: active in this process or when it applies, what it was written for,
    and a warning where the installed version is outside that range."""
    state = "ACTIVE" if s["active"] else f"when {s['when']}"
    warn = "" if s["fits"] else f"  <- written for {s['for']}, {s['installed']} installed: check it still holds"
    installed = f", {s['installed']}" if s["installed"] else ""
    return f"{s['name']}: {state} (for {s['for']}{installed}){warn}"


def run(args) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=1, default=str))
        return 0
    width = max(len(k) for k in info)
    for k, v in info.items():
        if isinstance(v, dict):
            v = ", ".join(f"{a}={b}" for a, b in v.items())
        elif k == "shims":
            v = "".join("\n    " + _shim_line(s) for s in v)
        print(f"{k:<{width}}  {v}")
    return 0
