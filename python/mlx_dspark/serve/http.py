"""The transport: a threaded standard-library HTTP/1.1 server, no framework.

* keep-alive (HTTP/1.1, Content-Length on every plain response, chunked SSE streams);
* bounded request bodies (Content-Length or chunked), read timeouts, a connection cap;
* auth on every route (Bearer or x-api-key, compared in constant time); only `HEAD /` is open;
* when bound to loopback, a Host check (against DNS rebinding) and no browser "simple" content
  types (against cross-site POSTs), so a web page cannot drive the local model;
* each API's own error envelope; client errors are 4xx; a bad request never drops the connection
  without an answer (oversized bodies get their 413, then a lingering close);
* a client that disconnects (seen by a failed write, or by EOF on the socket while its request
  waits) has its Job cancelled, which the engine sees within one round.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import select
import socket
import time
import traceback
from http.server import BaseHTTPRequestHandler
from urllib.parse import unquote, urlsplit

from .._version import __version__
from ..errors import UserError
from . import anthropic, completions, openai, responses
from .bodies import BodyReader, ClientGone
from .engine import Engine, Plan
from .metrics import Metrics
from .sse import dumps, new_id
from .validate import ApiError, parse_json_body

log = logging.getLogger("mlx_dspark.serve")

POLL_S = 0.05  # how often a waiting handler checks its client


class Config:
    def __init__(
        self,
        *,
        api_key: str | None = None,
        max_body: int = 32 << 20,
        idle_timeout: float = 120.0,
        keepalive_s: float = 15.0,
        max_connections: int = 128,
        loopback: bool = True,
    ):
        self.api_key = api_key or None
        self.max_body = max_body
        self.idle_timeout = idle_timeout
        self.keepalive_s = keepalive_s
        self.max_connections = max_connections
        self.loopback = loopback
        self._key_digest = hashlib.sha256(api_key.encode()).digest() if api_key else None

    def key_ok(self, candidates) -> bool:
        if self._key_digest is None:
            return True
        ok = False
        for c in candidates:  # every candidate is compared; digests make the lengths equal
            ok |= hmac.compare_digest(hashlib.sha256(c.encode("utf-8", "replace")).digest(), self._key_digest)
        return ok


GET_ROUTES = {"/": "index", "/health": "health", "/metrics": "metrics", "/v1/models": "models"}
POST_ROUTES = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "count_tokens",
    "/v1/responses": "responses",
}
SIMPLE_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")


def normalize_path(raw: str) -> str:
    path = unquote(urlsplit(raw).path) or "/"
    path = "/" + path.strip("/") if path != "/" else "/"
    if path not in GET_ROUTES and not path.startswith("/v1/") and path != "/v1":
        path = "/v1" + path  # every route also answers without the /v1 prefix
    return path


def is_loopback_host(host: str) -> bool:
    # host.docker.internal: Docker Desktop forwards it to this machine's loopback; no public DNS
    # name can take it, so it opens no DNS-rebinding hole.
    if host in ("localhost", "", "host.docker.internal") or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Handler(BodyReader, BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.0"  # always answer with a status line, even to junk
    server_version = f"mlx-dspark/{__version__}"
    sys_version = ""
    disable_nagle_algorithm = True

    # ------------------------------------------------------------------ plumbing
    def version_string(self):
        return self.server_version

    def setup(self):
        self.timeout = self.server.config.idle_timeout
        super().setup()

    def log_message(self, fmt, *args):
        log.debug("%s %s", self.address_string(), fmt % args)

    def _dialect(self):
        return anthropic if getattr(self, "route_path", "").startswith("/v1/messages") else openai

    def send_error(self, code, message=None, explain=None):
        """Protocol errors found by http.server itself (bad request line, headers), in an envelope."""
        if code == 501:  # an unknown method is the client's error
            code = 405
        elif code >= 500:
            code = 400
        self.close_connection = True
        self._rid = None
        try:
            self.route_path = normalize_path(getattr(self, "path", "/") or "/")
        except Exception:
            self.route_path = "/"
        self._send_json(code, self._dialect().error_body(ApiError(code, message or "bad request")), route="protocol")

    def send_response(self, code, message=None):
        super().send_response(code, message)
        self.send_header("request-id", self._request_id)

    @property
    def _request_id(self) -> str:
        rid = getattr(self, "_rid", None)
        if rid is None:
            rid = self._rid = new_id("req_", 20)
        return rid

    def _send_json(self, status: int, obj, *, headers: dict | None = None, route: str | None = None) -> None:
        data = dumps(obj)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        self._record(route, status)

    def _send_text(self, status: int, text: str, ctype: str) -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        self._record(None, status)

    def _record(self, route: str | None, status: int) -> None:
        m: Metrics | None = self.server.metrics
        if m is not None:
            label = route or getattr(self, "route_name", None) or "other"
            m.record_http(label, status)

    def _send_api_error(self, err: ApiError) -> None:
        if getattr(self, "body_pending", False):
            self._discard_body()
        headers = dict(err.headers)
        self._send_json(err.status, self._dialect().error_body(err), headers=headers)
        if self.close_connection:
            self._linger()

    def _linger(self) -> None:
        """After an error answered before the body was read: stop writing, drain what the client
        is still sending (bounded), so the answer is not lost to a TCP reset."""
        try:
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(0.5)
            deadline, total = time.monotonic() + 2.0, 0
            while time.monotonic() < deadline and total < (64 << 20):
                chunk = self.connection.recv(1 << 16)
                if not chunk:
                    break
                total += len(chunk)
        except OSError:
            pass

    # ------------------------------------------------------------------ methods
    def do_GET(self):
        self._handle("GET")

    def do_HEAD(self):
        self._handle("HEAD")

    def do_POST(self):
        self._handle("POST")

    def do_PUT(self):
        self._handle("PUT")

    def do_DELETE(self):
        self._handle("DELETE")

    def do_PATCH(self):
        self._handle("PATCH")

    def do_OPTIONS(self):
        self._handle("OPTIONS")

    def handle_expect_100(self):
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = 0
        if n > self.server.config.max_body:  # refuse before the client sends the body
            self.route_path = normalize_path(self.path)
            self.close_connection = True
            self._send_json(
                413,
                self._dialect().error_body(
                    ApiError(
                        413, f"the request body is {n} bytes; the limit is {self.server.config.max_body}", "too_large"
                    )
                ),
            )
            return False
        return super().handle_expect_100()

    def _handle(self, method: str) -> None:
        self._rid = None
        self.headers_sent = False
        self.route_path = normalize_path(self.path)
        self.route_name = None
        self.body_pending = (
            method in ("POST", "PUT", "PATCH")
            or bool(self.headers.get("Content-Length"))
            or "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        )
        try:
            self._route(method)
        except ClientGone:
            self.close_connection = True
        except ApiError as e:
            self._safe_error(e)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            self.close_connection = True
        except Exception:
            log.error("request failed:\n%s", traceback.format_exc())
            self._safe_error(ApiError(500, "internal server error (see the server log)", "server_error"))

    def _safe_error(self, err: ApiError) -> None:
        if getattr(self, "headers_sent", False):
            self.close_connection = True
            return
        try:
            self._send_api_error(err)
        except OSError:
            self.close_connection = True

    def _route(self, method: str) -> None:
        path = self.route_path
        cfg: Config = self.server.config
        self._check_framing()
        if cfg.loopback:
            self._check_host()
        if method == "HEAD" and path == "/":
            self._discard_body()
            return self._send_text(200, "", "text/plain")
        self._check_auth()  # every other route, unknown ones and wrong methods included
        if method == "OPTIONS":
            self._discard_body()
            self.send_response(204)
            self.send_header("Allow", "GET, HEAD, POST, OPTIONS")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return self._record(None, 204)
        get_name = (
            GET_ROUTES.get(path)
            or ("model" if path.startswith("/v1/models/") else None)
            or ("response" if path.startswith("/v1/responses/") else None)
        )
        post_name = POST_ROUTES.get(path)
        if method in ("GET", "HEAD") and get_name:
            self.route_name = {"model": "models", "response": "responses"}.get(get_name, get_name)
        elif method == "POST" and post_name:
            self.route_name = post_name
        elif get_name or post_name:
            allowed = "GET, HEAD" if get_name else "POST"
            raise ApiError(405, f"{method} is not allowed on {path}: use {allowed}", headers={"Allow": allowed})
        else:
            shown = unquote(urlsplit(self.path).path) or "/"
            raise ApiError(
                404,
                f"unknown route {method} {shown}: this server answers /v1/chat/completions, "
                "/v1/completions, /v1/responses, /v1/models, /v1/messages, /v1/messages/count_tokens, "
                "/health, /metrics",
                "not_found",
            )
        if method == "POST":
            self._check_content_type()
            body = parse_json_body(self._read_body())
            return self._post(post_name, body)
        self._discard_body()
        return self._get(self.route_name, path)

    def _check_framing(self) -> None:
        """Ambiguous body framing (request smuggling): answered 400, and the connection closed."""
        lengths = {v.strip() for v in self.headers.get_all("Content-Length") or []}
        chunked = any("chunked" in v.lower() for v in self.headers.get_all("Transfer-Encoding") or [])
        why = None
        if len(lengths) > 1:
            why = "the request has several different Content-Length headers"
        elif lengths and chunked:
            why = "the request has both Content-Length and Transfer-Encoding: chunked"
        if why:
            self.close_connection = True
            self.body_pending = False
            raise ApiError(400, why + ": send exactly one of them")

    def _check_host(self) -> None:
        host = self.headers.get("Host")
        if host is None:
            return
        name = host.rsplit(":", 1)[0] if not host.startswith("[") else host.split("]")[0] + "]"
        if not is_loopback_host(name.strip().lower()):
            raise ApiError(
                403,
                f"Host {host!r} is not a loopback name, and this server is bound to loopback "
                "(DNS-rebinding protection): connect to 127.0.0.1 or localhost",
                "permission",
            )

    def _check_auth(self) -> None:
        cfg: Config = self.server.config
        if cfg.api_key is None:
            return
        cands = []
        auth = self.headers.get("Authorization") or ""
        if auth[:7].lower() == "bearer ":
            cands.append(auth[7:].strip())
        if self.headers.get("x-api-key"):
            cands.append(self.headers["x-api-key"].strip())
        if not cfg.key_ok(cands):
            what = "no API key was sent" if not cands else "the API key is not valid"
            raise ApiError(
                401,
                f"{what}: send it as `Authorization: Bearer KEY` or `x-api-key: KEY`",
                "authentication",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def _check_content_type(self) -> None:
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if self.server.config.loopback and ctype in SIMPLE_TYPES:
            raise ApiError(
                415,
                f"Content-Type {ctype!r} is not accepted: send the JSON body with `Content-Type: application/json`",
                "unsupported_media",
            )

    # ------------------------------------------------------------------ routes
    def _get(self, name: str, path: str) -> None:
        engine: Engine = self.server.engine
        if name == "index":
            return self._send_json(
                200,
                {
                    "service": "mlx-dspark",
                    "version": __version__,
                    "model": engine.model_id,
                    "openai_base_url": "/v1",
                    "anthropic_base_url": "/",
                },
            )
        if name == "health":
            return self._send_json(200, self.server.health())
        if name == "metrics":
            pc = engine.prefix_cache.describe() if engine.prefix_cache is not None else None
            text = self.server.metrics.render(
                busy=engine.busy, queue_depth=engine.queue_depth, prefix_cache=pc, batch=engine.batch_steps()
            )
            return self._send_text(200, text, "text/plain; version=0.0.4; charset=utf-8")
        if path.startswith("/v1/responses/"):
            return self._send_json(200, responses.get_response(engine, path[len("/v1/responses/") :]))
        if path.startswith("/v1/models/"):
            return self._send_json(200, openai.get_model(engine, path[len("/v1/models/") :], self.server.started))
        return self._send_json(200, openai.list_models(engine, self.server.started))

    def _post(self, name: str, body: dict) -> None:
        engine: Engine = self.server.engine
        if name == "count_tokens":
            return self._send_json(200, anthropic.count_tokens(engine, body))
        planner = {
            "chat": openai.plan_chat,
            "completion": completions.plan_completion,
            "messages": anthropic.plan_messages,
            "responses": responses.plan_responses,
        }[name]
        plan = planner(engine, body)
        job = engine.submit(plan.req)
        self.server.track(+1)
        try:
            if plan.stream:
                self._stream(plan, job)
            else:
                self._answer(plan, job)
        finally:
            self.server.track(-1)
            if job.state != "done":
                job.cancel("client disconnected" if self.close_connection else "request ended")

    # ------------------------------------------------------------------ waiting on the engine
    def _client_gone(self) -> bool:
        sock = self.connection
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            if not readable:
                return False
            return sock.recv(1, socket.MSG_PEEK | getattr(socket, "MSG_DONTWAIT", 0)) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except (OSError, ValueError):
            return True

    def _gone(self, job) -> None:
        job.cancel("client disconnected")
        self.close_connection = True
        raise ClientGone()

    def _wait(self, job, on_text, on_idle=None):
        """Pump a Job's events until it ends; returns ("done", outcome) or ("error", exc)."""
        held = None
        checked = time.monotonic()
        while True:
            ev, held = (held, None) if held is not None else (job.next_event(POLL_S), None)
            # The client is looked at every POLL_S, also while events keep coming (a non-streaming
            # answer gets text events every round and would otherwise never look).
            if ev is None or time.monotonic() - checked >= POLL_S:
                checked = time.monotonic()
                if self._client_gone():
                    self._gone(job)
            if ev is None:
                if on_idle is not None:
                    on_idle()
                continue
            kind, payload = ev
            if kind == "text":
                texts = [payload]
                while held is None:  # whatever else is already queued goes out in the same write
                    nxt = job.next_event(0)
                    if nxt is None:
                        break
                    if nxt[0] == "text":
                        texts.append(nxt[1])
                    else:
                        held = nxt
                on_text("".join(texts))
                continue
            if kind == "cancelled":
                self._gone(job)
            return kind, payload

    @staticmethod
    def _error_of(exc) -> ApiError:
        if isinstance(exc, ApiError):
            return exc
        if isinstance(exc, UserError):
            return ApiError(400, str(exc))
        return ApiError(500, f"generation failed: {type(exc).__name__}: {exc}", "server_error")

    def _answer(self, plan: Plan, job) -> None:
        kind, payload = self._wait(job, on_text=lambda _t: None)
        if kind == "error":
            raise self._error_of(payload)
        text = payload.result.text
        events = plan.parser.feed(text) + plan.parser.finish() if plan.parser is not None else [("text", text)]
        self._send_json(200, plan.responder.body(job, events))

    def _stream(self, plan: Plan, job) -> None:
        chunked = self.request_version == "HTTP/1.1"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("X-Accel-Buffering", "no")
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.close_connection = True
            self.send_header("Connection", "close")
        self.end_headers()
        self.headers_sent = True
        self._record(None, 200)
        last = [time.monotonic()]
        resp, parser = plan.responder, plan.parser

        def write(frames) -> None:
            data = b"".join(frames)
            if not data:
                return
            if self._client_gone():  # cheaper than learning it from the second failed write
                self._gone(job)
            try:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
            except OSError:
                job.cancel("client disconnected")
                self.close_connection = True
                raise ClientGone() from None
            last[0] = time.monotonic()

        def on_text(text: str) -> None:
            events = parser.feed(text) if parser is not None else [("text", text)]
            write(resp.stream_events(events))

        def on_idle() -> None:
            if time.monotonic() - last[0] >= self.server.config.keepalive_s:
                write([resp.ping()])

        write(resp.stream_start())
        kind, payload = self._wait(job, on_text, on_idle)
        if kind == "error":
            write(resp.stream_error(self._error_of(payload)))
        else:
            tail = parser.finish() if parser is not None else []
            write(resp.stream_events(tail) + resp.stream_finish(job))
        if chunked:
            try:
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                self.close_connection = True
