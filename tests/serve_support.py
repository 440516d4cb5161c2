"""Helpers for the server tests: a live server on a fixture model, and a way to force its output.

`Script` wraps the target's forward: the real model still runs (its cache, its cost), but the
logits are replaced by a one-hot on the scripted token for each position after the prompt, so a
test decides what the model "says" (a tool call, a <think> block) while every step after the
forward is the product's own: the verify loop, the text stream, stop strings, the output parser,
the dialects and the HTTP transport.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from fixtures import write_model


class Script:
    def __init__(self, target, tokenizer):
        self.target = target
        self.tokenizer = tokenizer
        self.eos = int(target.config["eos_token_id"])
        self.tokens: list[int] | None = None  # None: the real model decides
        self.prompt_len = 0
        self.delay = 0.0  # seconds added to every forward (to make rounds measurable)
        self.forwards = 0
        self.last_prompt: list[int] = []
        self._orig = target.forward
        target.forward = self.forward

    def say(self, text: str | None, *, eos: bool = True, delay: float = 0.0) -> None:
        """From the next request on, the model writes `text` (then EOS unless eos=False: then it
        repeats the text forever)."""
        self.delay = delay
        if text is None:
            self.tokens = None
            return
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        self.tokens = ids if eos else ids * 2000
        self._eos = eos

    def forward(self, tokens, cache, taps=(), last_only=False):
        offset = self.target.cache_len(cache)
        if last_only:  # prefill chunks: remember the prompt
            self.last_prompt = ([] if offset == 0 else self.last_prompt) + tokens.reshape(-1).tolist()
        out = self._orig(tokens, cache, taps=taps, last_only=last_only)
        self.forwards += 1
        if self.delay:
            time.sleep(self.delay)
        if self.tokens is None:
            return out
        w = tokens.shape[-1]
        if last_only:
            self.prompt_len = offset + w  # the last prefill chunk ends the prompt
            positions = [offset + w - 1]
        else:
            positions = list(range(offset, offset + w))
        V = out.logits.shape[-1]
        bias = np.zeros((1, len(positions), V), dtype=np.float32)
        for r, p in enumerate(positions):
            j = p + 1 - self.prompt_len
            tok = self.tokens[j] if 0 <= j < len(self.tokens) else self.eos
            bias[0, r, tok] = 60.0
        # Depend on the real logits so the real forward is evaluated (its cost and its cache).
        logits = out.logits.astype(mx.float32) * 0.0 + mx.array(bias)
        return type(out)(logits, out.hidden)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """An in-process server on a fixture model, on 127.0.0.1 and a free port."""

    def __init__(
        self,
        model_dir: Path,
        *,
        api_key: str | None = None,
        max_body: int = 1 << 20,
        mode: str = "lookup",
        context_window: int | None = None,
        keepalive_s: float = 15.0,
        default_thinking=None,
        max_queue: int = 16,
    ):
        from mlx_dspark.models.loading import load_target
        from mlx_dspark.serve.engine import Engine
        from mlx_dspark.serve.server import make_server

        self.target, self.tokenizer = load_target(str(model_dir))
        self.script = Script(self.target, self.tokenizer)
        self.engine = Engine(
            self.target,
            self.tokenizer,
            mode=mode,
            context_window=context_window,
            default_thinking=default_thinking,
            default_max_tokens=64,
            max_queue=max_queue,
        )
        self.server = make_server(
            self.engine, "127.0.0.1", 0, api_key=api_key, max_body=max_body, idle_timeout=10.0, keepalive_s=keepalive_s
        )
        self.engine.start()
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        self.url = self.server.url
        self.port = self.server.port
        self.model = self.engine.model_id

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.engine.stop()


def make_model(tmp: Path) -> Path:
    return write_model(tmp / "tiny-qwen3", "qwen3")


def module_timer(label: str):
    """An autouse module fixture that prints how long the module's tests took, even under -q
    (CI's log shows what the server suites cost)."""
    import pytest

    @pytest.fixture(scope="module", autouse=True)
    def _timer(request):
        t0 = time.perf_counter()
        yield
        rep = request.config.pluginmanager.get_plugin("terminalreporter")
        cap = request.config.pluginmanager.get_plugin("capturemanager")
        if rep is not None and cap is not None:
            with cap.global_and_fixture_disabled():
                rep.write_line(f"\n[{label}: {time.perf_counter() - t0:.1f} s]")

    return _timer
