"""Discovery files: how `mlx-dspark claude` finds a running server (port, and key if any).

One JSON file per server, `<dir>/<port>.json`, written when the server is listening and removed
when it exits. The directory is private to the user (0700) and each file is 0600:

  $XDG_RUNTIME_DIR/mlx-dspark/     (Linux: a per-user tmpfs, emptied at logout)
  $TMPDIR/mlx-dspark/              (macOS: the per-user temporary folder)
  $MLX_DSPARK_CACHE/servers/       (elsewhere; default ~/.cache/mlx-dspark/servers/)

The API key is stored in the file so the launcher can pass it on. That exposes it to nothing new:
any process of the same user can already read the server's environment and command line (and
any user can read a command line, so prefer MLX_DSPARK_API_KEY to --api-key). `serve
--no-key-in-discovery` leaves the key out; the launcher then needs --api-key or MLX_DSPARK_API_KEY.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def discovery_dir() -> Path:
    run = os.environ.get("XDG_RUNTIME_DIR")
    if run and Path(run).is_dir():
        return Path(run) / "mlx-dspark"
    tmp = os.environ.get("TMPDIR")
    if sys.platform == "darwin" and tmp and Path(tmp).is_dir():
        return Path(tmp) / "mlx-dspark"
    from ..paths import cache_root

    return cache_root() / "servers"


def _private_dir(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = d.stat()
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise PermissionError(f"{d} belongs to another user")
    if st.st_mode & 0o077:
        os.chmod(d, 0o700)
    return d


def write(
    port: int, *, host: str, model: str, api_key: str | None, store_key: bool = True, directory: Path | None = None
) -> Path:
    d = _private_dir(directory or discovery_dir())
    info = {
        "port": port,
        "host": host,
        "pid": os.getpid(),
        "model": model,
        "started": time.time(),
        "needs_key": api_key is not None,
    }
    if api_key is not None and store_key:
        info["api_key"] = api_key
    path = d / f"{port}.json"
    tmp = d / f".{port}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)
    return path


def remove(path: Path | None) -> None:
    if path is None:
        return
    try:
        info = json.loads(path.read_text())
        if info.get("pid") == os.getpid():  # never remove another server's file
            path.unlink()
    except (OSError, ValueError):
        pass


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError):
        return isinstance(pid, int)
    return True


def find(directory: Path | None = None) -> list[dict]:
    """Servers whose process is alive, newest first. Reads only; never writes or deletes."""
    d = directory or discovery_dir()
    out = []
    try:
        files = sorted(d.glob("*.json"))
    except OSError:
        return []
    for f in files:
        try:
            info = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(info, dict) and isinstance(info.get("port"), int) and _alive(info.get("pid")):
            info["file"] = str(f)
            out.append(info)
    out.sort(key=lambda i: i.get("started", 0), reverse=True)
    return out
