"""The Anthropic dialect: POST /v1/messages and /v1/messages/count_tokens.

Streams use the real event sequence: message_start, ping, then per content block
content_block_start / content_block_delta... / content_block_stop, then message_delta (stop
reason, usage) and message_stop. Reasoning becomes thinking blocks, the model's tool syntax
becomes tool_use blocks, tool_use / tool_result history is rendered through the model's own
template. Parameters: see README-params.md.
"""

from __future__ import annotations

from . import chat
from .engine import Engine, GenRequest, Job, Plan, build_sampling, resolve_max_tokens, x_block
from .sse import new_id, sse
from .validate import ApiError, Fields, check_fields, invalid, type_name

_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "too_large": "request_too_large",
    "unsupported_media": "invalid_request_error",
    "rate_limit": "rate_limit_error",
    "overloaded": "overloaded_error",
    "server_error": "api_error",
}


def error_body(err: ApiError) -> dict:
    return {"type": "error", "error": {"type": _TYPES.get(err.kind, "invalid_request_error"), "message": err.message}}


def _refuse(prompt: int, asked: int | None, window: int) -> ApiError:
    """The real API's two wordings: Claude Code lowers `max_tokens` and retries on the second."""
    if asked is None or prompt >= window:
        return invalid(f"prompt is too long: {prompt} tokens > {window} maximum")
    return invalid(
        f"input length and `max_tokens` exceed context limit: {prompt} + {asked} > {window}, "
        "decrease input length or `max_tokens` and try again"
    )


def _nonempty(why):
    return lambda v: why if v else None


MESSAGE_FIELDS = {
    "model",
    "messages",
    "max_tokens",
    "system",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "tools",
    "tool_choice",
    "thinking",
}
MESSAGE_REFUSED = {
    "container": _nonempty("containers are not supported"),
    "mcp_servers": _nonempty("MCP servers are not supported by this server"),
}
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking"}


