"""One engine thread owns the model; HTTP threads hand it Jobs through a bounded queue.

A Job carries token ids in and events out: ("text", str) as rounds commit, then ("done",
GenerationResult) or ("error", exception). Cancelling a Job (the client went away) is seen by the
engine at the next commit, so its slot is freed within one round; a Job cancelled while still
queued never starts.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field

from ..decode.sampling import SamplingParams
from ..errors import UserError
from .validate import ApiError, ShuttingDown

log = logging.getLogger("mlx_dspark.serve")
PROGRESS_AFTER_S = 3.0  # a prefill that has run this long logs its progress at every chunk


@dataclass
class GenRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    api: str = "openai"
    raw: bool = False  # a raw completion: keep the output's leading space


@dataclass
class Outcome:
    """What a finished Job produced, with the counts the usage fields report."""

    result: object  # api.GenerationResult
    completion_tokens: int  # tokens up to and including the one that completed a stop string
    stop_sequence: str | None  # the stop string that ended generation, if one did
    logprobs: list | None


class Job:
    _ids = itertools.count(1)

    def __init__(self, req: GenRequest):
        self.id = next(self._ids)
        self.req = req
        self.events: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()
        self.cancel_reason = ""
        self.commits = 0  # commits seen by the engine (one per round)
        self.commits_at_cancel: int | None = None
        self.t_submit = time.perf_counter()
        self.t_start: float | None = None
        self.t_first: float | None = None
        self.t_done: float | None = None
        self.prefilled = 0  # prompt tokens prefilled so far (reported between chunks)
        self.state = "queued"  # queued -> running -> done
        self.outcome: Outcome | None = None
        self.batched = False  # ran as a row of a batch (serve/batch.py), or serially
        self.batch_reason: str | None = None  # why it ran serially

    def cancel(self, reason: str = "client disconnected") -> None:
        if not self.cancelled.is_set():
            self.commits_at_cancel = self.commits
            self.cancel_reason = reason
            self.cancelled.set()

    def next_event(self, timeout: float):
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_submit

    @property
    def queue_s(self) -> float:
        return (self.t_start or time.perf_counter()) - self.t_submit


class QueueFull(ApiError):
    def __init__(self, depth: int):
        super().__init__(
            429,
            f"the server is busy ({depth} requests queued): retry shortly",
            "rate_limit",
            headers={"Retry-After": "1"},
        )


def sampled_decoding_available() -> bool:
    try:
        from ..decode import sampled  # noqa: F401
    except ImportError:
        return False
    return True


class Engine:
    """The model, its tokenizer and the one thread that runs generations."""

    def __init__(
        self,
        target,
        tokenizer,
        *,
        drafter=None,
        mode: str = "auto",
        max_draft: int | None = None,
        drafter_options: dict | None = None,
        lookup_long_draft: int = 32,
        max_queue: int = 16,
        model_id: str | None = None,
        aliases=(),
        context_window: int | None = None,
        default_thinking: bool | None = None,
        default_sampling: SamplingParams | None = None,
        default_max_tokens: int = 4096,
        metrics=None,
        generate_fn=None,
        prefix_cache=None,
        max_batch: int = 1,
        max_kv_mb: float | None = None,
        mid_system: str = "turn",
    ):
        from ..api import generate

        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.mode = mode
        self.max_draft = max_draft
        self.drafter_options = dict(drafter_options or {})
        self.lookup_long_draft = lookup_long_draft
        self.model_id = model_id or default_model_id(target)
        self.aliases = {self.model_id, *aliases, *(a for a in (target.name, getattr(target, "source", "")) if a)}
        if getattr(target, "source", ""):
            self.aliases.add(str(target.source).rstrip("/").rsplit("/", 1)[-1])
        # An explicit window wins, also past the model's trained one (`serve` warns about that):
        # Claude Code's default prompt alone (~20k tokens) exceeds small models' 8k.
        self.trained_context = getattr(target, "max_context", None)
        self.context_window = context_window or self.trained_context or None
        self.default_thinking = default_thinking
        self.mid_system = mid_system  # "turn" | "merge": how later system entries render (chat.render)
        self.default_sampling = default_sampling or SamplingParams()
        self.default_max_tokens = default_max_tokens
        self.metrics = metrics
        self._generate = generate_fn or generate
        self.prefix_cache = prefix_cache  # serve/prefix_cache.py, or None
        self.max_batch = max(int(max_batch), 1)  # rows per target forward (serve/batch.py)
        self.max_kv_mb = max_kv_mb  # the KV budget of the running requests (None: none)
        self.running: list[Job] = []  # the rows of the batch now (max_batch > 1)
        self.scheduler = None  # serve/batch.py's BatchScheduler once started with max_batch > 1
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self.max_queue = max_queue
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.current: Job | None = None
        self.finished: collections.deque = collections.deque(maxlen=256)  # recent Jobs, newest last
        # A mode that cannot run (dspark without a drafter, ...) fails here, at start, not per request.
        from ..decode.modes import make_proposer

        self.resolved_mode = make_proposer(
            mode, drafter=drafter, lookup_long_draft=lookup_long_draft, **self.drafter_options
        ).name

    # ------------------------------------------------------------------ lifecycle
    def prepare(self) -> None:
        """What must happen before request threads run (compat.compile_before_threads)."""
        from ..compat import compile_before_threads
        from .chat import max_token_chars

        compile_before_threads(self.tokenizer)
        max_token_chars(self.tokenizer)  # read once, so that the first huge body is refused as fast

    def start(self) -> "Engine":
        if self._thread is None:
            self.prepare()
            loop = self._loop
            if self.max_batch > 1:
                from .batch import BatchScheduler

                self.scheduler = BatchScheduler(self)
                loop = self.scheduler.run
            self._thread = threading.Thread(target=loop, name="mlx-dspark-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel the running Job and everything queued, then end the engine thread."""
        self._stop.set()
        for job in [self.current, *self.running]:
            if job is not None:
                job.cancel("server shutting down")
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel("server shutting down")
                job.state = "done"
                job.events.put(("error", ShuttingDown()))
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def stop_soon(self) -> None:
        """From a signal handler: cancel what runs now, without waiting (stop() follows)."""
        self._stop.set()
        for job in [self.current, *self.running]:
            if job is not None:
                job.cancel("server shutting down")

    def warmup(self, abort: threading.Event | None = None) -> None:
        """One tiny generation through the engine thread (compiles kernels before the first user)."""
        ids = self.tokenizer.encode("Hello", add_special_tokens=False) or [0]
        job = self.submit(GenRequest(prompt_ids=list(ids), max_tokens=2, api="warmup"))
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not (abort is not None and abort.is_set()):
            ev = job.next_event(1.0)
            if ev is not None and ev[0] in ("done", "error", "cancelled"):
                return

    # ------------------------------------------------------------------ API for handler threads
    def accepts_model(self, name: str) -> bool:
        return name in self.aliases

    def submit(self, req: GenRequest) -> Job:
        if self._stop.is_set() and req.api != "warmup":
            raise ShuttingDown()
        job = Job(req)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull(self._queue.qsize()) from None
        if self.metrics:
            self.metrics.gauge_queue(self._queue.qsize())
        return job

    def batch_steps(self) -> dict | None:
        """Batched steps of --max-draft auto rows so far, with drafts allowed and without
        (decode/batch.DraftGate); None without continuous batching."""
        if self.scheduler is None:
            return None
        steps = self.scheduler.gate.steps
        return {"drafts": steps[True], "plain": steps[False]}

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def busy(self) -> bool:
        return self.current is not None or bool(self.running)

    def describe(self) -> dict:
        return {
            "mode": self.resolved_mode,
            "max_draft": self.max_draft,
            "context_window": self.context_window,
            "trained_context": self.trained_context,
            "rope_scaling": getattr(self.target, "rope_scaling", None),
            "mid_system": self.mid_system,
            "prefix_cache": self.prefix_cache.describe() if self.prefix_cache is not None else None,
            "max_batch": self.max_batch,
            "max_kv_mb": self.max_kv_mb,
            "drafter": getattr(self.drafter, "source", None) if self.drafter is not None else None,
        }

    # ------------------------------------------------------------------ the engine thread
    def _loop(self) -> None:
        while not self._stop.is_set():
            job = self._queue.get()
            if job is None:
                break
            if self.metrics:
                self.metrics.gauge_queue(self._queue.qsize())
            self._serve_one(job)

    def _serve_one(self, job: Job) -> None:
        """Run one Job to its end on the serial path (the engine thread)."""
        if job.batch_reason is None:
            job.batch_reason = "the server runs with --max-batch 1"
        if job.cancelled.is_set():  # gone before it started: never prefilled
            job.state = "done"
            job.t_done = time.perf_counter()
            self._finish(job)
            job.events.put(("cancelled", None))
            return
        self.current = job
        job.state = "running"
        job.t_start = time.perf_counter()
        try:
            self.check_kv_budget(job)
            job.outcome = self._run(job)
            final = ("done", job.outcome)
            if self._stop.is_set() and job.outcome.result.finish_reason == "cancelled":
                final = ("error", ShuttingDown())
        except Exception as e:  # a server fault must not kill the engine thread
            if self.prefix_cache is not None:
                self.prefix_cache.invalidate()  # trust nothing the failed request touched
            if not isinstance(e, (UserError, ApiError)):
                log.error("generation failed:\n%s", traceback.format_exc())
            final = ("error", e)
        job.state = "done"
        job.t_done = time.perf_counter()
        self.current = None
        if self.metrics:
            self.metrics.gauge_prefill(0, 0)
        self._finish(job)
        job.events.put(final)

    def _finish(self, job: Job) -> None:
        self.finished.append(job)
        if self.metrics:
            self.metrics.record_job(job)

    def _prefill_progress(self, job: Job, done: int, total: int) -> None:
        """A long prefill says how far it is: /metrics gauges always, the log after PROGRESS_AFTER_S."""
        job.prefilled = done
        if self.metrics:
            self.metrics.gauge_prefill(done, total)
        took = time.perf_counter() - (job.t_start or time.perf_counter())
        if took >= PROGRESS_AFTER_S and done < total:
            log.info(
                "prefill %d/%d tokens (%d%%), %.0f tok/s, %.0f s",
                done,
                total,
                100 * done // total,
                done / took if took else 0.0,
                took,
            )

    def _hooks(self, job: Job):
        """(generation keyword arguments, the held-back text) of a Job: its text goes to its
        events as it is committed, its cancel check counts commits, its prefill reports progress."""
        req = job.req
        held = [""]  # a trailing U+FFFD: a character that the next token may complete

        def on_text(chunk: str) -> None:
            if job.t_first is None:
                job.t_first = time.perf_counter()
            chunk = held[0] + chunk
            cut = len(chunk.rstrip("\ufffd"))
            chunk, held[0] = chunk[:cut], chunk[cut:]
            if chunk:
                job.events.put(("text", chunk))

        def cancel() -> bool:
            job.commits += 1
            return job.cancelled.is_set()

        def on_prefill(done: int, total: int) -> None:  # after each chunk (past a prefix-cache hit)
            self._prefill_progress(job, done, total)

        kwargs = dict(
            prompt_ids=req.prompt_ids,
            mode=self.mode,
            drafter=self.drafter,
            max_new_tokens=req.max_tokens,
            max_draft=self.max_draft,
            sampling=req.sampling,
            stop=req.stop,
            on_text=on_text,
            cancel=cancel,
            on_prefill=on_prefill,
            lookup_long_draft=self.lookup_long_draft,
            keep_leading_space=req.raw,
            **({"prefix_cache": self.prefix_cache} if self.prefix_cache is not None else {}),
            **self.drafter_options,
        )
        return kwargs, held

    def _run(self, job: Job) -> Outcome:
        kwargs, held = self._hooks(job)
        if self.metrics:
            self.metrics.gauge_prefill(0, len(job.req.prompt_ids))
        res = self._generate(self.target, self.tokenizer, None, **kwargs)
        return self._outcome(job, res, held)

    def _outcome(self, job: Job, res, held: list) -> Outcome:
        """The Outcome of a finished generation (its GenerationResult), the held-back text sent."""
        if res.finish_reason == "length" and res.text.endswith("\ufffd"):
            # max_tokens cut a multi-byte character: its bytes are not text (never a trailing U+FFFD)
            res.text = res.text.rstrip("\ufffd")
        elif held[0]:
            job.events.put(("text", held[0]))
        if res.mode:
            self.resolved_mode = res.mode
        # generate() cuts tokens at the one that completed a stop string, as one-token-at-a-time
        # decoding reports, whatever the mode.
        n = len(res.tokens)
        lp = res.logprobs[:n] if res.logprobs is not None else None
        return Outcome(result=res, completion_tokens=n, stop_sequence=res.stop_string, logprobs=lp)

    def kv_need_mb(self, job: Job) -> float:
        """The KV cache a Job may fill: its prompt, its token budget and one verify block."""
        from .batch import kv_bytes_per_token

        block = max(int(self.max_draft) if isinstance(self.max_draft, int) else 0, self.lookup_long_draft, 16) + 1
        n = len(job.req.prompt_ids) + int(job.req.max_tokens) + block
        n = -(-n // 256) * 256  # mlx-lm's KV cache grows in steps of 256 positions
        return n * kv_bytes_per_token(self.target) / 2**20

    def check_kv_budget(self, job: Job) -> None:
        """Refuse a Job that could never fit the KV budget (--max-kv-mb), saying what to change."""
        if not self.max_kv_mb:
            return
        need = self.kv_need_mb(job)
        if need > self.max_kv_mb:
            raise ApiError(
                400,
                f"this request may need {need:.0f} MB of KV cache ({len(job.req.prompt_ids)} prompt tokens + "
                f"max_tokens {job.req.max_tokens}), more than the server's --max-kv-mb {self.max_kv_mb:g}: "
                "send a smaller max_tokens or a shorter prompt, or raise --max-kv-mb",
            )


def default_model_id(target) -> str:
    """A repo id as given (org/name), else the folder or file name."""
    src = str(getattr(target, "source", "") or "")
    if src and src.count("/") == 1 and not src.startswith((".", "/", "~")):
        return src
    if src:
        name = src.rstrip("/").rsplit("/", 1)[-1]
        return name[:-5] if name.lower().endswith(".gguf") else name
    return target.name or "model"


@dataclass
class Plan:
    """What a dialect wants run, and how to answer it.

    `parser` (chat.OutputParser or None for raw completions) turns text into events; the
    `responder` turns events into the dialect's body or stream frames."""

    req: GenRequest
    stream: bool
    responder: object
    parser: object | None = None


def x_block(engine: Engine, job: Job, ignored=()) -> dict:
    """The `x_mlx_dspark` block every generation response carries."""
    out = job.outcome
    res = out.result if out is not None else None
    blk = {
        "mode": (res.mode if res is not None and res.mode else engine.resolved_mode or engine.mode),
        "mean_accept_len": round(res.mean_accept_len, 4) if res is not None else 0.0,
        "tokens_per_sec": round(res.decode_tps, 3) if res is not None else 0.0,
        "e2e_tokens_per_sec": round(res.e2e_tps, 3) if res is not None else 0.0,
        "rounds": len(res.accept_lengths) if res is not None else 0,
        "prefill_s": round(res.prefill_s, 6) if res is not None else 0.0,
        "decode_s": round(res.decode_s, 6) if res is not None else 0.0,
        "queue_s": round(job.queue_s, 6),
        "ttft_s": round(job.ttft_s, 6) if job.ttft_s is not None else None,
        "batched": job.batched,
    }
    if not job.batched and job.batch_reason:
        blk["batch_reason"] = job.batch_reason
    if ignored:
        blk["ignored_params"] = sorted(ignored)
    if res is not None and getattr(res, "prefix_cache", None):
        blk["prefix_cache"] = res.prefix_cache  # mode, hit, reused_tokens, and a miss's cause
    return blk


def resolve_max_tokens(engine: Engine, prompt_len: int, asked: int | None, refuse) -> int:
    """The token budget, or `refuse(prompt_len, asked, window)` (a dialect's ApiError) when the
    prompt plus the budget does not fit the context window. Nothing is prefilled before this."""
    window = engine.context_window
    if asked is None:
        asked_eff = engine.default_max_tokens
        if window:
            if prompt_len >= window:
                raise refuse(prompt_len, None, window)
            asked_eff = min(asked_eff, window - prompt_len)
        return max(asked_eff, 1)
    if window and prompt_len + asked > window:
        raise refuse(prompt_len, asked, window)
    return asked


def check_sampling(sp: SamplingParams) -> SamplingParams:
    try:
        sp.validate()
    except UserError as e:
        raise ApiError(400, str(e)) from None
    needs_sampler = not sp.greedy or sp.presence_penalty or sp.frequency_penalty
    if needs_sampler and not sampled_decoding_available():
        raise ApiError(
            400,
            "temperature > 0 and presence/frequency penalties need the sampling decoder, which "
            "this build lacks: send temperature 0 without penalties",
        )
    return sp


def build_sampling(
    f, engine: Engine, *, temp_hi: float = 2.0, penalties: bool = True, logprobs: bool = False, top_logprobs: int = 0
) -> SamplingParams:
    """SamplingParams from a request's fields (validators.Fields), over the server's defaults."""
    d = engine.default_sampling
    top_k = f.int("top_k", None, lo=-1, hi=1 << 30)
    seed = f.int("seed", None, lo=-1, hi=(1 << 63) - 1)
    sp = SamplingParams(
        temperature=f.num("temperature", d.temperature, lo=0.0, hi=temp_hi),
        top_p=f.num("top_p", d.top_p, lo=0.0, hi=1.0, lo_open=True),
        top_k=d.top_k if top_k is None else max(top_k, 0),  # -1 = off, as in vLLM
        min_p=f.num("min_p", d.min_p, lo=0.0, hi=1.0),
        presence_penalty=f.num("presence_penalty", d.presence_penalty, lo=-2.0, hi=2.0)
        if penalties
        else d.presence_penalty,
        frequency_penalty=f.num("frequency_penalty", d.frequency_penalty, lo=-2.0, hi=2.0)
        if penalties
        else d.frequency_penalty,
        seed=d.seed if seed is None or seed == -1 else seed,  # -1 = unseeded, as in llama.cpp
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    return check_sampling(sp)
