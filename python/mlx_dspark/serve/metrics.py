"""Prometheus text exposition (format 0.0.4) for GET /metrics: requests, tokens, accept lengths, tok/s."""

from __future__ import annotations

import threading
from collections import defaultdict

ACCEPT_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def _labels(d: dict) -> str:
    if not d:
        return ""
    esc = lambda v: str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')  # noqa: E731
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in sorted(d.items())) + "}"


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float, n: int = 1) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += n
        self.sum += v * n
        self.count += n

    def lines(self, name: str, labels: dict | None = None) -> list[str]:
        labels = labels or {}
        pairs = zip(self.buckets, self.counts, strict=True)
        out = [f"{name}_bucket{_labels({**labels, 'le': f'{b:g}'})} {c}" for b, c in pairs]
        out.append(f"{name}_bucket{_labels({**labels, 'le': '+Inf'})} {self.count}")
        out.append(f"{name}_sum{_labels(labels)} {self.sum:g}")
        out.append(f"{name}_count{_labels(labels)} {self.count}")
        return out


class Metrics:
    def __init__(self, model: str = "", mode: str = "", version: str = ""):
        self.lock = threading.Lock()
        self.info = {"model": model, "mode": mode, "version": version}
        self.http = defaultdict(int)  # (route, status) -> count
        self.jobs = defaultdict(int)  # (api, outcome) -> count
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.rounds = 0
        self.prefill_s = 0.0
        self.decode_s = 0.0
        self.last_tps = 0.0
        self.queue_depth = 0
        self.prefill_done = self.prefill_total = 0  # the running prefill, 0/0 when none
        self.accept = Histogram(ACCEPT_BUCKETS)
        self.ttft = Histogram(TTFT_BUCKETS)

    def record_http(self, route: str, status: int) -> None:
        with self.lock:
            self.http[(route, int(status))] += 1

    def gauge_queue(self, depth: int) -> None:
        self.queue_depth = depth

    def gauge_prefill(self, done: int, total: int) -> None:
        self.prefill_done, self.prefill_total = done, total

    def record_job(self, job) -> None:
        api = job.req.api
        if api == "warmup":
            return
        with self.lock:
            out = job.outcome
            if out is None:
                self.jobs[(api, "cancelled" if job.cancelled.is_set() else "error")] += 1
                return
            res = out.result
            self.jobs[(api, res.finish_reason)] += 1
            self.prompt_tokens += res.prompt_tokens
            self.completion_tokens += out.completion_tokens
            self.rounds += len(res.accept_lengths)
            for n in res.accept_lengths:
                self.accept.observe(n)
            self.prefill_s += res.prefill_s
            self.decode_s += res.decode_s
            if res.decode_tps:
                self.last_tps = res.decode_tps
            if job.ttft_s is not None:
                self.ttft.observe(job.ttft_s)

    def render(
        self, *, busy: bool, queue_depth: int, prefix_cache: dict | None = None, batch: dict | None = None
    ) -> str:
        L: list[str] = []

        def head(name, kind, text):
            L.append(f"# HELP {name} {text}")
            L.append(f"# TYPE {name} {kind}")

        with self.lock:
            head("mlx_dspark_info", "gauge", "The loaded model and mode.")
            L.append(f"mlx_dspark_info{_labels(self.info)} 1")
            head("mlx_dspark_http_requests_total", "counter", "HTTP requests answered, by route and status.")
            for (route, status), n in sorted(self.http.items()):
                L.append(f"mlx_dspark_http_requests_total{_labels({'route': route, 'status': status})} {n}")
            head("mlx_dspark_generations_total", "counter", "Generations, by API and finish reason.")
            for (api, fin), n in sorted(self.jobs.items()):
                L.append(f"mlx_dspark_generations_total{_labels({'api': api, 'finish_reason': fin})} {n}")
            head("mlx_dspark_prompt_tokens_total", "counter", "Prompt tokens prefilled.")
            L.append(f"mlx_dspark_prompt_tokens_total {self.prompt_tokens}")
            head("mlx_dspark_completion_tokens_total", "counter", "Completion tokens returned.")
            L.append(f"mlx_dspark_completion_tokens_total {self.completion_tokens}")
            head("mlx_dspark_rounds_total", "counter", "Decode forwards (verify rounds and plain steps).")
            L.append(f"mlx_dspark_rounds_total {self.rounds}")
            head("mlx_dspark_accept_length", "histogram", "Tokens committed per decode forward.")
            L.extend(self.accept.lines("mlx_dspark_accept_length"))
            head("mlx_dspark_time_to_first_token_seconds", "histogram", "From request queued to first text.")
            L.extend(self.ttft.lines("mlx_dspark_time_to_first_token_seconds"))
            head("mlx_dspark_prefill_seconds_total", "counter", "Time spent in prefill.")
            L.append(f"mlx_dspark_prefill_seconds_total {self.prefill_s:g}")
            head("mlx_dspark_decode_seconds_total", "counter", "Time spent decoding.")
            L.append(f"mlx_dspark_decode_seconds_total {self.decode_s:g}")
            head("mlx_dspark_decode_tokens_per_second", "gauge", "Decode speed of the last finished generation.")
            L.append(f"mlx_dspark_decode_tokens_per_second {self.last_tps:g}")
        head("mlx_dspark_queue_depth", "gauge", "Requests waiting for the engine.")
        L.append(f"mlx_dspark_queue_depth {queue_depth}")
        head("mlx_dspark_prefill_tokens_done", "gauge", "Prompt tokens prefilled so far in the running prefill.")
        L.append(f"mlx_dspark_prefill_tokens_done {self.prefill_done}")
        head("mlx_dspark_prefill_tokens_total", "gauge", "Prompt tokens of the running prefill (0 when none).")
        L.append(f"mlx_dspark_prefill_tokens_total {self.prefill_total}")
        head("mlx_dspark_busy", "gauge", "1 while the engine is generating.")
        L.append(f"mlx_dspark_busy {int(busy)}")
        if batch is not None:
            head(
                "mlx_dspark_batched_steps_total",
                "counter",
                "Steps several --max-draft auto requests shared, by whether the draft gate let their rows "
                "draft (only while drafting measures faster than plain batched steps).",
            )
            L.append(f'mlx_dspark_batched_steps_total{{drafts="allowed"}} {batch.get("drafts", 0)}')
            L.append(f'mlx_dspark_batched_steps_total{{drafts="off"}} {batch.get("plain", 0)}')
        if prefix_cache is not None:
            for key, text in (
                ("hits", "Prompts that reused a cached prefix."),
                ("misses", "Prompts that found no cached prefix."),
                ("reused_tokens", "Prompt tokens taken from the prefix cache instead of prefilled."),
            ):
                head(f"mlx_dspark_prefix_cache_{key}_total", "counter", text)
                L.append(f"mlx_dspark_prefix_cache_{key}_total {prefix_cache.get(key, 0)}")
            head("mlx_dspark_prefix_cache_entries", "gauge", "Conversations kept, by tier.")
            L.append(f'mlx_dspark_prefix_cache_entries{{tier="ram"}} {prefix_cache.get("in_ram", 0)}')
            L.append(f'mlx_dspark_prefix_cache_entries{{tier="disk"}} {prefix_cache.get("on_disk", 0)}')
        return "\n".join(L) + "\n"
