"""The OpenAI dialect: /v1/chat/completions and /v1/models (/v1/completions: serve/completions.py).

Request checks, response bodies and stream chunks follow the real API: chat chunks start with a
role delta, end with a finish_reason chunk (then a usage chunk when stream_options.include_usage)
and `data: [DONE]`. Reasoning goes to `reasoning_content`, tool calls to `tool_calls`.
Parameters: see README-params.md.
"""

from __future__ import annotations

import json

from . import chat
from .engine import Engine, GenRequest, Job, Plan, build_sampling, resolve_max_tokens, x_block
from .sse import new_id, now, sse
from .validate import ApiError, Fields, check_fields, invalid, type_name

_TYPES = {
    "invalid_request": ("invalid_request_error", None),
    "authentication": ("invalid_request_error", "invalid_api_key"),
    "permission": ("invalid_request_error", "forbidden"),
    "not_found": ("invalid_request_error", "not_found"),
    "too_large": ("invalid_request_error", "request_too_large"),
    "unsupported_media": ("invalid_request_error", "unsupported_media_type"),
    "rate_limit": ("rate_limit_error", "rate_limit_exceeded"),
    "overloaded": ("server_error", "overloaded"),
    "server_error": ("server_error", None),
}


def error_body(err: ApiError) -> dict:
    typ, code = _TYPES.get(err.kind, ("invalid_request_error", None))
    return {"error": {"message": err.message, "type": typ, "param": err.param, "code": err.code or code}}


def _refuse(prompt: int, asked: int | None, window: int) -> ApiError:
    if asked is None:
        msg = (
            f"This model's maximum context length is {window} tokens. However, your messages resulted in "
            f"{prompt} tokens. Please reduce the length of the messages."
        )
    else:
        msg = (
            f"This model's maximum context length is {window} tokens. However, you requested "
            f"{prompt + asked} tokens ({prompt} in the messages, {asked} in the completion). "
            "Please reduce the length of the messages or completion."
        )
    return ApiError(400, msg, param="messages", code="context_length_exceeded")


def _model(engine: Engine, f: Fields) -> str:
    name = f.str("model", required=True)
    if not engine.accepts_model(name):
        raise ApiError(
            404,
            f"The model `{name}` does not exist. This server serves `{engine.model_id}` (see GET /v1/models).",
            "not_found",
            param="model",
            code="model_not_found",
        )
    return name


def _max_tokens(f: Fields) -> int | None:
    a = f.int("max_completion_tokens", None, lo=1, hi=1 << 31)
    b = f.int("max_tokens", None, lo=1, hi=1 << 31)
    return a if a is not None else b


def _not_one(name):
    return lambda v: None if v == 1 else f"only 1 is supported (send separate requests), got {v!r}"


def _nonempty(why):
    return lambda v: why if v else None


def _response_format(v):
    if isinstance(v, dict) and v.get("type") in (None, "text"):
        return None
    return 'only {"type": "text"} is supported (no JSON mode or schema-constrained decoding)'


CHAT_FIELDS = {
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "stream",
    "stream_options",
    "enable_thinking",
    "chat_template_kwargs",
}
CHAT_REFUSED = {
    "n": _not_one("n"),
    "response_format": _response_format,
    "logit_bias": _nonempty("logit_bias is not supported"),
    "functions": _nonempty("the legacy `functions` field is not supported: use `tools`"),
    "function_call": _nonempty("the legacy `function_call` field is not supported: use `tool_choice`"),
    "audio": _nonempty("audio output is not supported"),
    "modalities": lambda v: None if v in (["text"], []) else "only the text modality is supported",
    "prediction": _nonempty("predicted outputs are not supported"),
    "web_search_options": _nonempty("web search is not supported"),
}


