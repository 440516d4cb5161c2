"""blas.py: which BLAS libmlx calls (never a BLAS merely mapped into the process), the wheel
OpenBLAS and its libgfortran fallback, and doctor's one answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mlx_dspark import blas

PROBE = (
    "import json, numpy, mlx.core as mx; from mlx_dspark import blas; from mlx_dspark.kernels import wide_gemm; "
    "maps = open('/proc/self/maps').read().lower(); "
    "print(json.dumps({'active': blas.active_blas(), 'wide': wide_gemm.policy()['enabled'], "
    "'mapped': 'openblas' in maps}))"
)

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD and /proc are Linux's")


def _probe(env_extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@linux
def test_numpy_openblas_in_the_maps_is_not_the_blas_mlx_uses():
    r = _probe({})
    assert r["mapped"], "numpy's bundled OpenBLAS should be mapped for this test to mean anything"
    assert r["active"]["name"] == "reference" and not r["active"]["fast"]
    assert "mlx" in r["active"]["path"] and r["wide"] is False  # the dense GEMM stays off: one answer


@linux
@pytest.mark.parametrize("which", ["system", "wheel"])
def test_a_preloaded_openblas_is_reported_and_used(which):
    lib = next((c for c in blas.CANDIDATES if os.path.exists(c)), None) if which == "system" else blas._wheel_openblas()
    if lib is None:
        pytest.skip(f"no {which} OpenBLAS on this machine")
    env = blas.preload_env(lib, {})
    r = _probe({k: env[k] for k in ("LD_PRELOAD", "LD_LIBRARY_PATH", "OPENBLAS_NUM_THREADS") if k in env})
    assert r["active"]["name"] == "openblas" and r["active"]["fast"] and r["wide"] is True


def test_gfortran_fallback_links_numpy_copy_under_the_standard_name(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path))
    monkeypatch.setattr(blas, "_loadable", lambda name: False)
    d = blas.gfortran_dir()
    import numpy

    libs = os.path.join(os.path.dirname(numpy.__file__), os.pardir, "numpy.libs")
    if not any(n.startswith("libgfortran") for n in (os.listdir(libs) if os.path.isdir(libs) else [])):
        assert d is None
        return
    assert d == str(tmp_path / "blas")
    assert os.path.realpath(tmp_path / "blas" / "libgfortran.so.5").startswith(os.path.realpath(libs))
    monkeypatch.setattr(blas, "_loadable", lambda name: True)
    assert blas.gfortran_dir() is None  # the system has one: nothing to add


def test_find_openblas_obeys_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_DSPARK_OPENBLAS", "0")
    assert blas.find_openblas() is None
    lib = tmp_path / "libopenblas.so.0"
    lib.write_bytes(b"")
    monkeypatch.setenv("MLX_DSPARK_OPENBLAS", str(lib))
    assert blas.find_openblas() == str(lib)
    monkeypatch.setenv("MLX_DSPARK_OPENBLAS", str(tmp_path / "missing.so"))
    assert blas.find_openblas() is None


def test_doctor_blas_report_is_one_consistent_answer():
    from mlx_dspark.cli.doctor import blas_report
    from mlx_dspark.kernels import wide_gemm

    r = blas_report()
    assert r["in_use"] == blas.active_blas()["name"] and r["gemm_gflops"] > 0
    slow = "reference BLAS (slow)" in r["note"]
    assert slow == (not r["fast"]) and wide_gemm.policy()["enabled"] == r["fast"]


def test_without_a_system_openblas_the_pip_wheel_is_preloaded_with_one_thread(monkeypatch):
    monkeypatch.delenv("MLX_DSPARK_OPENBLAS", raising=False)
    monkeypatch.setattr(blas, "CANDIDATES", [])
    wheel = blas._wheel_openblas()
    if wheel is None:
        assert blas.find_openblas() is None
        pytest.skip("ngsolve-openblas is not installed here")
    assert blas.find_openblas() == wheel and "ngsolve_openblas" in wheel
    env = blas.preload_env(wheel, {"LD_PRELOAD": "/x.so"})
    assert env["LD_PRELOAD"] == f"{wheel}:/x.so" and env["OPENBLAS_NUM_THREADS"] == "1"
    assert blas.preload_env(wheel, {"OPENBLAS_NUM_THREADS": "4"})["OPENBLAS_NUM_THREADS"] == "4"
