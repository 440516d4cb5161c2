"""Follow-up turn TTFT with the prefix cache against a cold server, through the real HTTP route.

A conversation of about --context tokens (eval/ prompts as user turns, the model's own answers
as assistant turns) is sent to two in-process servers on 127.0.0.1: one with the prefix cache
(the default), one with --no-prefix-cache. The first turn warms the cached server; then the
follow-up turn (the conversation plus its last answer plus a new question) is timed on both, to
the first streamed text. The answers must be the same text and token count on both servers.

`--rounds N` repeats this on N different conversations (new shapes compile in the first one on
a GPU); the ratio is the best cold TTFT over the best warm one. `--budget-s S` starts no round
that the previous one says would end past S seconds from the start (load included). Where the
warm TTFT goes is printed from the response's `x_mlx_dspark` (queue, prefill of the new tokens,
the engine's time to first text) against the client's (HTTP, template rendering, tokenizing).
`--out F` appends the report to F; `--prompts DIR` is the eval/ folder (mt-bench.jsonl).

    python bench/bench_prefix_cache.py [--model DIR] [--dtype float32] [--context 2000] [--mode baseline]
        [--rounds 1] [--budget-s S] [--out F] [--prompts DIR]
"""

from __future__ import annotations

import time

T_START = time.perf_counter()  # --budget-s counts from here

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import urllib.request  # noqa: E402
from pathlib import Path  # noqa: E402

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
    """(time to first text, full text, usage, x_mlx_dspark) of one streamed chat completion."""
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
    ttft, text, usage, x = None, "", {}, {}
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
            x = ev.get("x_mlx_dspark") or x
    return (ttft if ttft is not None else time.perf_counter() - t0), text, usage, x


def conversation(tok, n_tokens: int, first: int = 0, prompts: Path = EVAL) -> list[dict]:
    """User turns from eval/ prompts and long assistant turns (the prompts' own text again),
    until the rendered chat is about `n_tokens` long; `first` is the eval row it starts at."""
    rows = [json.loads(x) for x in (Path(prompts) / "mt-bench.jsonl").read_text().splitlines() if x.strip()]
    msgs: list[dict] = []
    i = first
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
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=0.0, help="the whole run's wall-clock budget (0: none)")
    ap.add_argument("--out", default=None, help="append the report (markdown) to this file")
    ap.add_argument("--prompts", default=str(EVAL), help="the eval/ prompts folder (holds mt-bench.jsonl)")
    args = ap.parse_args()
    from mlx_dspark.benchmark import device_stamp

    deadline = T_START + args.budget_s if args.budget_s > 0 else float("inf")
    where, target, tok = load_bench_target(args.model, args.dtype)

    def say(line: str = "") -> None:
        print(line, flush=True)
        if args.out:  # line by line: a run cut short by a time limit keeps what it measured
            with open(args.out, "a") as f:
                f.write(line + "\n")

    say(f"## bench_prefix_cache: {Path(str(where)).name} ({args.dtype or 'default dtype'}); {device_stamp()}")
    say(f"decode path {target.invariance}; mode {args.mode}; {args.max_tokens} new tokens per turn")
    question = {"role": "user", "content": "Summarize our conversation in one sentence."}
    (e_w, s_w), (e_c, s_c) = _server(target, tok, args.mode, True), _server(target, tok, args.mode, False)
    warm, cold, same, took = [], [], True, 0.0
    try:
        # Warm-up of both (JIT, first-use costs), on an unrelated prompt.
        for s, e in ((s_w, e_w), (s_c, e_c)):
            _chat(s.url, e.model_id, [{"role": "user", "content": "hi"}], 4)
        for r in range(max(args.rounds, 1)):
            if r and time.perf_counter() + took > deadline:
                say(f"budget: round {r + 1} not run (the last one took {took:.0f} s)")
                break
            t_round = time.perf_counter()
            msgs = conversation(tok, args.context, first=3 * r, prompts=Path(args.prompts))
            t1, answer, _, _ = _chat(s_w.url, e_w.model_id, msgs, args.max_tokens)  # turn 1: fills the cache
            follow = msgs + [{"role": "assistant", "content": answer}, question]
            w_ttft, w_text, u_w, x_w = _chat(s_w.url, e_w.model_id, follow, args.max_tokens)
            c_ttft, c_text, u_c, x_c = _chat(s_c.url, e_c.model_id, follow, args.max_tokens)
            ok = w_text == c_text and u_w.get("completion_tokens") == u_c.get("completion_tokens")
            same = same and ok
            warm.append(w_ttft)
            cold.append(c_ttft)
            cached = (u_w.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            say(
                f"round {r + 1}: follow-up prompt {u_w.get('prompt_tokens')} tokens, {cached} from the prefix cache; "
                f"turn 1 TTFT {t1 * 1000:.0f} ms; follow-up TTFT cold {c_ttft * 1000:.0f} ms, warm "
                f"{w_ttft * 1000:.0f} ms ({c_ttft / w_ttft:.1f}x); same answer: {'yes' if ok else 'NO'}"
            )
            e_ttft, q_s, p_s = x_w.get("ttft_s") or 0.0, x_w.get("queue_s", 0.0), x_w.get("prefill_s", 0.0)
            say(
                f"  warm TTFT {w_ttft * 1000:.0f} ms = client side (HTTP, chat template, tokenizing) "
                f"{(w_ttft - e_ttft) * 1000:.0f} ms + queue {q_s * 1000:.0f} ms + prefill of the new tokens "
                f"{p_s * 1000:.0f} ms + first step to text {(e_ttft - q_s - p_s) * 1000:.0f} ms; "
                f"cold prefill {x_c.get('prefill_s', 0.0) * 1000:.0f} ms"
            )
            took = time.perf_counter() - t_round
    finally:
        for s, e in ((s_w, e_w), (s_c, e_c)):
            s.shutdown()
            s.server_close()
            e.stop()
    say(
        f"follow-up TTFT, best of {len(warm)}: cold server {min(cold) * 1000:.0f} ms, with the prefix cache "
        f"{min(warm) * 1000:.0f} ms: **{min(cold) / min(warm):.1f}x** (target >= 10x)"
    )
    say(f"same answer on both servers: {'yes' if same else 'NO'}; total {time.perf_counter() - T_START:.0f} s")
    say()
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
