"""Imported first by every bench script: which mlx_dspark to measure.

The installed package when there is one (`pip install .` or `-e .`): it carries the native
extension, so the figures are the ones users get. Otherwise this checkout's python/, on the
pure-MLX kernels (a NativeFallbackWarning says so). Inserting python/ unconditionally would
shadow an installed package and silently lose its extension.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    import mlx_dspark  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "python"))
