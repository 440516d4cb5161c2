import os
import sys
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
    from mlx_dspark import _native

    mod = _native.ext(warn=False)
    if mod is None:
        pytest.fail(f"mlx_dspark._ext did not load: {_native.native_status()['reason']}\n"
                    "build it: pip install --no-build-isolation -e .  (or pip install .)")
    return mod
