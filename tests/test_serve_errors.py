"""Bad input gets a 4xx in the envelope of the API that was called; the server stays up and the
connection stays usable; nothing too long is ever prefilled."""

from __future__ import annotations

import http.client
import json
import re
import socket
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_support import LiveServer, make_model, module_timer

_timer = module_timer("errors + fuzz suite")

OA_ROUTES = ["/v1/chat/completions", "/v1/completions"]
AN_ROUTES = ["/v1/messages", "/v1/messages/count_tokens"]
ANTHROPIC_TYPES = {
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "overloaded_error",
}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = LiveServer(make_model(tmp_path_factory.mktemp("e")), max_body=256 << 10)
    s.script.say("ok")
    yield s
    s.close()


class Client:
    """One keep-alive connection; remembers whether the server kept it open."""

    def __init__(self, port):
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
        self.conn.connect()

    def request(self, method, path, body=None, headers=None):
        if self.conn.sock is None:
            self.conn.connect()
        h = {"Content-Type": "application/json", **(headers or {})}
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        self.conn.request(method, path, body=body, headers=h)
        r = self.conn.getresponse()
        data = r.read()
        return r.status, data, r

    def sock(self):
        return self.conn.sock


def check_envelope(path, status, data):
    j = json.loads(data)
    if path.startswith("/v1/messages"):
        assert j["type"] == "error" and j["error"]["type"] in ANTHROPIC_TYPES, j
        assert isinstance(j["error"]["message"], str) and j["error"]["message"]
    else:
        assert set(j) == {"error"} and isinstance(j["error"]["message"], str) and j["error"]["message"], j
        assert isinstance(j["error"]["type"], str) and "param" in j["error"] and "code" in j["error"]
    return j


