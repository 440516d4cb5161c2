"""The listening server: a threaded standard-library HTTP server around serve/http.py's Handler,
with a connection cap, in-flight tracking for a clean shutdown, and health for /health."""

from __future__ import annotations

import logging
import socket
import threading
import time
import traceback
from http.server import ThreadingHTTPServer

from .._version import __version__
from . import openai
from .engine import Engine
from .http import Config, Handler, is_loopback_host
from .metrics import Metrics
from .sse import dumps
from .validate import ApiError

log = logging.getLogger("mlx_dspark.serve")


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address, engine: Engine, config: Config, metrics: Metrics):
        host = address[0]
        if ":" in host:
            self.address_family = socket.AF_INET6
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.started = int(time.time())
        self._active = 0
        self.inflight = 0
        self._active_lock = threading.Lock()
        super().__init__(address, Handler)

    def track(self, n: int) -> None:
        """Count requests that hold a Job (shutdown waits for their last frame to be written)."""
        with self._active_lock:
            self.inflight += n

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.inflight <= 0:
                return True
            time.sleep(0.02)
        return self.inflight <= 0

    @property
    def port(self) -> int:
        return self.server_address[1]

    @property
    def url(self) -> str:
        host = self.server_address[0]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    def health(self) -> dict:
        e = self.engine
        return {
            "status": "ok",
            "model": e.model_id,
            **e.describe(),
            "max_output_tokens": e.default_max_tokens,
            "busy": e.busy,
            "queue_depth": e.queue_depth,
            "version": __version__,
            "auth": self.config.api_key is not None,
        }

    def process_request(self, request, client_address):
        with self._active_lock:
            over = self._active >= self.config.max_connections
            if not over:
                self._active += 1
        if over:  # answer, never drop: a short 503 in the OpenAI envelope, then close
            try:
                body = dumps(openai.error_body(ApiError(503, "too many open connections: retry shortly", "overloaded")))
                request.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                )
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._active_lock:
                self._active -= 1

    def handle_error(self, request, client_address):
        log.debug("connection error from %s:\n%s", client_address, traceback.format_exc())


def make_server(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 8080,
    *,
    api_key: str | None = None,
    max_body: int = 32 << 20,
    idle_timeout: float = 120.0,
    keepalive_s: float = 15.0,
    max_connections: int = 128,
    metrics: Metrics | None = None,
) -> Server:
    """Bind (port 0 picks a free port). The caller runs serve_forever() and starts the engine."""
    if metrics is None:
        metrics = engine.metrics or Metrics(model=engine.model_id, mode=engine.resolved_mode, version=__version__)
    engine.metrics = metrics
    cfg = Config(
        api_key=api_key,
        max_body=max_body,
        idle_timeout=idle_timeout,
        keepalive_s=keepalive_s,
        max_connections=max_connections,
        loopback=is_loopback_host(host.lower()),
    )
    return Server((host, port), engine, cfg, metrics)
