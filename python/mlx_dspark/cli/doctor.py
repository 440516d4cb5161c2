"""`mlx-dspark doctor`: what this installation can do, and what it falls back on."""

from __future__ import annotations

import json
import platform
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="check the installation: backend, native kernels, BLAS, demo model")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def collect() -> dict:
    import mlx.core as mx

    from .. import __version__
    from ..blas import find_openblas, loaded_blas

    info: dict = {"mlx_dspark": __version__, "python": sys.version.split()[0],
                  "platform": f"{platform.system()} {platform.machine()}", "mlx": mx.__version__}
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
    dev = mx.default_device()
    info["device"] = str(dev)
    info["metal"] = bool(getattr(mx, "metal", None) and mx.metal.is_available())
    info["cuda"] = bool(getattr(mx, "cuda", None) and mx.cuda.is_available())
    try:
        from .._native import native_status

        info["native"] = native_status()
    except ImportError:
        info["native"] = {"loaded": False, "reason": "this build has no native loader"}
    if dev == mx.cpu:
        info["blas"] = {"openblas_loaded": loaded_blas(), "openblas_found": find_openblas(),
                        "note": ("OpenBLAS in use" if loaded_blas() else
                                 "reference BLAS (slow): install libopenblas0-pthread; the CLI preloads it"
                                 if not find_openblas() else "OpenBLAS found; the CLI preloads it")}
    try:
        from ..models.demo import demo_info

        info["demo_model"] = demo_info()
    except ImportError:
        info["demo_model"] = None
    except Exception as e:  # report, never crash the doctor
        info["demo_model"] = {"available": False, "reason": str(e)}
    return info


def run(args) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=1, default=str))
        return 0
    width = max(len(k) for k in info)
    for k, v in info.items():
        if isinstance(v, dict):
            v = ", ".join(f"{a}={b}" for a, b in v.items())
        print(f"{k:<{width}}  {v}")
    return 0
