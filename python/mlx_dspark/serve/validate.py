"""Request validation shared by both dialects: one error type, typed field readers.

Every reader names the field that was wrong and what it should be. The dialect that was called
renders an ApiError in its own envelope (openai.error_body / anthropic.error_body).
"""

from __future__ import annotations

import json
import math
from typing import Any

_TYPE_NAMES = {
    dict: "an object",
    list: "an array",
    str: "a string",
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    type(None): "null",
}


class ApiError(Exception):
    """An error answered to the client. `kind` is dialect-neutral; each dialect maps it:
    invalid_request, authentication, permission, not_found, too_large, rate_limit, overloaded,
    server_error, context_length."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request",
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code
        self.headers = headers or {}


def _fmt(v) -> str:
    """A bound or value as written: integers in full (2147483648, not 2.14748e+09)."""
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 1e18):
        return str(int(v))
    return repr(float(v))


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request", param=param, code=code)


def type_name(v: Any) -> str:
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    return _TYPE_NAMES.get(type(v), type(v).__name__)


def parse_json_body(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 naming what was wrong with it."""
    if not raw.strip():
        raise invalid("the request body is empty: send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise invalid("the request body is nested too deeply") from None
    except ValueError as e:
        raise invalid(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {type_name(body)}")
    return body


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


class Fields:
    """Typed reads of one JSON object. `where` prefixes field names in messages (e.g. `messages[2].`)."""

    def __init__(self, obj: dict, where: str = ""):
        self.obj = obj
        self.where = where

    def _name(self, key: str) -> str:
        return f"{self.where}{key}"

    def has(self, key: str) -> bool:
        return self.obj.get(key) is not None

    def raw(self, key: str, default=None):
        v = self.obj.get(key)
        return default if v is None else v

    def _need(self, key: str, required: bool):
        v = self.obj.get(key)
        if v is None and required:
            raise invalid(f"`{self._name(key)}` is required", param=self._name(key))
        return v

    def str(
        self,
        key: str,
        default: str | None = None,
        *,
        required: bool = False,
        nonempty: bool = False,
        max_len: int | None = None,
    ) -> str | None:
        v = self._need(key, required)
        if v is None:
            return default
        if not isinstance(v, str):
            raise invalid(f"`{self._name(key)}` must be a string, got {type_name(v)}", param=self._name(key))
        if nonempty and not v.strip():
            raise invalid(f"`{self._name(key)}` must not be empty", param=self._name(key))
        if max_len is not None and len(v) > max_len:
            raise invalid(f"`{self._name(key)}` is longer than {max_len} characters", param=self._name(key))
        return v

    def bool(self, key: str, default: bool | None = None) -> bool | None:
        v = self.obj.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise invalid(f"`{self._name(key)}` must be a boolean, got {type_name(v)}", param=self._name(key))
        return v

    def int(
        self,
        key: str,
        default: int | None = None,
        *,
        lo: int | None = None,
        hi: int | None = None,
        required: bool = False,
    ) -> int | None:
        v = self._need(key, required)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer() and abs(v) < 2**53:
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise invalid(f"`{self._name(key)}` must be an integer, got {type_name(v)}", param=self._name(key))
        self._range(key, v, lo, hi)
        return v

    def num(
        self,
        key: str,
        default: float | None = None,
        *,
        lo: float | None = None,
        hi: float | None = None,
        lo_open: bool = False,
    ) -> float | None:
        v = self.obj.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise invalid(f"`{self._name(key)}` must be a number, got {type_name(v)}", param=self._name(key))
        v = float(v)
        if not math.isfinite(v):
            raise invalid(f"`{self._name(key)}` must be a finite number", param=self._name(key))
        self._range(key, v, lo, hi, lo_open)
        return v

    def _range(self, key, v, lo, hi, lo_open: bool = False):
        if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
            lo_s = "-inf" if lo is None else _fmt(lo)
            hi_s = "inf" if hi is None else _fmt(hi)
            raise invalid(
                f"`{self._name(key)}` must be in {'(' if lo_open else '['}{lo_s}, {hi_s}], got {_fmt(v)}",
                param=self._name(key),
            )

    def list(
        self, key: str, default=None, *, required: bool = False, nonempty: bool = False, max_len: int | None = None
    ) -> list | None:
        v = self._need(key, required)
        if v is None:
            return default
        if not isinstance(v, list):
            raise invalid(f"`{self._name(key)}` must be an array, got {type_name(v)}", param=self._name(key))
        if nonempty and not v:
            raise invalid(f"`{self._name(key)}` must not be empty", param=self._name(key))
        if max_len is not None and len(v) > max_len:
            raise invalid(
                f"`{self._name(key)}` has {len(v)} items; at most {max_len} are allowed", param=self._name(key)
            )
        return v

    def dict(self, key: str, default=None, *, required: bool = False) -> dict | None:
        v = self._need(key, required)
        if v is None:
            return default
        if not isinstance(v, dict):
            raise invalid(f"`{self._name(key)}` must be an object, got {type_name(v)}", param=self._name(key))
        return v

    def choice(self, key: str, choices, default=None):
        v = self.obj.get(key)
        if v is None:
            return default
        if not isinstance(v, str) or v not in choices:
            raise invalid(
                f"`{self._name(key)}` must be one of {', '.join(map(repr, choices))}, got {v!r}", param=self._name(key)
            )
        return v

    def str_list(self, key: str, *, max_items: int = 16, allow_str: bool = False) -> list[str]:
        v = self.obj.get(key)
        if v is None:
            return []
        if allow_str and isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            want = "a string or an array of strings" if allow_str else "an array of strings"
            raise invalid(f"`{self._name(key)}` must be {want}", param=self._name(key))
        if len(v) > max_items:
            raise invalid(
                f"`{self._name(key)}` has {len(v)} items; at most {max_items} are allowed", param=self._name(key)
            )
        return [s for s in v if s]


def check_fields(body: dict, supported: set, refused: dict) -> list[str]:
    """Sort the top-level fields of a request.

    supported: handled. refused: name -> predicate(value) that is True when the value needs a feature this server lacks.
    Everything else is accepted without effect and returned, for `x_mlx_dspark.ignored_params`
    (the known ones are listed in README-params.md).
    """
    out = []
    for key, value in body.items():
        if key in supported:
            continue
        if key in refused:
            why = refused[key](value)
            if why:
                raise invalid(f"`{key}`: {why}", param=key)
            continue
        if value is None:
            continue
        out.append(key)
    return out


class ShuttingDown(ApiError):
    """A request that arrives, or is still queued or running, while the server shuts down."""

    def __init__(self):
        super().__init__(503, "the server is shutting down: retry on a running server", "overloaded")
