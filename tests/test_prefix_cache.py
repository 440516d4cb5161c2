"""The prefix cache: a warm run equals a cold run, token for token and in text, through slots,
evictions, spills to disk and restarts; stale or corrupt entries are never trusted. The prefill's
chunk grid is lowered to GRID so that these short prompts have whole chunks to reuse (an entry
keeps only a prompt's whole chunks of the grid; tests/test_prefix_cache_bitwise.py says why)."""

from __future__ import annotations

import json

import pytest
from drafter_fixtures import target, workspace
from fixtures import scratch_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prefix_fixtures import context_pair

from mlx_dspark.api import encode_prompt, generate
from mlx_dspark.decode import loop
from mlx_dspark.models.drafters import load_drafter
from mlx_dspark.serve.prefix_cache import FORMAT, PrefixCache

GRID = 4
_D: dict = {}


@pytest.fixture(autouse=True)
def small_grid(monkeypatch):
    monkeypatch.setattr(loop, "PREFILL_CHUNK", GRID)


def _whole_chunks(prompt, grid: int) -> int:
    """The positions of a prompt an entry keeps, the last token excluded: all of them where the
    prefill is split-invariant (PrefixCache.grid 1: this CPU in float32), else its whole chunks of
    the grid."""
    return (len(prompt) - 1) // grid * grid


def _pair():
    ws = workspace()
    t, tok = target(ws["target_qwen3"])
    if "d" not in _D:
        _D["d"] = load_drafter(str(ws["dspark_qwen3"]), t, bits=16)
    return t, tok, _D["d"]


def _run(t, tok, d, ids, mode, n, pc=None):
    return generate(
        t,
        tok,
        None,
        prompt_ids=ids,
        mode=mode,
        drafter=d if mode == "dspark" else None,
        max_new_tokens=n,
        prefix_cache=pc,
    )


turn = st.tuples(
    st.integers(0, 2),  # which conversation
    st.lists(st.integers(3, 300), min_size=1, max_size=24),  # the new user tokens
    st.sampled_from(["baseline", "lookup", "dspark"]),
    st.integers(1, 12),
    st.booleans(),
)  # restart the cache (a new process: RAM gone, disk kept) first


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(
    turns=st.lists(turn, min_size=3, max_size=9), slots=st.integers(1, 3), spill=st.booleans(), tiny_ram=st.booleans()
)
def test_warm_equals_cold(turns, slots, spill, tiny_ram):
    t, tok, d = context_pair()  # a target that reads its context: a wrong cache shows
    spill_dir = str(scratch_dir("prefix-spill-")) if spill else None

    def fresh():
        return PrefixCache(t, slots=slots, max_ram_mb=0.01 if tiny_ram else None, spill_dir=spill_dir)

    pc = fresh()
    assert pc.enabled, pc.off_reason
    start = encode_prompt(tok, "the fox and the weather")
    convs = [list(start) for _ in range(3)]
    asked = [list(start) for _ in range(3)]  # each conversation's last prompt
    previous = None
    for which, user, mode, n, restart in turns:
        if restart:
            pc = fresh()
        ids = convs[which] + user
        warm = _run(t, tok, d, ids, mode, n, pc)
        cold = _run(t, tok, d, ids, mode, n)
        assert warm.tokens == cold.tokens and warm.text == cold.text, (mode, len(ids), warm.cached_tokens)
        assert warm.cached_tokens < len(ids)
        # The newest entry is this conversation's: a hit, unless this mode taps hidden states
        # (dspark) that the entry, written by a mode without taps, does not hold.
        if previous is not None and previous[0] == which and not restart and (mode != "dspark" or previous[1] == mode):
            assert warm.cached_tokens >= _whole_chunks(asked[which], pc.grid), (warm.cached_tokens, len(asked[which]))
        assert warm.cached_tokens % pc.grid == 0
        previous = (which, mode)
        convs[which] = ids + warm.tokens
        asked[which] = ids


def test_a_follow_up_turn_reuses_the_conversation():
    t, tok, d = context_pair()
    pc = PrefixCache(t, slots=2)
    ids = encode_prompt(tok, "the fox and the weather repeat hello world")
    first = _run(t, tok, d, ids, "dspark", 10, pc)
    assert first.cached_tokens == 0 and pc.stats["misses"] == 1
    follow = ids + first.tokens + [40, 41, 42]
    second = _run(t, tok, d, follow, "dspark", 10, pc)
    assert second.cached_tokens == _whole_chunks(ids, pc.grid) > 0 and pc.stats["hits"] == 1
    cold = _run(t, tok, d, follow, "dspark", 10)
    assert second.tokens == cold.tokens and second.text == cold.text


def test_a_cancelled_generation_leaves_nothing():
    t, tok, _ = _pair()
    pc = PrefixCache(t, slots=2)
    ids = encode_prompt(tok, "hello world")
    generate(t, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=20, prefix_cache=pc, cancel=lambda: True)
    assert pc.describe()["in_ram"] == 0