# ----------------------------------------------------------------------------- translation
def _blocks(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise invalid(f"`{where}` must be a string or an array of content blocks, got {type_name(content)}")
    for i, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise invalid(f"`{where}[{i}]` must be a content block object with a `type`")
    return content


def _block_text(b: dict, w: str) -> str:
    t = b["type"]
    if t == "text":
        if not isinstance(b.get("text"), str):
            raise invalid(f"`{w}.text` must be a string")
        return b["text"]
    if t in ("image", "document", "search_result"):
        raise invalid(f"`{w}` is {t!r} content, but this server runs a text-only model")
    raise invalid(f"`{w}.type` {t!r} is not supported here")


def _text_of(blocks, where: str) -> str:
    return "\n".join(_block_text(b, f"{where}[{i}]") for i, b in enumerate(blocks))


def system_text(system) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        return _text_of(_blocks(system, "system"), "system")
    raise invalid(f"`system` must be a string or an array of text blocks, got {type_name(system)}")


def _assistant(blocks, where: str) -> dict:
    text, thinking, calls = [], [], []
    for i, b in enumerate(blocks):
        t, w = b["type"], f"{where}[{i}]"
        if t == "text":
            if not isinstance(b.get("text"), str):
                raise invalid(f"`{w}.text` must be a string")
            text.append(b["text"])
        elif t == "thinking":
            if isinstance(b.get("thinking"), str):
                thinking.append(b["thinking"])
        elif t == "redacted_thinking":
            continue
        elif t == "tool_use":
            f = Fields(b, w + ".")
            calls.append(
                {
                    "id": f.str("id", required=True),
                    "type": "function",
                    "function": {"name": f.str("name", required=True, nonempty=True), "arguments": f.dict("input", {})},
                }
            )
        else:
            raise invalid(f"`{w}.type` {t!r} is not supported in an assistant message")
    msg = {"role": "assistant", "content": "\n".join(text)}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = "\n".join(thinking)
    return msg


def _user(blocks, where: str, names: dict) -> list[dict]:
    out, text = [], []
    for i, b in enumerate(blocks):
        t, w = b["type"], f"{where}[{i}]"
        if t == "tool_result":
            f = Fields(b, w + ".")
            call_id = f.str("tool_use_id", required=True)
            content = b.get("content")
            body = "" if content is None else _text_of(_blocks(content, w + ".content"), w + ".content")
            if f.bool("is_error", False):
                body = "Error: " + body
            msg = {"role": "tool", "tool_call_id": call_id, "content": body}
            if call_id in names:
                msg["name"] = names[call_id]
            out.append(msg)
        else:
            text.append(_block_text(b, w))
    if text:
        out.append({"role": "user", "content": "\n".join(text)})
    return out


def normalize(body: dict) -> tuple[list[dict], bool]:
    """Anthropic system + messages -> neutral messages, and whether the last one is an assistant
    prefill that the model continues."""
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        raise invalid(
            "`messages` is required and must be an array"
            if msgs is None
            else f"`messages` must be an array, got {type_name(msgs)}"
        )
    if not msgs:
        raise invalid("`messages` must not be empty")
    out: list[dict] = []
    sys_text = system_text(body.get("system"))
    if sys_text:
        out.append({"role": "system", "content": sys_text})
    names: dict = {}
    for i, m in enumerate(msgs):
        w = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(f"`{w}` must be an object, got {type_name(m)}")
        role = Fields(m, w + ".").choice("role", ("user", "assistant", "system"))
        if role is None:
            raise invalid(f"`{w}.role` is required")
        if "content" not in m:
            raise invalid(f"`{w}.content` is required")
        blocks = _blocks(m["content"], w + ".content")
        if not blocks and not (role == "assistant" and i == len(msgs) - 1):
            raise invalid(
                f"messages.{i}: all messages must have non-empty content except for the optional "
                "final assistant message"
            )
        if role == "system":  # mid-conversation system entries (Claude Code's beta); chat.render places them
            text = _text_of(blocks, w + ".content")
            if all(x["role"] == "system" for x in out):
                if out:
                    out[0]["content"] = "\n\n".join(x for x in (out[0]["content"], text) if x)
                elif text:
                    out.append({"role": "system", "content": text})
            elif text:
                out.append({"role": "system", "content": text})
        elif role == "assistant":
            msg = _assistant(blocks, w + ".content")
            names.update({c["id"]: c["function"]["name"] for c in msg.get("tool_calls", [])})
            _append(out, msg)
        else:
            for msg in _user(blocks, w + ".content", names):
                _append(out, msg)
    if not any(x["role"] != "system" for x in out):
        raise invalid("messages: at least one user or assistant message is required")
    last = out[-1]
    prefill = last["role"] == "assistant" and not last.get("tool_calls") and bool(last["content"])
    if last["role"] == "assistant" and not prefill:
        out.pop()  # an empty trailing assistant turn adds nothing
    return out, prefill


def _append(out: list, msg: dict) -> None:
    """Consecutive turns of one role merge, as the real API does."""
    prev = out[-1] if out else None
    if prev is not None and prev["role"] == msg["role"] and msg["role"] in ("user", "assistant"):
        prev["content"] = "\n\n".join(x for x in (prev["content"], msg["content"]) if x)
        if msg.get("tool_calls"):
            prev["tool_calls"] = prev.get("tool_calls", []) + msg["tool_calls"]
        return
    out.append(msg)


def normalize_tools(v) -> list[dict] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise invalid(f"`tools` must be an array, got {type_name(v)}")
    out = []
    for i, t in enumerate(v):
        w = f"tools[{i}]"
        if not isinstance(t, dict):
            raise invalid(f"`{w}` must be an object, got {type_name(t)}")
        if t.get("type") not in (None, "custom"):
            raise invalid(
                f"`{w}` is a server tool ({t.get('type')!r}); only client tools with an input_schema are supported"
            )
        f = Fields(t, w + ".")
        spec = {"name": f.str("name", required=True, nonempty=True, max_len=256)}
        if f.has("description"):
            spec["description"] = f.str("description")
        spec["parameters"] = f.dict("input_schema", required=True)
        out.append({"type": "function", "function": spec})
    return out or None


def _tool_choice(v) -> tuple[str, bool]:
    """(auto|any|tool|none, parallel allowed)."""
    if v is None:
        return "auto", True
    if not isinstance(v, dict):
        raise invalid(f"`tool_choice` must be an object, got {type_name(v)}")
    f = Fields(v, "tool_choice.")
    kind = f.choice("type", ("auto", "any", "tool", "none"))
    if kind is None:
        raise invalid("`tool_choice.type` is required")
    if kind == "tool":
        f.str("name", required=True, nonempty=True)
    return kind, not f.bool("disable_parallel_tool_use", False)


def _thinking(v) -> tuple[bool | None, bool]:
    """(enable_thinking for the template, whether thinking blocks are returned)."""
    if v is None:
        return None, True
    if not isinstance(v, dict):
        raise invalid(f"`thinking` must be an object, got {type_name(v)}")
    f = Fields(v, "thinking.")
    kind = f.choice("type", ("enabled", "disabled", "adaptive"))
    if kind == "enabled":
        f.int("budget_tokens", required=True, lo=1024)
        return True, True
    if kind == "disabled":
        return False, False
    if kind == "adaptive":
        return None, True
    raise invalid("`thinking.type` is required")


def _model(engine: Engine, f: Fields) -> str:
    name = f.str("model", required=True)
    if not engine.accepts_model(name):
        raise ApiError(404, f"model: {name} (this server serves {engine.model_id})", "not_found")
    return name


def _render(engine: Engine, body: dict, tools, choice: str, thinking: bool | None, refuse=None) -> tuple[str, bool]:
    messages, prefill = normalize(body)
    if thinking is None:
        thinking = engine.default_thinking
    text = chat.render(
        engine.tokenizer,
        messages,
        tools=None if choice == "none" else tools,
        enable_thinking=thinking,
        continue_final=prefill,
        window=engine.context_window,
        refuse=refuse,
        mid_system=engine.mid_system,
    )
    return text, prefill


# ----------------------------------------------------------------------------- /v1/messages
def plan_messages(engine: Engine, body: dict) -> Plan:
    ignored = check_fields(body, MESSAGE_FIELDS, MESSAGE_REFUSED)
    f = Fields(body)
    model = _model(engine, f)
    max_tokens = f.int("max_tokens", required=True, lo=1, hi=1 << 31)
    tools = normalize_tools(body.get("tools"))
    choice, parallel = _tool_choice(body.get("tool_choice"))
    if tools and choice in ("any", "tool"):
        ignored.append("tool_choice (not enforced)")
    enable, show_thinking = _thinking(body.get("thinking"))
    sampling = build_sampling(f, engine, temp_hi=1.0, penalties=False)
    stop = f.str_list("stop_sequences", max_items=64)
    stream = f.bool("stream", False)
    text, prefill = _render(engine, body, tools, choice, enable, _refuse)
    ids, n = chat.encode_within(engine.tokenizer, text, engine.context_window)
    budget = resolve_max_tokens(engine, n, max_tokens, _refuse)
    parser = chat.OutputParser(
        in_reasoning=chat.starts_in_reasoning(text),
        continuing=prefill,
        tools=None if choice == "none" else tools,
        syntaxes=chat.tool_syntaxes(engine.tokenizer),
    )
    resp = MessagesResponder(engine, model, ignored, len(ids), show_thinking=show_thinking, parallel=parallel)
    # A prefill's continuation keeps its leading space ("I have" + " continued.").
    return Plan(GenRequest(ids, budget, sampling, stop, api="anthropic", raw=prefill), stream, resp, parser)


def count_tokens(engine: Engine, body: dict) -> dict:
    f = Fields(body)
    _model(engine, f)
    tools = normalize_tools(body.get("tools"))
    choice, _ = _tool_choice(body.get("tool_choice"))
    enable, _ = _thinking(body.get("thinking"))
    text, _ = _render(engine, body, tools, choice, enable)
    return {"input_tokens": chat.count_tokens(engine.tokenizer, text)[0]}


class MessagesResponder:
    def __init__(self, engine: Engine, model: str, ignored, prompt_tokens: int, *, show_thinking: bool, parallel: bool):
        self.engine, self.model, self.ignored = engine, model, ignored
        self.prompt_tokens = prompt_tokens
        self.show_thinking, self.parallel = show_thinking, parallel
        self.id = new_id("msg_")
        self.n_calls = 0
        self.index = -1
        self.open: str | None = None  # type of the open content block in a stream

    def _stop(self, job: Job) -> tuple[str, str | None]:
        if self.n_calls:
            return "tool_use", None
        if job.outcome.result.finish_reason == "length":
            return "max_tokens", None
        if job.outcome.stop_sequence is not None:
            return "stop_sequence", job.outcome.stop_sequence
        return "end_turn", None

    def _usage(self, job: Job) -> dict:
        # As Anthropic counts: input_tokens excludes the prompt tokens read from the cache.
        res = job.outcome.result
        cached = getattr(res, "cached_tokens", 0)
        return {
            "input_tokens": res.prompt_tokens - cached,
            "output_tokens": job.outcome.completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        }

    def _keep_call(self) -> bool:
        return self.parallel or self.n_calls == 0

    def body(self, job: Job, events) -> dict:
        content = []
        for kind, payload in events:
            if kind == "reasoning" and self.show_thinking:
                if content and content[-1]["type"] == "thinking":
                    content[-1]["thinking"] += payload
                else:
                    content.append({"type": "thinking", "thinking": payload, "signature": ""})
            elif kind == "text":
                if content and content[-1]["type"] == "text":
                    content[-1]["text"] += payload
                else:
                    content.append({"type": "text", "text": payload})
            elif kind == "tool_call" and self._keep_call():
                content.append(
                    {"type": "tool_use", "id": new_id("toolu_"), "name": payload.name, "input": payload.arguments}
                )
                self.n_calls += 1
        reason, seq = self._stop(job)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": seq,
            "usage": self._usage(job),
            "x_mlx_dspark": x_block(self.engine, job, self.ignored),
        }

    @staticmethod
    def _ev(name: str, data: dict) -> bytes:
        return sse({"type": name, **data}, event=name)

    def stream_start(self) -> list[bytes]:
        msg = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": self.prompt_tokens,
                "output_tokens": 0,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        }
        return [self._ev("message_start", {"message": msg}), self.ping()]

    def _open(self, kind: str, block: dict, out: list) -> None:
        self._close(out)
        self.index += 1
        self.open = kind
        out.append(self._ev("content_block_start", {"index": self.index, "content_block": block}))

    def _close(self, out: list) -> None:
        if self.open is None:
            return
        if self.open == "thinking":
            out.append(
                self._ev(
                    "content_block_delta", {"index": self.index, "delta": {"type": "signature_delta", "signature": ""}}
                )
            )
        out.append(self._ev("content_block_stop", {"index": self.index}))
        self.open = None

    def stream_events(self, events) -> list[bytes]:
        out: list[bytes] = []
        for kind, payload in events:
            if kind == "reasoning" and self.show_thinking:
                if self.open != "thinking":
                    self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""}, out)
                out.append(
                    self._ev(
                        "content_block_delta",
                        {"index": self.index, "delta": {"type": "thinking_delta", "thinking": payload}},
                    )
                )
            elif kind == "text":
                if self.open != "text":
                    self._open("text", {"type": "text", "text": ""}, out)
                out.append(
                    self._ev(
                        "content_block_delta", {"index": self.index, "delta": {"type": "text_delta", "text": payload}}
                    )
                )
            elif kind == "tool_call" and self._keep_call():
                self._open(
                    "tool_use", {"type": "tool_use", "id": new_id("toolu_"), "name": payload.name, "input": {}}, out
                )
                out.append(
                    self._ev(
                        "content_block_delta",
                        {
                            "index": self.index,
                            "delta": {"type": "input_json_delta", "partial_json": payload.arguments_json()},
                        },
                    )
                )
                self._close(out)
                self.n_calls += 1
        return out

    def stream_finish(self, job: Job) -> list[bytes]:
        out: list[bytes] = []
        self._close(out)
        reason, seq = self._stop(job)
        usage = self._usage(job)
        out.append(
            self._ev(
                "message_delta",
                {
                    "delta": {"stop_reason": reason, "stop_sequence": seq},
                    "usage": usage,
                    "x_mlx_dspark": x_block(self.engine, job, self.ignored),
                },
            )
        )
        out.append(self._ev("message_stop", {}))
        return out

    def stream_error(self, err: ApiError) -> list[bytes]:
        return [sse(error_body(err), event="error")]

    def ping(self) -> bytes:
        return self._ev("ping", {})
