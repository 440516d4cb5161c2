"""Server throughput: requests/s and time to first token for short chat requests, sequentially and
with N concurrent clients, against `mlx-dspark serve` running as its own process.

    PYTHONPATH=python python bench/bench_serve.py                       # a tiny fixture model
    PYTHONPATH=python python bench/bench_serve.py --model PATH --mode baseline --requests 40

TTFT is measured from sending the request to the first SSE chunk that carries text (the role chunk
that opens every stream does not count). Latency is to `data: [DONE]`. With several clients the
engine still serves one request at a time (batching comes later), so queueing shows up in TTFT.
"""

from __future__ import annotations

import argparse
import atexit
import http.client
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start_server(model: str, mode: str, extra: list[str]) -> tuple[subprocess.Popen, int, str]:
    run = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    atexit.register(shutil.rmtree, run, True)
    run.chmod(0o700)
    env = dict(os.environ, XDG_RUNTIME_DIR=str(run), PYTHONPATH=str(ROOT / "python"))
    env.pop("MLX_DSPARK_API_KEY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_dspark", "serve", "--model", model, "--mode", mode, "--port", "0", *extra],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    t0 = time.monotonic()
    while True:
        files = list((run / "mlx-dspark").glob("*.json")) if (run / "mlx-dspark").exists() else []
        if files:
            info = json.loads(files[0].read_text())
            return proc, info["port"], info["model"]
        if proc.poll() is not None or time.monotonic() - t0 > 300:
            raise SystemExit("server failed to start:\n" + (proc.stderr.read() if proc.stderr else ""))
        time.sleep(0.1)


def one_request(port: int, model: str, i: int, max_tokens: int) -> dict:
    body = json.dumps(
        {
            "model": model,
            "stream": True,
            "max_tokens": max_tokens,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"Request {i}: say hello to the world."}],
        }
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    ttft = None
    x = None
    n_tokens = 0
    while True:
        line = r.readline()  # http.client undoes the chunked framing
        if not line:
            break
        if not line.startswith(b"data: "):
            continue
        payload = line[6:].strip()
        if payload == b"[DONE]":
            break
        obj = json.loads(payload)
        delta = obj["choices"][0]["delta"] if obj.get("choices") else {}
        if ttft is None and (delta.get("content") or delta.get("reasoning_content")):
            ttft = time.perf_counter() - t0
        if "x_mlx_dspark" in obj:
            x = obj["x_mlx_dspark"]
        if obj.get("usage"):
            n_tokens = obj["usage"]["completion_tokens"]
    total = time.perf_counter() - t0
    conn.close()
    return {"ttft": ttft if ttft is not None else total, "latency": total, "x": x, "tokens": n_tokens}


def run_phase(port: int, model: str, n: int, clients: int, max_tokens: int) -> dict:
    results: list[dict] = []
    lock = threading.Lock()
    counter = iter(range(n))

    def worker():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            res = one_request(port, model, i, max_tokens)
            with lock:
                results.append(res)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = sorted(r["ttft"] for r in results)
    lat = sorted(r["latency"] for r in results)

    def pct(v, q):
        return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]

    tps = [r["x"]["tokens_per_sec"] for r in results if r["x"]]
    return {
        "clients": clients,
        "requests": n,
        "wall_s": wall,
        "rps": n / wall,
        "ttft_p50_ms": 1000 * pct(ttft, 0.5),
        "ttft_p95_ms": 1000 * pct(ttft, 0.95),
        "lat_p50_ms": 1000 * pct(lat, 0.5),
        "lat_p95_ms": 1000 * pct(lat, 0.95),
        "decode_tps_median": statistics.median(tps) if tps else 0.0,
        "tokens_mean": statistics.mean(r["tokens"] for r in results),
    }


def machine() -> str:
    import mlx.core as mx

    from mlx_dspark.benchmark import cpu_name

    cpu = cpu_name()
    blas = "OpenBLAS preloaded" if "openblas" in os.environ.get("LD_PRELOAD", "") else "bundled BLAS"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores (load average {load} "
        f"when it finished); Python {platform.python_version()}; MLX {mx.__version__} "
        f"({mx.default_device()}); {blas}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model folder (default: a tiny random fixture model, written to a temp dir)")
    ap.add_argument("--fixture-layers", type=int, default=4)
    ap.add_argument("--fixture-hidden", type=int, default=64)
    ap.add_argument("--fixture-vocab", type=int, default=0, help="pad the embedding/head to this many rows")
    ap.add_argument("--mode", default="lookup")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", help="append a markdown section to this file")
    args = ap.parse_args()

    model_desc = args.model
    if args.model is None:
        sys.path.insert(0, str(ROOT / "tests"))
        from fixtures import write_model

        scratch = Path(tempfile.mkdtemp(prefix="bench-model-"))
        atexit.register(shutil.rmtree, scratch, True)
        path = scratch / "fixture-qwen3"
        heads = max(4, args.fixture_hidden // 64)
        write_model(
            path,
            "qwen3",
            layers=args.fixture_layers,
            hidden=args.fixture_hidden,
            heads=heads,
            kv_heads=max(1, heads // 2),
            intermediate=args.fixture_hidden * 2,
            model_vocab=args.fixture_vocab,
        )
        args.model = str(path)
        vocab = max(384, args.fixture_vocab)
        model_desc = (
            f"fixture qwen3 (tests/fixtures.write_model: {args.fixture_layers} layers, hidden "
            f"{args.fixture_hidden}, vocab {vocab}, float32, random weights)"
        )
    proc, port, model = start_server(args.model, args.mode, [])
    try:
        run_phase(port, model, 3, 1, args.max_tokens)  # warm up (compiles, caches)
        seq = run_phase(port, model, args.requests, 1, args.max_tokens)
        conc = run_phase(port, model, args.requests, args.clients, args.max_tokens)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    rows = [seq, conc]
    head = (
        "| clients | requests | tokens/request | req/s | TTFT p50 ms | TTFT p95 ms | latency p50 ms "
        "| latency p95 ms | decode tok/s (median) |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['clients']} | {r['requests']} | {r['tokens_mean']:.1f} | {r['rps']:.1f} | "
            f"{r['ttft_p50_ms']:.1f} | {r['ttft_p95_ms']:.1f} | {r['lat_p50_ms']:.1f} | "
            f"{r['lat_p95_ms']:.1f} | {r['decode_tps_median']:.0f} |"
        )
    pre = f"LD_PRELOAD={os.environ['LD_PRELOAD']} " if os.environ.get("LD_PRELOAD") else ""
    cmd = pre + "PYTHONPATH=python python bench/bench_serve.py " + " ".join(sys.argv[1:])
    section = "\n".join(
        [
            f"### {model_desc}, mode {args.mode}",
            "",
            f"- command: `{cmd.strip()}`",
            f"- machine: {machine()}",
            f"- requests: streaming /v1/chat/completions, a ~20-token prompt, max_tokens {args.max_tokens}, greedy; "
            f"server in its own process on 127.0.0.1, one new http.client connection per request",
            "",
            *lines,
            "",
        ]
    )
    print(section)
    if args.out:
        with open(args.out, "a") as f:
            f.write(section + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