def good_chat(srv, c: Client):
    status, data, _ = c.request(
        "POST",
        "/v1/chat/completions",
        {"model": srv.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
    )
    assert status == 200, data
    assert json.loads(data)["choices"][0]["message"]["content"] == "ok"


def chat(srv, **over):
    body = {"model": srv.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    body.update(over)
    return body


def msg(srv, **over):
    body = {"model": srv.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    body.update(over)
    return body


BAD = [
    # (path, body, status, what the message must mention)
    ("/v1/chat/completions", "{not json", 400, "JSON"),
    ("/v1/messages", "{not json", 400, "JSON"),
    ("/v1/chat/completions", "[1, 2]", 400, "object"),
    ("/v1/chat/completions", b"\xff\xfe{}", 400, "UTF-8"),
    ("/v1/chat/completions", '{"model": NaN}', 400, "JSON"),
    ("/v1/chat/completions", "", 400, "empty"),
    ("/v1/chat/completions", lambda s: chat(s, messages="hi"), 400, "messages"),
    ("/v1/chat/completions", lambda s: chat(s, max_tokens="ten"), 400, "max_tokens"),
    ("/v1/chat/completions", lambda s: chat(s, max_tokens=True), 400, "max_tokens"),
    ("/v1/chat/completions", lambda s: chat(s, temperature="hot"), 400, "temperature"),
    ("/v1/chat/completions", lambda s: chat(s, stream="yes"), 400, "stream"),
    ("/v1/chat/completions", lambda s: chat(s, messages=[{"role": "user", "content": 5}]), 400, "content"),
    ("/v1/chat/completions", lambda s: chat(s, messages=[{"role": "wizard", "content": "x"}]), 400, "role"),
    ("/v1/chat/completions", lambda s: chat(s, messages=[]), 400, "messages"),
    ("/v1/chat/completions", lambda s: chat(s, tools={"a": 1}), 400, "tools"),
    ("/v1/chat/completions", lambda s: chat(s, temperature=5), 400, "temperature"),
    ("/v1/chat/completions", lambda s: chat(s, top_p=0), 400, "top_p"),
    ("/v1/chat/completions", lambda s: chat(s, max_tokens=0), 400, "max_tokens"),
    ("/v1/chat/completions", lambda s: chat(s, logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("/v1/chat/completions", lambda s: chat(s, presence_penalty=3), 400, "presence_penalty"),
    ("/v1/chat/completions", lambda s: chat(s, n=2), 400, "n"),
    ("/v1/chat/completions", lambda s: chat(s, response_format={"type": "json_object"}), 400, "response_format"),
    (
        "/v1/chat/completions",
        lambda s: chat(s, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400,
        "text-only",
    ),
    ("/v1/chat/completions", lambda s: chat(s, model="gpt-4o"), 404, "gpt-4o"),
    ("/v1/chat/completions", lambda s: {"messages": [{"role": "user", "content": "x"}]}, 400, "model"),
    ("/v1/completions", lambda s: {"model": s.model, "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", lambda s: {"model": s.model, "prompt": "a", "echo": True}, 400, "echo"),
    ("/v1/completions", lambda s: {"model": s.model, "prompt": [10**9]}, 400, "token ids"),
    ("/v1/messages", lambda s: msg(s, max_tokens=None), 400, "max_tokens"),
    ("/v1/messages", lambda s: msg(s, temperature=1.5), 400, "temperature"),
    ("/v1/messages", lambda s: msg(s, messages=[{"role": "system", "content": "x"}]), 400, "user or assistant"),
    ("/v1/messages", lambda s: msg(s, messages=[{"role": "user", "content": []}]), 400, "non-empty content"),
    (
        "/v1/messages/count_tokens",
        lambda s: {"model": s.model, "messages": [{"role": "user", "content": []}]},
        400,
        "non-empty content",
    ),
    ("/v1/messages", lambda s: msg(s, messages=[{"role": "wizard", "content": "x"}]), 400, "role"),
    ("/v1/messages", lambda s: msg(s, max_tokens=1 << 32), 400, "[1, 2147483648], got 4294967296"),
    ("/v1/chat/completions", lambda s: chat(s, top_p=0), 400, "(0, 1], got 0"),
    (
        "/v1/messages",
        lambda s: msg(s, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
        400,
        "text-only",
    ),
    (
        "/v1/messages",
        lambda s: msg(s, tools=[{"type": "web_search_20250305", "name": "web_search"}]),
        400,
        "server tool",
    ),
    ("/v1/messages", lambda s: msg(s, thinking={"type": "enabled", "budget_tokens": 10}), 400, "budget_tokens"),
    ("/v1/messages", lambda s: msg(s, tool_choice="auto"), 400, "tool_choice"),
    ("/v1/messages", lambda s: msg(s, model="claude-sonnet-4-5"), 404, "claude-sonnet-4-5"),
    ("/v1/messages/count_tokens", lambda s: {"model": s.model, "messages": "x"}, 400, "messages"),
]


@pytest.mark.parametrize("path,body,status,mention", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_input_then_the_same_connection_still_works(srv, path, body, status, mention):
    c = Client(srv.port)
    body = body(srv) if callable(body) else body
    got, data, _ = c.request("POST", path, body)
    assert got == status, data
    j = check_envelope(path, got, data)
    text = j["error"]["message"]
    assert mention.lower() in text.lower(), text
    sock = c.sock()
    assert sock is not None  # the server kept the connection open
    good_chat(srv, c)
    assert c.sock() is sock  # and the next request went over the same connection


def test_unknown_route_and_wrong_method(srv):
    c = Client(srv.port)
    status, data, _ = c.request("GET", "/v1/embeddings")
    assert status == 404 and "unknown route" in check_envelope("/v1/x", status, data)["error"]["message"]
    status, data, r = c.request("GET", "/v1/chat/completions")
    assert status == 405 and r.getheader("Allow") == "POST"
    status, data, _ = c.request("DELETE", "/v1/messages")
    assert status == 405 and check_envelope("/v1/messages", status, data)
    status, data, _ = c.request("POST", "/v1/nope", {"a": 1})
    assert status == 404
    good_chat(srv, c)


def test_unexpected_bodies_do_not_desync_keep_alive(srv):
    c = Client(srv.port)
    sock = c.sock()
    status, data, _ = c.request("GET", "/health", body='{"junk": true}')  # a GET with a body
    assert status == 200
    status, data, _ = c.request("POST", "/v1/nowhere", body='{"x": 1}')  # 404 before the body was read
    assert status == 404
    status, data, _ = c.request("GET", "/v1/models", headers={"Authorization": "Bearer whatever"})
    assert status == 200 and json.loads(data)["data"][0]["id"] == srv.model
    assert c.sock() is sock
    good_chat(srv, c)


def test_routes_answer_without_v1_and_with_query_strings(srv):
    c = Client(srv.port)
    status, data, _ = c.request(
        "POST",
        "/messages?beta=true",
        {"model": srv.model, "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]},
    )
    assert status == 200 and json.loads(data)["type"] == "message"
    status, data, _ = c.request("GET", "/models/")
    assert status == 200 and json.loads(data)["object"] == "list"
    status, _, _ = c.request("HEAD", "/")
    assert status == 200


def test_too_large_body_gets_413_not_a_reset(srv):
    c = Client(srv.port)
    big = json.dumps(chat(srv, messages=[{"role": "user", "content": "x" * (600 << 10)}]))
    status, data, r = c.request("POST", "/v1/chat/completions", big)
    assert status == 413 and check_envelope("/v1/chat/completions", status, data)
    status, data, _ = c.request("POST", "/v1/messages", big)
    assert status == 413 and check_envelope("/v1/messages", status, data)["error"]["type"] == "request_too_large"
    good_chat(srv, c)


def test_too_large_with_expect_100_continue(srv):
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 99999999\r\nExpect: 100-continue\r\n\r\n"
    )
    head = b""
    while True:  # the server closes after answering
        chunk = s.recv(65536)
        if not chunk:
            break
        head += chunk
    s.close()
    head = head.decode()
    assert head.startswith("HTTP/1.1 413") and '"error"' in head


def test_framing_errors(srv):
    def raw(data: bytes) -> str:
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        s.sendall(data)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
            if b"\r\n\r\n" in out and b"Content-Length: " in out:
                head, _, body = out.partition(b"\r\n\r\n")
                n = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                if len(body) >= n:
                    break
        s.close()
        return out.decode(errors="replace")

    assert raw(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n").startswith("HTTP/1.1 403")  # Host check
    assert raw(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").startswith("HTTP/1.1 411")
    assert raw(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: -4\r\n\r\n").startswith(
        "HTTP/1.1 400"
    )
    assert raw(b"BREW /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").startswith("HTTP/1.1 405")
    assert raw(b"GARBAGE\r\n\r\n").startswith("HTTP/1.1 400")
    assert raw(b"GET / HTTP/2.0\r\n\r\n").startswith("HTTP/1.1 400")  # never a 5xx for a client's error
    body = json.dumps(chat(srv)).encode()
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    ok = raw(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + chunked
    )
    assert ok.startswith("HTTP/1.1 200") and '"content":"ok"' in ok


def test_browser_simple_content_types_are_refused(srv):
    c = Client(srv.port)
    status, data, _ = c.request(
        "POST", "/v1/chat/completions", json.dumps(chat(srv)), headers={"Content-Type": "text/plain"}
    )
    assert status == 415 and "application/json" in check_envelope("/v1/chat", status, data)["error"]["message"]
    good_chat(srv, c)


def test_context_too_long_is_refused_before_prefill(srv):
    c = Client(srv.port)
    long_text = "hello world " * 3000  # more tokens than the fixture's 4096 window
    before = srv.script.forwards
    t0 = time.perf_counter()
    status, data, _ = c.request(
        "POST", "/v1/chat/completions", chat(srv, messages=[{"role": "user", "content": long_text}])
    )
    assert status == 400
    err = check_envelope("/v1/chat/completions", status, data)["error"]
    assert err["code"] == "context_length_exceeded" and "4096" in err["message"]
    status, data, _ = c.request("POST", "/v1/chat/completions", chat(srv, max_tokens=4090))  # prompt + budget
    assert status == 400 and json.loads(data)["error"]["code"] == "context_length_exceeded"
    status, data, _ = c.request("POST", "/v1/messages", msg(srv, messages=[{"role": "user", "content": long_text}]))
    assert status == 400
    err = check_envelope("/v1/messages", status, data)["error"]
    # The real API's two wordings (Claude Code parses the second and retries with a smaller max_tokens).
    assert err["type"] == "invalid_request_error"
    assert re.fullmatch(r"prompt is too long: (\d+) tokens > 4096 maximum", err["message"]), err
    status, data, _ = c.request("POST", "/v1/messages", msg(srv, max_tokens=32000))
    m = re.match(
        r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+), decrease input "
        r"length or `max_tokens` and try again$",
        json.loads(data)["error"]["message"],
    )
    assert status == 400 and m and int(m[2]) == 32000 and int(m[3]) == 4096 and 0 < int(m[1]) < 100, data
    status, data, _ = c.request("POST", "/v1/completions", {"model": srv.model, "prompt": "hi", "max_tokens": 5000})
    err = json.loads(data)["error"]
    assert status == 400 and err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    assert re.fullmatch(
        r"This model's maximum context length is 4096 tokens, however you requested (\d+) tokens "
        r"\((\d+) in your prompt; 5000 for the completion\)\. Please reduce your prompt; or "
        r"completion length\.",
        err["message"],
    ), err
    assert srv.script.forwards == before  # nothing was prefilled
    assert time.perf_counter() - t0 < 10
    good_chat(srv, c)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**12), 10**12) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=16,
)
KEYS = st.sampled_from(
    [
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stream",
        "tools",
        "tool_choice",
        "system",
        "prompt",
        "stop",
        "stop_sequences",
        "thinking",
        "logprobs",
        "top_logprobs",
        "n",
        "seed",
        "stream_options",
        "chat_template_kwargs",
        "enable_thinking",
        "content",
        "role",
        "input",
        "instructions",
        "max_output_tokens",
        "previous_response_id",
        "min_p",
    ]
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", 3]), "content": JSON | st.text(max_size=20)}
)


BASES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
    "/v1/completions": {"prompt": "hi", "max_tokens": 5},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"input": "hi", "max_output_tokens": 5},
}


@st.composite
def requests(draw, model):
    """A route and a body: raw junk, or a valid request with random fields changed or removed
    (so the checks deep inside each dialect are reached, and some requests are valid)."""
    path = draw(st.sampled_from(sorted(BASES)))
    kind = draw(st.sampled_from(["bytes", "json", "mutated", "mutated", "mutated"]))
    if kind == "bytes":
        return path, draw(st.binary(max_size=120))
    if kind == "json":
        return path, json.dumps(draw(JSON), allow_nan=True).encode()
    body = {"model": model, **BASES[path]}
    value = (
        JSON | st.just(model) | st.lists(MESSAGE, max_size=3) | st.integers(0, 5000) | st.booleans() | st.floats(-3, 3)
    )
    body.update(draw(st.dictionaries(KEYS, value, max_size=3)))
    for key in draw(st.sets(st.sampled_from(sorted(body)), max_size=2)):
        body.pop(key, None)
    return path, json.dumps(body, allow_nan=True).encode()


FUZZ_EXAMPLES = 2000


def test_random_junk_bodies(srv):
    """2,000 requests: no 5xx, every error in its envelope, no hang (each must answer within the
    client's 15 s timeout), and the whole run bounded (it prints how long it took)."""
    c = Client(srv.port)
    seen = {}
    t0 = time.perf_counter()

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    @given(requests(srv.model))
    def one(req):
        path, body = req
        status, data, r = c.request("POST", path, body)
        seen[status] = seen.get(status, 0) + 1
        assert status < 500, (path, body, data)
        if status >= 400:
            check_envelope(path, status, data)
        elif "text/event-stream" in (r.getheader("Content-Type") or ""):
            assert data.endswith(b"\n\n")
        else:
            json.loads(data)

    one()
    took = time.perf_counter() - t0
    print(f"\nfuzz: {sum(seen.values())} requests in {took:.1f} s, statuses {dict(sorted(seen.items()))}")
    assert sum(seen.values()) >= FUZZ_EXAMPLES and not any(k >= 500 for k in seen), seen
    assert took < 600, "the fuzz run is bounded: it must not creep toward CI's limit"
    # the strategy really exercised the validators, and valid requests too
    assert seen.get(400, 0) > 300 and seen.get(200, 0) > 150, seen
    good_chat(srv, c)
    status, data, _ = c.request("GET", "/health")
    assert status == 200 and json.loads(data)["status"] == "ok"


def test_metrics_count_requests_and_tokens(srv):
    c = Client(srv.port)
    good_chat(srv, c)
    status, data, r = c.request("GET", "/metrics")
    text = data.decode()
    assert status == 200 and r.getheader("Content-Type").startswith("text/plain")
    assert 'mlx_dspark_http_requests_total{route="chat",status="200"}' in text
    assert 'mlx_dspark_http_requests_total{route="chat",status="400"}' in text
    tokens = [line for line in text.splitlines() if line.startswith("mlx_dspark_completion_tokens_total ")]
    assert tokens and int(tokens[0].split()[1]) > 0
    assert "mlx_dspark_accept_length_bucket" in text and "mlx_dspark_decode_tokens_per_second" in text
