"""Follow-up turn TTFT with the prefix cache against a cold server, through the real HTTP route.

A conversation of about --context tokens (eval/ prompts as user turns, the model's own answers
as assistant turns) is sent to two in-process servers on 127.0.0.1: one with the prefix cache
(the default), one with --no-prefix-cache. The first turn warms the cached server; then the
follow-up turn (the conversation plus its last answer plus a new question) is timed on both, to
the first streamed text. The answers must be the same text on both servers.

    python bench/bench_prefix_cache.py [--model DIR] [--dtype float32] [--context 2000] [--mode baseline]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _package  # noqa: E402,F401  (the installed mlx_dspark, else python/)

from mlx_dspark.benchmark import load_bench_target  # noqa: E402

EVAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "prompts" / "eval"


def _server(target, tok, mode, prefix_cache):
    from mlx_dspark.serve.engine import Engine
    from mlx_dspark.serve.prefix_cache import PrefixCache
    from mlx_dspark.serve.server import make_server

    pc = PrefixCache(target, slots=2) if prefix_cache else None
    engine = Engine(target, tok, mode=mode, prefix_cache=pc, default_max_tokens=64)
    server = make_server(engine, "127.0.0.1", 0, idle_timeout=60.0)
    engine.start()
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return engine, server


def _chat(url, model, messages, max_tokens):
    """(time to first text, full text, usage) of one streamed chat completion."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    ttft, text, usage = None, "", {}
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            for ch in ev.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text += piece
            usage = ev.get("usage") or usage
    return (ttft if ttft is not None else time.perf_counter() - t0), text, usage


def conversation(tok, n_tokens: int) -> list[dict]:
    """User turns from eval/ prompts and long assistant turns (the prompts' own text again),
    until the rendered chat is about `n_tokens` long."""
    rows = [json.loads(x) for x in (EVAL / "mt-bench.jsonl").read_text().splitlines() if x.strip()]
    msgs: list[dict] = []
    i = 0
    while True:
        turn = rows[i % len(rows)]["turns"][0]
        msgs += [{"role": "user", "content": turn}, {"role": "assistant", "content": (turn + " ") * 3}]
        i += 1
        n = len(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True))
        if n >= n_tokens:
            return msgs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--mode", default="baseline", help="decoding mode of both servers (default baseline)")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    where, target, tok = load_bench_target(args.model, args.dtype)
    msgs = conversation(tok, args.context)
    question = {"role": "user", "content": "Summarize our conversation in one sentence."}
    (e_w, s_w), (e_c, s_c) = _server(target, tok, args.mode, True), _server(target, tok, args.mode, False)
    try:
        # Warm-up of both (JIT, first-use costs), on an unrelated prompt.
        for s, e in ((s_w, e_w), (s_c, e_c)):
            _chat(s.url, e.model_id, [{"role": "user", "content": "hi"}], 4)
        t1, answer, u1 = _chat(s_w.url, e_w.model_id, msgs, args.max_tokens)  # turn 1: fills the cache
        follow = msgs + [{"role": "assistant", "content": answer}, question]
        warm_ttft, warm_text, u_w = _chat(s_w.url, e_w.model_id, follow, args.max_tokens)
        cold_ttft, cold_text, u_c = _chat(s_c.url, e_c.model_id, follow, args.max_tokens)
    finally:
        for s, e in ((s_w, e_w), (s_c, e_c)):
            s.shutdown()
            s.server_close()
            e.stop()
    cached = (u_w.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    print(
        f"target: {where}; mode {args.mode}; follow-up prompt {u_w.get('prompt_tokens')} tokens, "
        f"{cached} from the prefix cache"
    )
    print(f"turn 1 (cold, fills the cache): TTFT {t1 * 1000:.0f} ms")
    print(
        f"follow-up TTFT: cold server {cold_ttft * 1000:.0f} ms, with the prefix cache {warm_ttft * 1000:.0f} ms: "
        f"{cold_ttft / warm_ttft:.1f}x"
    )
    print(f"same answer: {'yes' if warm_text == cold_text else 'NO'}")
    return 0 if warm_text == cold_text else 1


if __name__ == "__main__":
    raise SystemExit(main())