def test_stale_and_corrupt_entries_on_disk_are_ignored(tmp_path, caplog):
    t, tok, _ = _pair()
    spill = tmp_path / "spill"
    pc = PrefixCache(t, slots=1, spill_dir=str(spill))
    a = encode_prompt(tok, "the fox and the weather")  # both with a whole chunk of the grid to keep
    b = encode_prompt(tok, "print x = x + 1 and y")
    assert _whole_chunks(a, pc.grid) > 0 and _whole_chunks(b, pc.grid) > 0
    _run(t, tok, None, a, "baseline", 6, pc)
    _run(t, tok, None, b, "baseline", 6, pc)  # pushes the first entry out of RAM, onto disk
    files = sorted((spill / pc.key).glob("*.safetensors"))
    assert len(files) == 1
    # A restart reads it back: a hit, and the same tokens as cold.
    pc2 = PrefixCache(t, slots=1, spill_dir=str(spill))
    warm = _run(t, tok, None, a + [50, 51], "baseline", 6, pc2)
    assert warm.cached_tokens > 0 and warm.tokens == _run(t, tok, None, a + [50, 51], "baseline", 6).tokens
    # Corrupt the file on disk: the next start ignores it with a warning, and runs cold.
    _run(t, tok, None, b, "baseline", 6, pc2)  # the warm turn's entry (it replaced the first) goes to disk
    pc2.ram.clear()
    assert len(list((spill / pc.key).glob("*.safetensors"))) == 1
    for f in (spill / pc.key).glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:100])
    pc3 = PrefixCache(t, slots=1, spill_dir=str(spill))
    assert pc3.stats["ignored"] >= 1 and not pc3.disk
    cold = _run(t, tok, None, a + [50, 51], "baseline", 6, pc3)
    assert cold.cached_tokens == 0
    # An entry written for another model (its key differs) is never read.
    other = spill / pc.key / "x.safetensors"
    import mlx.core as mx

    mx.save_safetensors(
        str(other),
        {"k.0": mx.zeros((1,))},
        metadata={"format": FORMAT, "model_key": "someone-else", "tokens": json.dumps(a)},
    )
    pc4 = PrefixCache(t, slots=1, spill_dir=str(spill))
    assert "x" not in pc4.disk and not other.exists()


def test_invalidate_drops_the_entry_a_failed_request_used():
    t, tok, _ = _pair()
    pc = PrefixCache(t, slots=2)
    ids = encode_prompt(tok, "the weather")
    r = _run(t, tok, None, ids, "baseline", 4, pc)
    assert pc.lookup(ids + r.tokens + [7]) is not None
    pc.invalidate()
    assert pc.lookup(ids + r.tokens + [7]) is None


def test_targets_without_plain_kv_caches_say_why(model_dir):
    from mlx_dspark.models.loading import load_target

    t, _ = load_target(str(model_dir("qwen3", heads=2, kv_heads=1)), kv_bits=4)
    pc = PrefixCache(t)
    assert not pc.enabled and "plain KV caches" in pc.off_reason
    assert pc.lookup([1, 2, 3]) is None


def test_the_server_reports_reuse_in_both_dialects_and_in_metrics():
    import threading
    import urllib.request

    from mlx_dspark.serve.engine import Engine
    from mlx_dspark.serve.server import make_server

    t, tok, _ = _pair()
    servers = {}
    for name, pc in (("warm", PrefixCache(t, slots=2)), ("cold", None)):
        engine = Engine(t, tok, mode="lookup", prefix_cache=pc, default_max_tokens=16)
        server = make_server(engine, "127.0.0.1", 0, idle_timeout=10.0)
        engine.start()
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers[name] = (engine, server)

    def post(name, path, body):
        engine, server = servers[name]
        req = urllib.request.Request(
            server.url + path,
            data=json.dumps({"model": engine.model_id, **body}).encode(),
            headers={"Content-Type": "application/json", "anthropic-version": "2023-06-01"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    try:
        msgs = [{"role": "user", "content": "the fox and the weather repeat hello world " * 3}]
        first = post("warm", "/v1/chat/completions", {"messages": msgs, "max_tokens": 8})
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        follow = msgs + [
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "and then?"},
        ]
        warm = post("warm", "/v1/chat/completions", {"messages": follow, "max_tokens": 8})
        cold = post("cold", "/v1/chat/completions", {"messages": follow, "max_tokens": 8})
        assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
        assert 0 < warm["usage"]["prompt_tokens_details"]["cached_tokens"] < warm["usage"]["prompt_tokens"]
        a = post("warm", "/v1/messages", {"messages": follow, "max_tokens": 8})
        ac = post("cold", "/v1/messages", {"messages": follow, "max_tokens": 8})
        assert a["content"] == ac["content"]
        u = a["usage"]
        assert u["cache_read_input_tokens"] > 0
        assert u["input_tokens"] + u["cache_read_input_tokens"] == ac["usage"]["input_tokens"]
        with urllib.request.urlopen(servers["warm"][1].url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        hits = [line for line in metrics.splitlines() if line.startswith("mlx_dspark_prefix_cache_hits_total")]
        assert hits and int(hits[0].split()[-1]) >= 2
    finally:
        for engine, server in servers.values():
            server.shutdown()
            server.server_close()
            engine.stop()
