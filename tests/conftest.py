import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
# Run against the source tree when the package is not installed (development); CI installs it.
SRC = str(HERE.parent / "python")
try:
    import mlx_dspark  # noqa: F401
except ImportError:
    sys.path.insert(0, SRC)
    # Subprocesses (CLI tests) need the same path.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Tests never touch the user's cache. The demo GGUF, where the user has one, is read in place
# (by path); everything the tests convert or write goes into a temporary cache, subprocesses too.
from mlx_dspark.models import demo as _demo  # noqa: E402
from mlx_dspark.paths import cache_root as _cache_root  # noqa: E402

USER_CACHE = _cache_root()
_found = _demo.find_demo_gguf()
if _found is not None:
    os.environ[_demo.ENV_PATH] = str(_found[0])
_TEST_CACHE = tempfile.mkdtemp(prefix="mlx-dspark-test-cache-")
atexit.register(shutil.rmtree, _TEST_CACHE, True)  # each test process (xdist worker) removes its own
os.environ["MLX_DSPARK_CACHE"] = _TEST_CACHE
# The width-invariance verdict is measured at every load in tests (tests patch the check); its disk
# cache has its own test (tests/test_invariant_forward.py).
os.environ["MLX_DSPARK_INVARIANT_CACHE"] = "off"


def _listing(root: Path) -> dict:
    if not root.exists():
        return {}
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


_USER_CACHE_BEFORE = _listing(USER_CACHE)


def pytest_sessionfinish(session, exitstatus):
    """Fail the run when any test wrote into the user's cache."""
    after = _listing(USER_CACHE)
    changed = sorted(set(after.items()) ^ set(_USER_CACHE_BEFORE.items()))
    if changed:
        names = sorted({k for k, _ in changed})[:5]
        print(f"\nthe tests changed the user's cache {USER_CACHE}: {names}", file=sys.stderr)
        session.exitstatus = 1


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """Write a tiny target of the given family once per session; returns its folder."""
    from fixtures import write_model

    made = {}

    def make(family="qwen3", **kw):
        key = (family, tuple(sorted(kw.items())))
        if key not in made:
            path = tmp_path_factory.mktemp(f"{family}-model")
            made[key] = write_model(path, family, **kw)
        return made[key]

    return make


@pytest.fixture(scope="module")
def ext():
    """The built native extension (mlx_dspark._ext); a test that needs it fails when it is missing."""
    from mlx_dspark import kernels
    from mlx_dspark.kernels import native as _native

    mod = _native.ext(warn=False)
    if mod is None:
        pytest.fail(
            f"mlx_dspark._ext did not load: {kernels.native_status()['reason']}\n"
            "build it: pip install --no-build-isolation -e .  (or pip install .)"
        )
    return mod


@pytest.fixture
def calibration_dir(tmp_path, monkeypatch):
    """A fresh cache for the cost curves (decode/costs.py): measured on first use, nothing memoized;
    yields the folder they are stored in."""
    from mlx_dspark.decode import costs

    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MLX_DSPARK_CALIBRATION", "auto")
    costs._memo.clear()
    yield tmp_path / "cache" / "calibration"
    costs._memo.clear()
