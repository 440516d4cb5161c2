"""Where mlx-dspark keeps what it makes: one cache root for conversions, the demo, cost curves
and discovery files."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$MLX_DSPARK_CACHE, else $XDG_CACHE_HOME/mlx-dspark, else ~/.cache/mlx-dspark."""
    env = os.environ.get("MLX_DSPARK_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "mlx-dspark"
