"""Load on `mlx-dspark serve`: N concurrent streams for a while; every stream's text must equal
its solo run, and the server's RSS must stay flat.

    python bench/bench_load.py --streams 32 --duration 300            # spawns a server on the demo model
    python bench/bench_load.py --url http://127.0.0.1:8080 --pid PID  # an existing server

Phase 1 runs each prompt alone (greedy, so the text is fixed) and keeps its text. Phase 2 opens
`--streams` client threads that loop for `--duration` seconds, each streaming its prompt (even
streams through OpenAI chat completions, odd ones through Anthropic messages) and comparing the
streamed text with the solo run. The server's RSS is sampled every 2 s; the baseline is the
first sample after every stream has finished once (allocator and caches warm). Prints one
summary; exits 1 on any mismatch, error or an RSS drift beyond --rss-tolerance.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

PROMPTS = [
    "Name three primary colors.",
    "What is 12 times 7?",
    "Write one sentence about the sea.",
    "List two fruits.",
    "Say hello in French.",
    "What is the capital of Japan?",
    "Give a synonym for happy.",
    "Count from one to five.",
]


def stream_text(base: str, model: str, prompt: str, max_tokens: int, anthropic: bool, timeout: float) -> str:
    u = urlsplit(base)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    msgs = [{"role": "user", "content": prompt}]
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "messages": msgs, "temperature": 0}
    c.request(
        "POST",
        "/v1/messages" if anthropic else "/v1/chat/completions",
        body=json.dumps(body),
        headers={"Content-Type": "application/json"},
    )
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
    text = []
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if "error" in ev and ev.get("type") in (None, "error"):
            raise RuntimeError(f"stream error: {ev['error']}")
        if anthropic:
            if ev.get("type") == "content_block_delta" and ev["delta"].get("type") == "text_delta":
                text.append(ev["delta"]["text"])
        elif ev.get("choices"):
            text.append(ev["choices"][0]["delta"].get("content") or "")
    c.close()
    return "".join(text)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_dspark", "serve", "--port", str(port), "--max-queue", str(args.streams + 8)]
    if args.model:
        cmd += ["--model", args.model]
    if args.mode:
        cmd += ["--mode", args.mode]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while time.monotonic() - t0 < 300:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return proc, url
        except OSError:
            time.sleep(0.5)
        if proc.poll() is not None:
            sys.exit(f"the server exited: {proc.stderr.read()}")
    proc.kill()
    sys.exit("the server did not start within 300 s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="an existing server (default: spawn one)")
    ap.add_argument("--pid", type=int, help="the existing server's pid (for RSS)")
    ap.add_argument("--model", help="model for the spawned server (default: the demo model)")
    ap.add_argument("--mode", help="decode mode of the spawned server")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 300)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--rss-tolerance", type=float, default=0.05)
    args = ap.parse_args()

    proc = None
    if args.url:
        url, pid = args.url.rstrip("/"), args.pid
    else:
        proc, url = spawn(args)
        pid = proc.pid
    try:
        c = http.client.HTTPConnection(urlsplit(url).hostname, urlsplit(url).port, timeout=10)
        c.request("GET", "/health")
        health = json.loads(c.getresponse().read())
        model = health["model"]
        timeout = 60.0 + 30.0 * args.streams
        t0 = time.perf_counter()
        solo = {
            (i, a): stream_text(url, model, p, args.max_tokens, a, timeout)
            for i, p in enumerate(PROMPTS)
            for a in (False, True)
        }
        solo_s = time.perf_counter() - t0
        print(f"solo runs: {len(solo)} in {solo_s:.1f} s ({health['mode']} mode, {model})", flush=True)

        stop = time.monotonic() + args.duration
        lock = threading.Lock()
        stats = {"done": 0, "mismatch": 0, "errors": [], "first_round": set()}
        samples: list[tuple[float, float, bool]] = []

        def client(k: int) -> None:
            i, a = k % len(PROMPTS), bool(k % 2)
            while time.monotonic() < stop:
                try:
                    got = stream_text(url, model, PROMPTS[i], args.max_tokens, a, timeout)
                except Exception as e:  # noqa: BLE001 - every failure is counted and shown
                    with lock:
                        stats["errors"].append(f"stream {k}: {e}")
                    continue
                with lock:
                    stats["done"] += 1
                    stats["first_round"].add(k)
                    if got != solo[(i, a)]:
                        stats["mismatch"] += 1
                        if stats["mismatch"] <= 3:
                            print(f"MISMATCH stream {k}: {got!r} != {solo[(i, a)]!r}", flush=True)

        threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(args.streams)]
        t1 = time.perf_counter()
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            if pid:
                with lock:
                    warm = len(stats["first_round"]) == args.streams
                samples.append((time.perf_counter() - t1, rss_mb(pid), warm))
            time.sleep(2.0)
        wall = time.perf_counter() - t1
        warm = [r for _, r, w in samples if w]
        line = (
            f"load: {args.streams} concurrent streams for {wall:.0f} s: {stats['done']} streams completed "
            f"({stats['done'] / wall:.2f}/s), {stats['mismatch']} text mismatches, {len(stats['errors'])} errors"
        )
        print(line)
        ok = stats["mismatch"] == 0 and not stats["errors"] and stats["done"] > 0
        if warm:
            base, hi, lo = warm[0], max(warm), min(warm)
            drift = max(hi - base, base - lo) / base
            print(
                f"RSS: {samples[0][1]:.0f} MB at start, {base:.0f} MB when warm, {lo:.0f}..{hi:.0f} MB after "
                f"({drift * 100:+.1f}% max drift, {len(warm)} samples)"
            )
            ok = ok and drift <= args.rss_tolerance
        elif pid:
            print("RSS: not every stream finished once, so no warm baseline (run longer)")
            ok = False
        for e in stats["errors"][:5]:
            print("error:", e)
        return 0 if ok else 1
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    sys.exit(main())