# ----------------------------------------------------------------------------- messages and tools
def _text(v, where: str) -> str:
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise invalid(f"`{where}` must be a string or an array of content parts, got {type_name(v)}", param=where)
    parts = []
    for i, p in enumerate(v):
        if not isinstance(p, dict):
            raise invalid(f"`{where}[{i}]` must be an object, got {type_name(p)}", param=where)
        kind = p.get("type")
        if kind in ("text", "input_text"):
            if not isinstance(p.get("text"), str):
                raise invalid(f"`{where}[{i}].text` must be a string", param=where)
            parts.append(p["text"])
        elif kind == "refusal":
            continue
        elif kind in ("image_url", "input_audio", "file", "image", "input_image"):
            raise invalid(f"`{where}[{i}]` is {kind!r} content, but this server runs a text-only model", param=where)
        else:
            raise invalid(f"`{where}[{i}].type` must be 'text', got {kind!r}", param=where)
    return "\n".join(parts)


def _tool_calls(v, where: str) -> list[dict]:
    if not isinstance(v, list):
        raise invalid(f"`{where}` must be an array, got {type_name(v)}", param=where)
    out = []
    for i, tc in enumerate(v):
        w = f"{where}[{i}]"
        if not isinstance(tc, dict):
            raise invalid(f"`{w}` must be an object, got {type_name(tc)}", param=w)
        f = Fields(tc, w + ".")
        fn = Fields(f.dict("function", required=True), w + ".function.")
        name = fn.str("name", required=True, nonempty=True)
        args = fn.raw("arguments", "{}")
        if isinstance(args, str):
            try:
                parsed = json.loads(args) if args.strip() else {}
                args = parsed if isinstance(parsed, dict) else args
            except ValueError:
                pass  # the template renders the string as given
        elif not isinstance(args, dict):
            raise invalid(f"`{w}.function.arguments` must be a JSON string, got {type_name(args)}", param=w)
        out.append(
            {
                "id": f.str("id", "") or new_id("call_"),
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
        )
    return out


def normalize_messages(v) -> list[dict]:
    """OpenAI chat messages -> the neutral form the chat template gets."""
    if not isinstance(v, list):
        raise invalid(f"`messages` must be an array, got {type_name(v)}", param="messages")
    if not v:
        raise invalid("`messages` must not be empty", param="messages")
    out, names = [], {}
    for i, m in enumerate(v):
        w = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(f"`{w}` must be an object, got {type_name(m)}", param=w)
        f = Fields(m, w + ".")
        role = f.choice("role", ("system", "developer", "user", "assistant", "tool"))
        if role is None:
            raise invalid(f"`{w}.role` is required", param=w)
        content = _text(m.get("content"), w + ".content")
        if role in ("system", "developer"):
            out.append({"role": "system", "content": content})
        elif role == "user":
            out.append({"role": "user", "content": content})
        elif role == "assistant":
            msg = {"role": "assistant", "content": content}
            if m.get("tool_calls"):
                msg["tool_calls"] = _tool_calls(m["tool_calls"], w + ".tool_calls")
                names.update({tc["id"]: tc["function"]["name"] for tc in msg["tool_calls"]})
            rc = f.str("reasoning_content")
            if rc:
                msg["reasoning_content"] = rc
            out.append(msg)
        else:
            call_id = f.str("tool_call_id", required=True)
            msg = {"role": "tool", "tool_call_id": call_id, "content": content}
            if call_id in names:
                msg["name"] = names[call_id]
            out.append(msg)
    return out


def normalize_tools(v) -> list[dict]:
    if not isinstance(v, list):
        raise invalid(f"`tools` must be an array, got {type_name(v)}", param="tools")
    if len(v) > 512:
        raise invalid("`tools` has more than 512 entries", param="tools")
    out = []
    for i, t in enumerate(v):
        w = f"tools[{i}]"
        if not isinstance(t, dict):
            raise invalid(f"`{w}` must be an object, got {type_name(t)}", param=w)
        if t.get("type", "function") != "function":
            raise invalid(f"`{w}.type` must be 'function', got {t.get('type')!r}", param=w)
        fn = Fields(Fields(t, w + ".").dict("function", required=True), w + ".function.")
        spec = {"name": fn.str("name", required=True, nonempty=True, max_len=256)}
        if fn.has("description"):
            spec["description"] = fn.str("description")
        spec["parameters"] = fn.dict("parameters", {"type": "object", "properties": {}})
        out.append({"type": "function", "function": spec})
    return out


def _tool_choice(v) -> str:
    """'none' | 'auto' | 'required' (required and a named function are accepted, not enforced)."""
    if v is None or v in ("auto", "required", "none"):
        return v or "auto"
    if isinstance(v, dict) and v.get("type") == "function" and isinstance((v.get("function") or {}).get("name"), str):
        return "required"
    raise invalid(
        '`tool_choice` must be \'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


def _logprob_entry(tokenizer, token: int, lp: float) -> dict:
    s = chat.decode_token(tokenizer, token)
    return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8", "replace"))}


def chat_logprobs(tokenizer, entries) -> dict | None:
    if entries is None:
        return None
    content = []
    for e in entries:
        item = _logprob_entry(tokenizer, e["token"], e["logprob"])
        item["top_logprobs"] = [_logprob_entry(tokenizer, t, lp) for t, lp in e.get("top", [])]
        content.append(item)
    return {"content": content}


def reasoning_tokens(engine: Engine, job: Job, has_reasoning: bool) -> int:
    if not has_reasoning:
        return 0
    n = job.outcome.completion_tokens
    end = chat.think_end_token(engine.tokenizer)
    toks = job.outcome.result.tokens[:n]
    return toks.index(end) + 1 if end is not None and end in toks else n


# ----------------------------------------------------------------------------- /v1/chat/completions
def plan_chat(engine: Engine, body: dict) -> Plan:
    ignored = check_fields(body, CHAT_FIELDS, CHAT_REFUSED)
    f = Fields(body)
    model = _model(engine, f)
    messages = normalize_messages(body.get("messages"))
    tools = normalize_tools(body["tools"]) if body.get("tools") else None
    choice = _tool_choice(body.get("tool_choice"))
    if choice != "auto" and tools and choice == "required":
        ignored.append("tool_choice (not enforced)")
    if choice == "none":
        tools = None
    parallel = f.bool("parallel_tool_calls", True)
    kwargs = dict(f.dict("chat_template_kwargs", {}))
    thinking = f.bool("enable_thinking", kwargs.pop("enable_thinking", None))
    if thinking is not None and not isinstance(thinking, bool):
        raise invalid("`chat_template_kwargs.enable_thinking` must be a boolean", param="chat_template_kwargs")
    if thinking is None:
        thinking = engine.default_thinking
    want_lp = f.bool("logprobs", False)
    top_lp = f.int("top_logprobs", 0, lo=0, hi=20)
    if top_lp and not want_lp:
        raise invalid("`top_logprobs` needs `logprobs: true`", param="top_logprobs")
    sampling = build_sampling(f, engine, logprobs=want_lp, top_logprobs=top_lp)
    stop = f.str_list("stop", allow_str=True)
    stream = f.bool("stream", False)
    opts = Fields(f.dict("stream_options", {}), "stream_options.")
    usage_chunk = opts.bool("include_usage", False)
    max_tokens = _max_tokens(f)

    text = chat.render(
        engine.tokenizer,
        messages,
        tools=tools,
        enable_thinking=thinking,
        template_kwargs=kwargs,
        window=engine.context_window,
        refuse=_refuse,
        mid_system=engine.mid_system,
    )
    ids, n = chat.encode_within(engine.tokenizer, text, engine.context_window)
    budget = resolve_max_tokens(engine, n, max_tokens, _refuse)
    parser = chat.OutputParser(
        in_reasoning=chat.starts_in_reasoning(text), tools=tools, syntaxes=chat.tool_syntaxes(engine.tokenizer)
    )
    resp = ChatResponder(engine, model, ignored, parallel=parallel, usage_chunk=usage_chunk)
    return Plan(GenRequest(ids, budget, sampling, stop, api="openai"), stream, resp, parser)


class ChatResponder:
    def __init__(self, engine: Engine, model: str, ignored, *, parallel: bool, usage_chunk: bool):
        self.engine, self.model, self.ignored = engine, model, ignored
        self.parallel, self.usage_chunk = parallel, usage_chunk
        self.id, self.created = new_id("chatcmpl-"), now()
        self.n_calls = 0
        self.saw_reasoning = False

    def _usage(self, job: Job) -> dict:
        out = job.outcome
        p, n = out.result.prompt_tokens, out.completion_tokens
        return {
            "prompt_tokens": p,
            "completion_tokens": n,
            "total_tokens": p + n,
            "prompt_tokens_details": {"cached_tokens": getattr(out.result, "cached_tokens", 0)},
            "completion_tokens_details": {"reasoning_tokens": reasoning_tokens(self.engine, job, self.saw_reasoning)},
        }

    def _finish_reason(self, job: Job) -> str:
        if self.n_calls:
            return "tool_calls"
        return "length" if job.outcome.result.finish_reason == "length" else "stop"

    def _keep_call(self) -> bool:
        return self.parallel or self.n_calls == 0

    def body(self, job: Job, events) -> dict:
        reasoning, text, calls = chat.collect(events)
        self.saw_reasoning = bool(reasoning)
        msg = {"role": "assistant", "content": text if text or not calls else None}
        if reasoning:
            msg["reasoning_content"] = reasoning
        kept = []
        for c in calls:
            if self._keep_call():
                kept.append(
                    {
                        "id": new_id("call_"),
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments_json()},
                    }
                )
                self.n_calls += 1
        if kept:
            msg["tool_calls"] = kept
        choice = {
            "index": 0,
            "message": msg,
            "logprobs": chat_logprobs(self.engine.tokenizer, job.outcome.logprobs),
            "finish_reason": self._finish_reason(job),
        }
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self._usage(job),
            "system_fingerprint": None,
            "x_mlx_dspark": x_block(self.engine, job, self.ignored),
        }

    def _chunk(self, delta: dict, finish=None, logprobs=None, **extra) -> bytes:
        obj = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
            **extra,
        }
        if self.usage_chunk:
            obj["usage"] = None
        return sse(obj)

    def stream_start(self) -> list[bytes]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def stream_events(self, events) -> list[bytes]:
        out = []
        for kind, payload in events:
            if kind == "text":
                out.append(self._chunk({"content": payload}))
            elif kind == "reasoning":
                self.saw_reasoning = True
                out.append(self._chunk({"reasoning_content": payload}))
            elif kind == "tool_call" and self._keep_call():
                call = {
                    "index": self.n_calls,
                    "id": new_id("call_"),
                    "type": "function",
                    "function": {"name": payload.name, "arguments": payload.arguments_json()},
                }
                out.append(self._chunk({"tool_calls": [call]}))
                self.n_calls += 1
        return out

    def stream_finish(self, job: Job) -> list[bytes]:
        lp = chat_logprobs(self.engine.tokenizer, job.outcome.logprobs)
        out = [self._chunk({}, self._finish_reason(job), lp, x_mlx_dspark=x_block(self.engine, job, self.ignored))]
        if self.usage_chunk:
            out.append(
                sse(
                    {
                        "id": self.id,
                        "object": "chat.completion.chunk",
                        "created": self.created,
                        "model": self.model,
                        "system_fingerprint": None,
                        "choices": [],
                        "usage": self._usage(job),
                    }
                )
            )
        out.append(sse("[DONE]"))
        return out

    def stream_error(self, err: ApiError) -> list[bytes]:
        return [sse(error_body(err)), sse("[DONE]")]

    def ping(self) -> bytes:
        from .sse import comment

        return comment()


# ----------------------------------------------------------------------------- /v1/models
def model_card(engine: Engine, created: int) -> dict:
    return {
        "id": engine.model_id,
        "object": "model",
        "created": created,
        "owned_by": "mlx-dspark",
        "x_mlx_dspark": engine.describe(),
    }


def list_models(engine: Engine, created: int) -> dict:
    return {"object": "list", "data": [model_card(engine, created)]}


def get_model(engine: Engine, name: str, created: int) -> dict:
    if not engine.accepts_model(name):
        raise ApiError(
            404,
            f"The model `{name}` does not exist. This server serves `{engine.model_id}`.",
            "not_found",
            param="model",
            code="model_not_found",
        )
    return model_card(engine, created)
