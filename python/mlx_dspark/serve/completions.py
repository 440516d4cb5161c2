"""The OpenAI legacy completions route, /v1/completions: a raw prompt (text or token ids) in,
text out, in the OpenAI dialect's envelope (serve/openai.py). Parameters: see README-params.md."""

from __future__ import annotations

from . import chat
from .engine import Engine, GenRequest, Job, Plan, build_sampling, resolve_max_tokens, x_block
from .openai import ChatResponder, _model, _nonempty, _not_one
from .sse import new_id, now, sse
from .validate import ApiError, Fields, check_fields, invalid

COMPLETION_FIELDS = {
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "stream",
    "stream_options",
}
COMPLETION_REFUSED = {
    "n": _not_one("n"),
    "best_of": _not_one("best_of"),
    "echo": _nonempty("echo is not supported"),
    "suffix": _nonempty("suffix (insertion) is not supported"),
    "logit_bias": _nonempty("logit_bias is not supported"),
}


def _refuse_completion(prompt: int, asked: int | None, window: int) -> ApiError:
    """The legacy completions endpoint's own wording (it names the prompt, not messages)."""
    asked = asked or 0
    msg = (
        f"This model's maximum context length is {window} tokens, however you requested {prompt + asked} "
        f"tokens ({prompt} in your prompt; {asked} for the completion). Please reduce your prompt; or "
        "completion length."
    )
    return ApiError(400, msg, param="prompt", code="context_length_exceeded")


def plan_completion(engine: Engine, body: dict) -> Plan:
    ignored = check_fields(body, COMPLETION_FIELDS, COMPLETION_REFUSED)
    f = Fields(body)
    model = _model(engine, f)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("`prompt` must not be empty", param="prompt")
        chat.refuse_if_surely_over(
            engine.tokenizer, [{"role": "user", "content": prompt}], engine.context_window, _refuse_completion
        )
        ids, n = chat.encode_within(engine.tokenizer, prompt, engine.context_window, special=True)
        if ids is None:
            raise _refuse_completion(n, None, engine.context_window)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = engine.target.vocab_size or (1 << 31)
        if not all(0 <= t < vocab for t in prompt):
            raise invalid(f"token ids in `prompt` must be in [0, {vocab})", param="prompt")
        ids = list(prompt)
    elif prompt is None:
        raise invalid("`prompt` is required", param="prompt")
    else:
        raise invalid(
            "`prompt` must be a string or an array of token ids (batches of several prompts are not "
            "supported: send one request per prompt)",
            param="prompt",
        )
    if not ids:
        raise invalid("`prompt` encodes to no tokens", param="prompt")
    n_lp = f.int("logprobs", None, lo=0, hi=20)
    sampling = build_sampling(f, engine, logprobs=n_lp is not None, top_logprobs=n_lp or 0)
    stop = f.str_list("stop", allow_str=True)
    stream = f.bool("stream", False)
    usage_chunk = Fields(f.dict("stream_options", {}), "stream_options.").bool("include_usage", False)
    budget = resolve_max_tokens(engine, len(ids), f.int("max_tokens", 16, lo=1, hi=1 << 31), _refuse_completion)
    resp = CompletionResponder(engine, model, ignored, usage_chunk=usage_chunk)
    return Plan(GenRequest(ids, budget, sampling, stop, api="openai", raw=True), stream, resp, None)


class CompletionResponder:
    def __init__(self, engine: Engine, model: str, ignored, *, usage_chunk: bool):
        self.engine, self.model, self.ignored, self.usage_chunk = engine, model, ignored, usage_chunk
        self.id, self.created = new_id("cmpl-"), now()

    def _usage(self, job: Job) -> dict:
        p, n = job.outcome.result.prompt_tokens, job.outcome.completion_tokens
        return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}

    def _logprobs(self, job: Job) -> dict | None:
        entries = job.outcome.logprobs
        if entries is None:
            return None
        tok = self.engine.tokenizer
        tokens, offsets, pos = [], [], 0
        for e in entries:
            s = chat.decode_token(tok, e["token"])
            tokens.append(s)
            offsets.append(pos)
            pos += len(s)
        return {
            "tokens": tokens,
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{chat.decode_token(tok, t): lp for t, lp in e.get("top", [])} for e in entries],
            "text_offset": offsets,
        }

    def _finish_reason(self, job: Job) -> str:
        return "length" if job.outcome.result.finish_reason == "length" else "stop"

    def body(self, job: Job, events) -> dict:
        text = "".join(p for _, p in events)
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {"text": text, "index": 0, "logprobs": self._logprobs(job), "finish_reason": self._finish_reason(job)}
            ],
            "usage": self._usage(job),
            "system_fingerprint": None,
            "x_mlx_dspark": x_block(self.engine, job, self.ignored),
        }

    def _chunk(self, text: str, finish=None, logprobs=None, **extra) -> bytes:
        return sse(
            {
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}],
                **extra,
            }
        )

    def stream_start(self) -> list[bytes]:
        return []

    def stream_events(self, events) -> list[bytes]:
        return [self._chunk(p) for _, p in events if p]

    def stream_finish(self, job: Job) -> list[bytes]:
        out = [
            self._chunk(
                "", self._finish_reason(job), self._logprobs(job), x_mlx_dspark=x_block(self.engine, job, self.ignored)
            )
        ]
        if self.usage_chunk:
            out.append(
                sse(
                    {
                        "id": self.id,
                        "object": "text_completion",
                        "created": self.created,
                        "model": self.model,
                        "choices": [],
                        "usage": self._usage(job),
                    }
                )
            )
        out.append(sse("[DONE]"))
        return out

    stream_error = ChatResponder.stream_error
    ping = ChatResponder.ping
