"""A client that goes away frees the engine within one round, and the next request is served."""

from __future__ import annotations

import json
import socket
import time

import openai
import pytest
from serve_support import LiveServer, make_model

ROUND_DELAY = 0.02  # every forward takes at least this long, so rounds are measurable


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = LiveServer(make_model(tmp_path_factory.mktemp("d")), mode="baseline", max_queue=1)
    yield s
    s.close()


def send(port: int, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(
        b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (path.encode(), len(data), data)
    )
    return s


def wait_for(cond, timeout=10.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return True
        time.sleep(0.005)
    return False


def running_job(srv):
    assert wait_for(lambda: srv.engine.current is not None)
    return srv.engine.current


def assert_served_next(srv):
    srv.script.say("next one", delay=0)
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=20)
    r = c.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "hi"}], max_tokens=10)
    assert r.choices[0].message.content == "next one"


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}], "stream": True}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "go"}], "stream": True}),
    ],
)
def test_dropped_stream_stops_within_a_round(srv, path, body):
    srv.script.say("tick tock ", eos=False, delay=ROUND_DELAY)
    s = send(srv.port, path, {**body, "model": srv.model, "max_tokens": 3000})
    got = b""
    while got.count(b"data: ") < 6:  # the stream is flowing
        got += s.recv(4096)
    assert got.startswith(b"HTTP/1.1 200")
    job = running_job(srv)
    s.close()
    t_close = time.monotonic()
    assert wait_for(lambda: job.state == "done", timeout=5)
    stopped_after = time.monotonic() - t_close
    res = job.outcome.result
    assert res.finish_reason == "cancelled" and len(res.tokens) < 3000
    assert job.commits_at_cancel is not None and job.commits - job.commits_at_cancel <= 1  # within one round
    assert stopped_after < 1.0, stopped_after
    assert_served_next(srv)


def test_dropped_non_streaming_request_is_cancelled_while_waiting(srv):
    srv.script.say("tick tock ", eos=False, delay=ROUND_DELAY)
    s = send(
        srv.port,
        "/v1/chat/completions",
        {"model": srv.model, "max_tokens": 3000, "messages": [{"role": "user", "content": "go"}]},
    )
    job = running_job(srv)
    assert wait_for(lambda: job.commits >= 5)
    s.close()
    assert wait_for(lambda: job.state == "done", timeout=5)
    assert job.outcome.result.finish_reason == "cancelled"
    assert job.commits - job.commits_at_cancel <= 1
    assert_served_next(srv)


def test_queued_request_whose_client_left_never_runs(srv):
    srv.script.say("tick tock ", eos=False, delay=ROUND_DELAY)
    a = send(
        srv.port,
        "/v1/chat/completions",
        {"model": srv.model, "max_tokens": 3000, "stream": True, "messages": [{"role": "user", "content": "first"}]},
    )
    job_a = running_job(srv)
    b = send(srv.port, "/v1/completions", {"model": srv.model, "max_tokens": 50, "prompt": "second"})
    assert wait_for(lambda: srv.engine.queue_depth == 1)
    job_b = srv.engine._queue.queue[0]
    b.close()
    assert wait_for(lambda: job_b.cancelled.is_set(), timeout=2)  # noticed while it waited in the queue
    a.close()
    assert wait_for(lambda: job_b.state == "done", timeout=5)
    assert job_a.outcome.result.finish_reason == "cancelled"
    assert job_b.outcome is None and job_b.t_start is None and job_b.commits == 0  # never prefilled
    assert_served_next(srv)


def test_full_queue_answers_429_and_recovers(srv):
    srv.script.say("tick tock ", eos=False, delay=ROUND_DELAY)
    a = send(
        srv.port,
        "/v1/chat/completions",
        {"model": srv.model, "max_tokens": 3000, "stream": True, "messages": [{"role": "user", "content": "first"}]},
    )
    running_job(srv)
    b = send(
        srv.port,
        "/v1/chat/completions",
        {"model": srv.model, "max_tokens": 5, "messages": [{"role": "user", "content": "queued"}]},
    )
    assert wait_for(lambda: srv.engine.queue_depth == 1)
    c = send(
        srv.port,
        "/v1/messages",
        {"model": srv.model, "max_tokens": 5, "messages": [{"role": "user", "content": "one too many"}]},
    )
    head = b""
    while b'"error"' not in head or not head.endswith(b"}}"):
        chunk = c.recv(65536)
        if not chunk:
            break
        head += chunk
    head = head.decode()
    assert head.startswith("HTTP/1.1 429") and "Retry-After: 1" in head and "rate_limit_error" in head
    for s in (c, b, a):
        s.close()
    assert wait_for(lambda: not srv.engine.busy and srv.engine.queue_depth == 0, timeout=5)
    assert_served_next(srv)


def test_stream_keepalive_pings_while_waiting(tmp_path_factory):
    s = LiveServer(make_model(tmp_path_factory.mktemp("p")), keepalive_s=0.1)
    try:
        s.script.say("slow", eos=True, delay=0.15)
        sock = send(
            s.port,
            "/v1/messages",
            {"model": s.model, "max_tokens": 20, "stream": True, "messages": [{"role": "user", "content": "x"}]},
        )
        data = b""
        while b"message_stop" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        sock.close()
        assert data.count(b"event: ping") >= 2  # the first one, then keep-alives during slow rounds
    finally:
        s.close()


def test_long_prefill_reports_progress_and_is_cancelled_between_chunks(srv, monkeypatch, caplog):
    import urllib.request

    from mlx_dspark.serve import engine as engine_mod

    monkeypatch.setattr(engine_mod, "PROGRESS_AFTER_S", 0.0)
    srv.script.say("never said", delay=1.0)  # each forward (each 2,048-token prefill chunk) takes 1 s
    prompt = list(range(10, 200)) * 19  # 3,610 token ids: two prefill chunks, then the last token
    before = srv.script.forwards
    s = send(srv.port, "/v1/completions", {"model": srv.model, "prompt": prompt, "max_tokens": 5})
    job = running_job(srv)

    def metric(name):
        text = urllib.request.urlopen(srv.url + "/metrics", timeout=5).read().decode()
        return int(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))

    with caplog.at_level("INFO", logger="mlx_dspark.serve"):
        assert wait_for(lambda: metric("mlx_dspark_prefill_tokens_done") == 2048, timeout=90)
        assert metric("mlx_dspark_prefill_tokens_total") == len(prompt) and job.prefilled == 2048
        s.close()  # the client leaves during the second chunk
        assert wait_for(lambda: job.state == "done", timeout=90)
    assert job.outcome.result.finish_reason == "cancelled" and job.outcome.result.tokens == []
    assert srv.script.forwards - before == 2  # the chunk under way finished; the last token never ran
    assert any(f"prefill 2048/{len(prompt)} tokens" in r.getMessage() for r in caplog.records)
    assert metric("mlx_dspark_prefill_tokens_total") == 0
    assert_served_next(srv)
