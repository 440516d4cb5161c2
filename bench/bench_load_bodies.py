"""Huge bodies against `mlx-dspark serve`: how long an over-context prompt takes to be refused, by
body size, and whether a small request waits behind a huge count_tokens.

    python bench/bench_load_bodies.py                 # the demo model, in-process server
    python bench/bench_load_bodies.py --model DIR --sizes 0.01,1,8,31

Each size is one /v1/messages request whose single user message is that many MB of prose (far
past any context window); the time is from sending the body to reading the 400. Then a huge (--count-mb)
count_tokens runs while a small count_tokens is timed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time

WORDS = "The quick brown fox jumps over the lazy dog while a journey of many miles begins today. "


def post(port: int, path: str, body: dict, timeout: float = 600) -> tuple[int, dict, float]:
    data = json.dumps(body).encode()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    c.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    out = json.loads(r.read())
    return r.status, out, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="target (default: the demo model)")
    ap.add_argument("--sizes", default="0.1,1,4,16,31", help="body sizes in MB (each past the window)")
    ap.add_argument("--count-mb", type=float, default=30, help="size of the huge count_tokens (MB)")
    args = ap.parse_args()

    from mlx_dspark.models.demo import demo_model_path
    from mlx_dspark.models.loading import load_target
    from mlx_dspark.serve.engine import Engine
    from mlx_dspark.serve.server import make_server

    target, tokenizer = load_target(args.model or str(demo_model_path()))
    engine = Engine(target, tokenizer, mode="baseline")
    server = make_server(engine, "127.0.0.1", 0, max_body=32 << 20)
    engine.start()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port, model = server.port, engine.model_id
    print(f"model {model}, context window {engine.context_window}")
    worst = 0.0
    for mb in (float(x) for x in args.sizes.split(",")):
        text = WORDS * max(1, int(mb * (1 << 20) / len(WORDS)))
        status, out, took = post(
            port, "/v1/messages", {"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": text}]}
        )
        worst = max(worst, took)
        msg = out.get("error", {}).get("message", "")
        print(f"{len(text) / (1 << 20):7.2f} MB over-context /v1/messages: HTTP {status} in {took:6.3f} s  {msg[:60]}")
    text = WORDS * int(args.count_mb * (1 << 20) / len(WORDS))
    big: dict = {}

    def run_big():
        big["r"] = post(
            port, "/v1/messages/count_tokens", {"model": model, "messages": [{"role": "user", "content": text}]}
        )
        big["t_end"] = time.perf_counter()

    th = threading.Thread(target=run_big)
    th.start()
    time.sleep(1.0)
    status, small, took = post(
        port, "/v1/messages/count_tokens", {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    )
    t_small = time.perf_counter()
    th.join()
    st, out, big_took = big["r"]
    print(
        f"{args.count_mb:g} MB count_tokens: HTTP {st}, {out.get('input_tokens')} tokens in {big_took:.1f} s; a small "
        f"count_tokens sent 1 s into it answered in {took:.3f} s "
        f"({'before' if t_small < big['t_end'] else 'after'} the big one finished)"
    )
    print(f"worst over-context refusal: {worst:.3f} s")
    server.shutdown()
    engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
