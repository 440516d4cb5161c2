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


def fact_file(kind: str, key: dict) -> Path:
    """Where the fact `key` of `kind` is kept: one small JSON file per key under the cache root."""
    import hashlib
    import json

    h = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return cache_root() / kind / f"{h}.json"


def read_fact(kind: str, key: dict):
    """What `write_fact(kind, key, ...)` stored for exactly `key` (a JSON-able dict), else None: a
    machine fact measured once (which decode path is exact here, whether NVRTC reads #includes)."""
    import json

    try:
        data = json.loads(fact_file(kind, key).read_text())
    except (OSError, ValueError):
        return None
    return data.get("value") if data.get("key") == json.loads(json.dumps(key, default=str)) else None


def write_fact(kind: str, key: dict, value) -> None:
    """Store `value` for `key` atomically; a read-only cache only means it is measured again."""
    import json
    import tempfile

    p = fact_file(kind, key)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "value": value}, f, default=str)
        os.replace(tmp, p)
    except OSError:
        pass
