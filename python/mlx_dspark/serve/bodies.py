"""Reading request bodies within bounds: Content-Length or chunked, a size limit, a read timeout,
and discarding a body that will not be used so the keep-alive connection stays in step."""

from __future__ import annotations

from .validate import ApiError


class ClientGone(Exception):
    """The client closed the connection; there is nobody to answer."""


class BodyReader:
    """Mixed into the request handler (it uses rfile, headers, server.config, close_connection)."""

    body_pending = False

    def _read_body(self) -> bytes:
        limit = self.server.config.max_body
        te = (self.headers.get("Transfer-Encoding") or "").lower()
        try:
            if "chunked" in te:
                data = self._read_chunked(limit)
            else:
                n = self._content_length()
                if n > limit:
                    self.close_connection = True
                    raise ApiError(
                        413,
                        f"the request body is {n} bytes; the limit is {limit} (raise it with --max-body-mb)",
                        "too_large",
                    )
                data = self.rfile.read(n)
                if len(data) < n:
                    raise ClientGone()
        except TimeoutError:
            self.close_connection = True
            self.body_pending = False
            raise ApiError(408, "timed out reading the request body", headers={"Connection": "close"}) from None
        self.body_pending = False
        return data

    def _content_length(self) -> int:
        raw = self.headers.get("Content-Length")
        if raw is None:
            self.close_connection = True
            self.body_pending = False
            raise ApiError(411, "a Content-Length header (or chunked transfer encoding) is required")
        try:
            n = int(raw)
            if n < 0:
                raise ValueError
        except ValueError:
            self.close_connection = True
            self.body_pending = False
            raise ApiError(400, f"Content-Length {raw!r} is not a valid length") from None
        return n

    def _read_chunked(self, limit: int) -> bytes:
        parts, total = [], 0
        while True:
            line = self.rfile.readline(1024)
            try:
                size = int(line.split(b";")[0].strip(), 16)
            except ValueError:
                self.close_connection = True
                self.body_pending = False
                raise ApiError(400, "malformed chunked request body") from None
            if size == 0:
                while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(parts)
            total += size
            if total > limit:
                self.close_connection = True
                raise ApiError(
                    413,
                    f"the request body exceeds the limit of {limit} bytes (raise it with --max-body-mb)",
                    "too_large",
                )
            parts.append(self.rfile.read(size))
            self.rfile.readline(16)

    def _discard_body(self) -> None:
        """Consume a body we will not use, so the connection stays usable; else close it."""
        if not self.body_pending:
            return
        self.body_pending = False
        te = (self.headers.get("Transfer-Encoding") or "").lower()
        raw = self.headers.get("Content-Length")
        try:
            n = int(raw) if raw is not None and "chunked" not in te else -1
        except ValueError:
            n = -1
        if 0 <= n <= self.server.config.max_body:
            try:
                self.rfile.read(n)
                return
            except OSError:
                pass
        self.close_connection = True
