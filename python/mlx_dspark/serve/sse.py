"""Wire helpers: JSON bytes and server-sent-event frames."""

from __future__ import annotations

import json
import secrets
import time


def dumps(obj) -> bytes:
    # Lone surrogates from a client's JSON cannot be encoded as UTF-8; they become U+FFFD.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")


def sse(data, event: str | None = None) -> bytes:
    """One SSE frame. `data` is a JSON-able object or an already-encoded string (e.g. [DONE])."""
    payload = data.encode() if isinstance(data, str) else dumps(data)
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + payload + b"\n\n"


def comment(text: str = "keep-alive") -> bytes:
    return f": {text}\n\n".encode()


def new_id(prefix: str, n: int = 24) -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    return prefix + "".join(secrets.choice(alphabet) for _ in range(n))


def now() -> int:
    return int(time.time())
