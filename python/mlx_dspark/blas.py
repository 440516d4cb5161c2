"""Use OpenBLAS on Linux CPU when the system has it.

MLX's Linux CPU wheel bundles netlib's reference BLAS (about 4 GFLOP/s for float32 GEMM).
Preloading a system OpenBLAS gives ~30x that with the same results, but a preload must be in
place before the process starts, so the CLI re-executes itself once with LD_PRELOAD set.
`MLX_DSPARK_OPENBLAS=0` turns this off; `MLX_DSPARK_OPENBLAS=/path/libopenblas.so.0` picks a library.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
]
_MARK = "MLX_DSPARK_OPENBLAS_REEXEC"


def find_openblas() -> str | None:
    choice = os.environ.get("MLX_DSPARK_OPENBLAS", "")
    if choice == "0":
        return None
    if choice:
        return choice if Path(choice).exists() else None
    return next((c for c in CANDIDATES if Path(c).exists()), None)


def loaded_blas() -> str | None:
    """The OpenBLAS library mapped into this process, if any."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        if "libopenblas" in line:
            return line.split()[-1]
    return None


def maybe_reexec(argv: list[str]) -> None:
    """Re-run this CLI with OpenBLAS preloaded when on Linux CPU and it is available."""
    if not sys.platform.startswith("linux") or os.environ.get(_MARK) or loaded_blas():
        return
    lib = find_openblas()
    if lib is None:
        return
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return
    env = dict(os.environ)
    env[_MARK] = "1"
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "mlx_dspark", *argv], env)
