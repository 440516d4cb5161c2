"""Continuous batching (`serve --max-batch N`): up to N requests share every target forward.

The engine thread runs a BatchScheduler instead of the serial loop. Each admitted Job becomes a
row: a TextGeneration (api.start, exactly as the serial path builds it: same proposer, acceptor,
text stream, prefix cache) that is prefilled alone and then stepped together with the other rows
by decode/batch.step_rows, one target forward per step. A row is delivered the moment it
finishes, and its slot admits the next queued (or newly arriving) Job between two steps. Under
--max-draft auto the rows draft only while drafting measures faster than plain batched steps
(decode/batch.DraftGate): in a batch the rows fill the width that drafts would.

What does not batch runs on the serial path, and its response says why (`x_mlx_dspark.batched`
false, `batch_reason`): a target whose batched rows are not proven bitwise equal to solo
forwards (decode/batch.check, measured once: e.g. a quantized KV cache, sliding windows,
recurrent layers), or an engine with a custom generate function. Sampled requests batch: each
row keeps its own random streams. While a serial Job runs, the rows wait (they resume where
they were).

Memory (`--max-kv-mb`): a Job reserves the KV its prompt, its max_tokens and one verify block
may fill (Engine.kv_need_mb); it is admitted when the reservations of the running rows leave room,
and waits in order until then; one that could never fit is refused with what to change.
"""

from __future__ import annotations

import collections
import logging
import queue
import time
import traceback

from ..errors import UserError
from .validate import ApiError, ShuttingDown

log = logging.getLogger("mlx_dspark.serve")


def kv_bytes_per_token(target) -> int:
    """Bytes of KV cache one position takes in `target` (measured on a one-token forward)."""
    got = getattr(target, "_kv_bytes_per_token", None)
    if got is None:
        import mlx.core as mx

        cache = target.make_cache()
        target.forward(mx.array([[0]], dtype=mx.int32), cache, last_only=True)
        got = 0
        for c in cache:
            for a in c.state if isinstance(c.state, (list, tuple)) else [c.state]:
                if a is not None and hasattr(a, "nbytes") and a.ndim >= 3:
                    got += int(a.nbytes) // max(int(a.shape[-2]), 1)
        target._kv_bytes_per_token = got
    return got


class _Row:
    def __init__(self, job, run, held, need_mb: float):
        self.job, self.run, self.held, self.need_mb = job, run, held, need_mb


