"""Which BLAS MLX's CPU matmuls run on, and a fast one on Linux CPU when there is one.

MLX's Linux CPU wheel bundles netlib's reference BLAS (about 4 GFLOP/s for float32 GEMM).
Preloading an OpenBLAS gives ~10-30x that with the same results, but a preload must be in place
before the process starts, so the CLI re-executes itself once with LD_PRELOAD set.

Where an OpenBLAS comes from, in order:
  * `MLX_DSPARK_OPENBLAS=/path/libopenblas.so.0` (`MLX_DSPARK_OPENBLAS=0`: none, reference BLAS);
  * the system's (Debian/Ubuntu `libopenblas0-pthread`, Fedora `openblas`);
  * the PyPI wheel `ngsolve-openblas` (BSD-3-Clause, OpenBLAS with the standard CBLAS symbols,
    DYNAMIC_ARCH), which `pip install mlx-dspark` brings on Linux x86_64. It needs
    libgfortran.so.5; where the system lacks it, numpy's bundled copy is linked under that name
    in the cache (`$MLX_DSPARK_CACHE/blas/`) and put on LD_LIBRARY_PATH. It runs one BLAS thread
    unless OPENBLAS_NUM_THREADS says otherwise (its thread pool was 5x slower than one thread on
    a busy 2-core machine; decode GEMMs are small).
scipy-openblas32/64 (numpy's) prefix their symbols (scipy_cblas_sgemm), so MLX cannot use them.

`active_blas()` answers which library provides the `cblas_sgemm` that libmlx calls (global
symbol scope first, as the dynamic linker binds it), so a BLAS that is merely mapped into the
process (numpy's) is never mistaken for the one in use. doctor and the kernels ask it.
"""

from __future__ import annotations

import ctypes
import importlib.util
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
WHEELS = {"ngsolve_openblas": "libopenblasp-r*.so"}  # module -> library glob inside it
_MARK = "MLX_DSPARK_OPENBLAS_REEXEC"
INSTALL_HINT = "pip install ngsolve-openblas (or apt install libopenblas0-pthread); the CLI preloads it"


def _wheel_openblas() -> str | None:
    for mod, pattern in WHEELS.items():
        try:
            spec = importlib.util.find_spec(mod)  # found without importing (importing loads it)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            continue
        for loc in spec.submodule_search_locations:
            libs = sorted(Path(loc).glob(pattern))
            if libs:
                return str(libs[-1])
    return None


def find_openblas() -> str | None:
    """The OpenBLAS library to preload, or None."""
    choice = os.environ.get("MLX_DSPARK_OPENBLAS", "")
    if choice == "0":
        return None
    if choice:
        return choice if Path(choice).exists() else None
    return next((c for c in CANDIDATES if Path(c).exists()), None) or _wheel_openblas()


def _loadable(name: str) -> bool:
    try:
        ctypes.CDLL(name)
        return True
    except OSError:
        return False


def gfortran_dir() -> str | None:
    """A folder holding libgfortran.so.5 for a wheel OpenBLAS when the system has none (numpy's
    bundled copy, linked under the standard name); None when none is needed or none exists."""
    if _loadable("libgfortran.so.5"):
        return None
    spec = importlib.util.find_spec("numpy")
    if spec is None or not spec.origin:
        return None
    libdir = Path(spec.origin).parent.parent / "numpy.libs"
    libs = sorted(libdir.glob("libgfortran-*.so.5*"))
    if not libs:
        return None
    from .paths import cache_root

    d = cache_root() / "blas"
    # its own dependencies (libquadmath-<hash>) are found through $ORIGIN: the link's folder
    links = {"libgfortran.so.5": libs[-1], **{q.name: q for q in libdir.glob("libquadmath-*")}}
    try:
        d.mkdir(parents=True, exist_ok=True)
        for name, src in links.items():
            link = d / name
            if not link.exists():
                tmp = d / f".{name}.{os.getpid()}"
                tmp.symlink_to(src)
                os.replace(tmp, link)
    except OSError:
        return None
    return str(d)


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _provider(symbol: str = "cblas_sgemm") -> str | None:
    """The file of the library whose `symbol` libmlx binds to: the global scope first (preloads),
    else libmlx's own dependencies (the bundled BLAS)."""
    try:
        libdl = ctypes.CDLL(None)
        dlsym, dladdr = libdl.dlsym, libdl.dladdr
    except (OSError, AttributeError):
        return None
    dlsym.restype, dlsym.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    addr = dlsym(None, symbol.encode())  # RTLD_DEFAULT
    if not addr:
        import mlx.core as mx

        libmlx = Path(mx.__file__).parent / "lib" / "libmlx.so"
        try:
            handle = ctypes.CDLL(str(libmlx), mode=getattr(os, "RTLD_NOLOAD", 4) | os.RTLD_LOCAL)
        except OSError:
            return None
        addr = dlsym(handle._handle, symbol.encode())
    if not addr:
        return None
    info = _DlInfo()
    if not dladdr(addr, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(info.dli_fname.decode())


def active_blas() -> dict:
    """{"name": openblas | reference | accelerate | mkl | other | unknown, "path", "fast": bool}:
    the BLAS that MLX's CPU float32 matmuls call in this process."""
    if sys.platform == "darwin":
        return {"name": "accelerate", "path": None, "fast": True}
    path = _provider()
    if path is None:
        return {"name": "unknown", "path": None, "fast": False}
    base = Path(path).name.lower()
    if "openblas" in base:
        name = "openblas"
    elif "mkl" in base:
        name = "mkl"
    elif "blis" in base:
        name = "blis"
    elif base.startswith("libblas") or base.startswith("libcblas"):
        name = "reference"  # netlib's, as MLX's wheel bundles it (mlx_cpu.libs/libblas-*.so)
    else:
        name = "other"
    return {"name": name, "path": path, "fast": name in ("openblas", "mkl", "blis", "accelerate")}


def fast_blas() -> bool:
    return active_blas()["fast"]


def loaded_blas() -> str | None:
    """The OpenBLAS that MLX uses in this process, if any (its path)."""
    a = active_blas()
    return a["path"] if a["name"] == "openblas" else None


def preload_env(lib: str, env: dict) -> dict:
    """`env` with `lib` preloaded (and what a wheel OpenBLAS needs)."""
    env = dict(env)
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    if lib == _wheel_openblas():
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
        extra = gfortran_dir()
        if extra:
            env["LD_LIBRARY_PATH"] = ":".join(p for p in (extra, env.get("LD_LIBRARY_PATH", "")) if p)
    return env


def maybe_reexec(argv: list[str]) -> None:
    """Re-run this CLI with OpenBLAS preloaded when on Linux CPU and it is available."""
    if not sys.platform.startswith("linux") or os.environ.get(_MARK):
        return
    lib = find_openblas()
    if lib is None or loaded_blas():
        return
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return
    env = preload_env(lib, os.environ)
    env[_MARK] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "mlx_dspark", *argv], env)