class BatchScheduler:
    def __init__(self, engine):
        self.engine = engine
        self.rows: list[_Row] = []
        self.waiting: collections.deque = collections.deque()  # Jobs taken from the queue, not admitted yet
        self._target_reason: str | None = None
        self._checked = False
        from ..decode.batch import DraftGate

        self.gate = DraftGate()  # may rows under --max-draft auto draft while they share a forward

    # ---------------------------------------------------------------- why not batched
    def target_reason(self) -> str | None:
        if not self._checked:
            from ..decode import batch

            eng = self.engine
            if eng._generate is not _default_generate():
                self._target_reason = "the engine runs a custom generate function"
            else:
                width = max(int(eng.max_draft) if isinstance(eng.max_draft, int) else 0, 8) + 1
                try:
                    self._target_reason = batch.check(eng.target, eng.max_batch, min(width, 17))
                except Exception as e:  # a family the batched forward does not fit
                    log.warning("batching is off: its self-check failed (%s: %s)", type(e).__name__, e)
                    self._target_reason = f"the batch self-check failed on this target ({type(e).__name__})"
            self._checked = True
            if self._target_reason:
                log.info("continuous batching is off, requests run one at a time: %s", self._target_reason)
            else:
                log.info("continuous batching: up to %d requests share each forward", eng.max_batch)
        return self._target_reason

    def job_reason(self, job) -> str | None:
        """Why this Job runs serially (None: it batches). Every request setting batches (a sampled
        row keeps its own random streams, so a seeded request gives what it gives alone); only the
        target, or a custom generate function, can send a Job to the serial path today."""
        return self.target_reason()

    # ---------------------------------------------------------------- the loop
    def run(self) -> None:
        eng = self.engine
        while not eng._stop.is_set():
            if not self._admit():
                break
            if not self.rows:
                continue
            self._step()
        for row in list(self.rows):  # shutting down
            row.job.cancel("server shutting down")
            row.run.generation.cancel()
            self._deliver(row)

    def _next_job(self, block: bool):
        if self.waiting:
            return self.waiting.popleft()
        if not block and self.engine._queue.empty():
            return False  # the common case between two steps: no exception raised and caught
        try:
            return self.engine._queue.get(timeout=0.5) if block else self.engine._queue.get_nowait()
        except queue.Empty:
            return False

    def _admit(self) -> bool:
        """Fill free slots from the waiting Jobs and the queue. False when the engine is stopping."""
        eng = self.engine
        while len(self.rows) < eng.max_batch:
            job = self._next_job(block=not self.rows)
            if job is None:
                return False  # the stop sentinel
            if job is False:
                return True
            if eng.metrics:
                eng.metrics.gauge_queue(eng._queue.qsize())
            why = self.job_reason(job)
            if why is not None or job.cancelled.is_set():
                job.batch_reason = why
                eng._serve_one(job)  # the serial path (a cancelled Job ends there at once)
                continue
            if eng.max_kv_mb:
                need = eng.kv_need_mb(job)
                used = sum(r.need_mb for r in self.rows)
                if need <= eng.max_kv_mb and used + need > eng.max_kv_mb:
                    self.waiting.appendleft(job)  # waits, in order, for a row to finish
                    return True
            self._start(job)
        return True

    def _start(self, job) -> None:
        from ..api import start

        eng = self.engine
        job.state = "running"
        job.t_start = time.perf_counter()
        job.batched = True
        eng.running.append(job)
        row = None
        try:
            eng.check_kv_budget(job)
            kwargs, held = eng._hooks(job)
            if eng.metrics:
                eng.metrics.gauge_prefill(0, len(job.req.prompt_ids))
            run = start(eng.target, eng.tokenizer, None, **kwargs)
            row = _Row(job, run, held, eng.kv_need_mb(job) if eng.max_kv_mb else 0.0)
            self.rows.append(row)
            run.generation.step()  # the prefill, alone
            if eng.metrics:
                eng.metrics.gauge_prefill(0, 0)
            self._after_step(row)
        except Exception as e:
            if row is not None and row in self.rows:
                self.rows.remove(row)
            self._fail(job, e)

    def _step(self) -> None:
        rows = list(self.rows)
        try:
            if len(rows) == 1:
                self.gate.reset(1)  # a lone row steps exactly as the serial path does (step_rows' lone case)
            _step_rows()([r.run.generation for r in rows], self.gate)
        except Exception as e:  # every row shared the forward: none of them is trusted
            for r in rows:
                self.rows.remove(r)
                self._fail(r.job, e)
            return
        for r in rows:
            self._after_step(r)

    def _after_step(self, row: _Row) -> None:
        g = row.run.generation
        if not g.done and row.run.cancel_check is not None and row.run.cancel_check():
            g.cancel()
        if g.done:
            self.rows.remove(row)
            self._deliver(row)

    # ---------------------------------------------------------------- endings
    def _deliver(self, row: _Row) -> None:
        eng, job = self.engine, row.job
        try:
            job.outcome = eng._outcome(job, row.run.result(), row.held)
            final = ("done", job.outcome)
            if eng._stop.is_set() and job.outcome.result.finish_reason == "cancelled":
                final = ("error", ShuttingDown())
        except Exception as e:
            self._fail(job, e)
            return
        self._end(job, final)

    def _fail(self, job, e: Exception) -> None:
        eng = self.engine
        if eng.prefix_cache is not None:
            eng.prefix_cache.invalidate()  # trust nothing the failed request touched
        if not isinstance(e, (UserError, ApiError)):
            log.error("generation failed:\n%s", "".join(traceback.format_exception(e)))
        self._end(job, ("error", e))

    def _end(self, job, final) -> None:
        eng = self.engine
        job.state = "done"
        job.t_done = time.perf_counter()
        if job in eng.running:
            eng.running.remove(job)
        eng._finish(job)
        job.events.put(final)


def _step_rows():
    from ..decode.batch import step_rows

    return step_rows


def _default_generate():
    from ..api import generate

    return generate
