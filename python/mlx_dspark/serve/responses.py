"""The OpenAI Responses API: POST /v1/responses, GET /v1/responses/{id}.

Input is a string or a list of items (messages with input_text / output_text parts,
function_call and function_call_output items); `instructions` becomes the system turn. Output
items are reasoning, message (output_text) and function_call, in the order the model wrote
them. Streams send the real event sequence (response.created, response.in_progress, then per
item output_item.added, content_part.added, output_text.delta..., output_text.done,
content_part.done, output_item.done, and response.completed or response.incomplete), each with
its sequence_number. `previous_response_id` continues a stored conversation (responses are kept
in memory, the last 256, unless `store: false`); the conversation is re-rendered and prefilled
again (there is no prefix cache yet), so it saves the client the resending, not the server the
prefill. Parameters: see README-params.md.
"""

from __future__ import annotations

import collections
import json
import threading

from . import chat
from .engine import Engine, GenRequest, Job, Plan, build_sampling, resolve_max_tokens, x_block
from .openai import _model, reasoning_tokens
from .sse import new_id, now, sse
from .validate import ApiError, Fields, check_fields, invalid, type_name

FIELDS = {
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_output_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stream",
    "previous_response_id",
    "store",
    "text",
    "metadata",
    "reasoning",
}
REFUSED = {
    "background": lambda v: "background responses are not supported" if v else None,
    "conversation": lambda v: "conversations are not supported: use previous_response_id" if v else None,
    "prompt": lambda v: "prompt templates are not supported" if v else None,
}
STORE_SIZE = 256


def _refuse(prompt: int, asked: int | None, window: int) -> ApiError:
    return ApiError(
        400,
        "Your input exceeds the context window of this model. Please adjust your input and try "
        f"again. ({prompt} input tokens + {asked or 0} max_output_tokens > {window})",
        param="input",
        code="context_length_exceeded",
    )


class Store:
    """Finished responses, for previous_response_id and GET /v1/responses/{id}."""

    def __init__(self, size: int = STORE_SIZE):
        self.lock = threading.Lock()
        self.items: collections.OrderedDict = collections.OrderedDict()
        self.size = size

    def put(self, rid: str, messages: list[dict], body: dict) -> None:
        with self.lock:
            self.items[rid] = (messages, body)
            while len(self.items) > self.size:
                self.items.popitem(last=False)

    def get(self, rid: str):
        with self.lock:
            return self.items.get(rid)


def store_of(engine: Engine) -> Store:
    st = getattr(engine, "_responses_store", None)
    if st is None:
        st = engine._responses_store = Store()
    return st


# ----------------------------------------------------------------------------- input -> messages
def _parts_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"`{where}` must be a string or an array of content parts, got {type_name(content)}", param=where)
    out = []
    for i, p in enumerate(content):
        w = f"{where}[{i}]"
        if not isinstance(p, dict):
            raise invalid(f"`{w}` must be an object, got {type_name(p)}", param=w)
        kind = p.get("type")
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            if not isinstance(p.get("text"), str):
                raise invalid(f"`{w}.text` must be a string", param=w)
            out.append(p["text"])
        elif kind == "refusal":
            continue
        elif kind in ("input_image", "input_file", "input_audio"):
            raise invalid(f"`{w}` is {kind!r} content, but this server runs a text-only model", param=w)
        else:
            raise invalid(f"`{w}.type` must be 'input_text' or 'output_text', got {kind!r}", param=w)
    return "\n".join(out)


def normalize_input(v, prior: list[dict]) -> list[dict]:
    if isinstance(v, str):
        return prior + [{"role": "user", "content": v}]
    if not isinstance(v, list):
        raise invalid(
            "`input` is required"
            if v is None
            else f"`input` must be a string or an array of items, got {type_name(v)}",
            param="input",
        )
    out = [dict(m) for m in prior]
    names = {tc["id"]: tc["function"]["name"] for m in out for tc in m.get("tool_calls", [])}
    for i, item in enumerate(v):
        w = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"`{w}` must be an object, got {type_name(item)}", param=w)
        f = Fields(item, w + ".")
        kind = item.get("type", "message")
        if kind == "message":
            role = f.choice("role", ("user", "assistant", "system", "developer"))
            if role is None:
                raise invalid(f"`{w}.role` is required", param=w)
            text = _parts_text(item.get("content", ""), w + ".content")
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call_id = f.str("call_id", required=True)
            name = f.str("name", required=True, nonempty=True)
            args = f.str("arguments", "{}")
            try:
                parsed = json.loads(args) if args.strip() else {}
            except ValueError:
                parsed = args
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}}
            names[call_id] = name
            if out and out[-1]["role"] == "assistant":
                out[-1] = {**out[-1], "tool_calls": out[-1].get("tool_calls", []) + [call]}
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = f.str("call_id", required=True)
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(output, w + ".output")
            msg = {"role": "tool", "tool_call_id": call_id, "content": text}
            if call_id in names:
                msg["name"] = names[call_id]
            out.append(msg)
        elif kind == "reasoning":
            continue  # the model's own earlier reasoning is not fed back
        else:
            raise invalid(
                f"`{w}.type` {kind!r} is not supported: use message, function_call or function_call_output items",
                param=w,
            )
    if not out or all(m["role"] == "system" for m in out):
        raise invalid("`input` must hold at least one message", param="input")
    return out


def normalize_tools(v) -> list[dict] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise invalid(f"`tools` must be an array, got {type_name(v)}", param="tools")
    out = []
    for i, t in enumerate(v):
        w = f"tools[{i}]"
        if not isinstance(t, dict):
            raise invalid(f"`{w}` must be an object, got {type_name(t)}", param=w)
        if t.get("type") != "function":
            raise invalid(f"`{w}.type` {t.get('type')!r} is a hosted tool; only function tools are supported", param=w)
        f = Fields(t, w + ".")
        spec = {"name": f.str("name", required=True, nonempty=True, max_len=256)}
        if f.has("description"):
            spec["description"] = f.str("description")
        spec["parameters"] = f.dict("parameters", {"type": "object", "properties": {}})
        out.append({"type": "function", "function": spec})
    return out or None


def _tool_choice(v) -> str:
    if v is None or v in ("auto", "required", "none"):
        return v or "auto"
    if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("name"), str):
        return "required"
    raise invalid(
        "`tool_choice` must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
        param="tool_choice",
    )


def _text_format(v) -> None:
    fmt = (v or {}).get("format") if isinstance(v, dict) else None
    if v is not None and not isinstance(v, dict):
        raise invalid(f"`text` must be an object, got {type_name(v)}", param="text")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") not in (None, "text")):
        raise invalid(
            '`text.format`: only {"type": "text"} is supported (no JSON mode or schema-constrained decoding)',
            param="text.format",
        )


# ----------------------------------------------------------------------------- POST /v1/responses
def plan_responses(engine: Engine, body: dict) -> Plan:
    ignored = check_fields(body, FIELDS, REFUSED)
    f = Fields(body)
    model = _model(engine, f)
    prev_id = f.str("previous_response_id")
    prior: list[dict] = []
    if prev_id:
        got = store_of(engine).get(prev_id)
        if got is None:
            raise ApiError(
                404,
                f"Previous response with id '{prev_id}' not found.",
                "not_found",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        prior = got[0]
    messages = normalize_input(body.get("input"), prior)
    instructions = f.str("instructions")
    stored = list(messages)  # instructions are not carried over to the next response, as in the real API
    if instructions:
        messages = [{"role": "system", "content": instructions}] + messages
    tools = normalize_tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"))
    if tools and choice == "required":
        ignored.append("tool_choice (not enforced)")
    if choice == "none":
        tools = None
    parallel = f.bool("parallel_tool_calls", True)
    _text_format(body.get("text"))
    reasoning = f.dict("reasoning", {})
    thinking = engine.default_thinking
    if reasoning.get("effort") in ("none", "minimal"):
        thinking = False
    sampling = build_sampling(f, engine, penalties=False)
    stream = f.bool("stream", False)
    store = f.bool("store", True)
    max_tokens = f.int("max_output_tokens", None, lo=1, hi=1 << 31)
    text = chat.render(
        engine.tokenizer,
        messages,
        tools=tools,
        enable_thinking=thinking,
        window=engine.context_window,
        refuse=_refuse,
        mid_system=engine.mid_system,
    )
    ids, n = chat.encode_within(engine.tokenizer, text, engine.context_window)
    budget = resolve_max_tokens(engine, n, max_tokens, _refuse)
    parser = chat.OutputParser(
        in_reasoning=chat.starts_in_reasoning(text), tools=tools, syntaxes=chat.tool_syntaxes(engine.tokenizer)
    )
    echo = {
        "instructions": instructions,
        "max_output_tokens": max_tokens,
        "previous_response_id": prev_id,
        "parallel_tool_calls": parallel,
        "store": store,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "metadata": f.dict("metadata", {}),
        "text": {"format": {"type": "text"}},
        "reasoning": {"effort": reasoning.get("effort"), "summary": None},
        "truncation": "disabled",
        "user": None,
    }
    resp = ResponsesResponder(engine, model, ignored, echo, stored if store else None, parallel=parallel)
    return Plan(GenRequest(ids, budget, sampling, [], api="openai"), stream, resp, parser)


def get_response(engine: Engine, rid: str) -> dict:
    got = store_of(engine).get(rid)
    if got is None:
        raise ApiError(404, f"Response with id '{rid}' not found.", "not_found", param="response_id")
    return got[1]


class ResponsesResponder:
    def __init__(self, engine: Engine, model: str, ignored, echo: dict, stored: list[dict] | None, *, parallel: bool):
        self.engine, self.model, self.ignored, self.echo = engine, model, ignored, echo
        self.stored, self.parallel = stored, parallel
        self.id, self.created = new_id("resp_"), now()
        self.output: list[dict] = []  # finished items
        self.open: dict | None = None  # the item being streamed (message or reasoning)
        self.seq = 0
        self.n_calls = 0
        self.saw_reasoning = False

    # ------------------------------------------------------------------ the response object
    def _usage(self, job: Job) -> dict:
        p, n = job.outcome.result.prompt_tokens, job.outcome.completion_tokens
        return {
            "input_tokens": p,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": n,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens(self.engine, job, self.saw_reasoning)},
            "total_tokens": p + n,
        }

    def _object(self, status: str, job: Job | None = None) -> dict:
        obj = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "model": self.model,
            "output": list(self.output),
            **self.echo,
            "usage": None,
        }
        if job is not None and job.outcome is not None:
            obj["usage"] = self._usage(job)
            if status == "incomplete":
                obj["incomplete_details"] = {"reason": "max_output_tokens"}
            obj["x_mlx_dspark"] = x_block(self.engine, job, self.ignored)
        return obj

    def _status(self, job: Job) -> str:
        return "incomplete" if job.outcome.result.finish_reason == "length" and not self.n_calls else "completed"

    def _remember(self, body: dict) -> None:
        if self.stored is None:
            return
        text = "".join(c["text"] for it in self.output if it["type"] == "message" for c in it["content"])
        calls = [
            {
                "id": it["call_id"],
                "type": "function",
                "function": {"name": it["name"], "arguments": json.loads(it["arguments"])},
            }
            for it in self.output
            if it["type"] == "function_call"
        ]
        msg = {"role": "assistant", "content": text}
        if calls:
            msg["tool_calls"] = calls
        store_of(self.engine).put(self.id, self.stored + [msg], body)

    # ------------------------------------------------------------------ items
    def _call_item(self, call: chat.ToolCall) -> dict:
        self.n_calls += 1
        return {
            "type": "function_call",
            "id": new_id("fc_"),
            "call_id": new_id("call_"),
            "name": call.name,
            "arguments": call.arguments_json(),
            "status": "completed",
        }

    def _keep_call(self) -> bool:
        return self.parallel or self.n_calls == 0

    def body(self, job: Job, events) -> dict:
        for kind, payload in events:
            if kind == "reasoning":
                self.saw_reasoning = True
                self.output.append(
                    {
                        "type": "reasoning",
                        "id": new_id("rs_"),
                        "summary": [],
                        "content": [{"type": "reasoning_text", "text": payload}],
                    }
                )
            elif kind == "text":
                last = self.output[-1] if self.output else None
                if last is not None and last["type"] == "message":
                    last["content"][0]["text"] += payload
                else:
                    self.output.append(
                        {
                            "type": "message",
                            "id": new_id("msg_"),
                            "status": "completed",
                            "role": "assistant",
                            "content": [{"type": "output_text", "text": payload, "annotations": [], "logprobs": []}],
                        }
                    )
            elif kind == "tool_call" and self._keep_call():
                self.output.append(self._call_item(payload))
        out = self._object(self._status(job), job)
        self._remember(out)
        return out

    # ------------------------------------------------------------------ streams
    def _ev(self, name: str, data: dict) -> bytes:
        self.seq += 1
        return sse({"type": name, "sequence_number": self.seq - 1, **data}, event=name)

    def _open_item(self, item: dict, out: list) -> None:
        self._close(out)
        self.open = item
        idx = len(self.output)
        out.append(
            self._ev(
                "response.output_item.added",
                {"output_index": idx, "item": {**item, "content": [], "status": "in_progress"}},
            )
        )
        part = (
            {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            if item["type"] == "message"
            else {"type": "reasoning_text", "text": ""}
        )
        out.append(
            self._ev(
                "response.content_part.added",
                {"item_id": item["id"], "output_index": idx, "content_index": 0, "part": dict(part)},
            )
        )
        item["content"] = [part]

    def _close(self, out: list) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        idx, part = len(self.output), item["content"][0]
        if item["type"] == "message":
            out.append(
                self._ev(
                    "response.output_text.done",
                    {
                        "item_id": item["id"],
                        "output_index": idx,
                        "content_index": 0,
                        "text": part["text"],
                        "logprobs": [],
                    },
                )
            )
            item["status"] = "completed"
        else:
            out.append(
                self._ev(
                    "response.reasoning_text.done",
                    {"item_id": item["id"], "output_index": idx, "content_index": 0, "text": part["text"]},
                )
            )
        out.append(
            self._ev(
                "response.content_part.done",
                {"item_id": item["id"], "output_index": idx, "content_index": 0, "part": part},
            )
        )
        out.append(self._ev("response.output_item.done", {"output_index": idx, "item": item}))
        self.output.append(item)

    def stream_start(self) -> list[bytes]:
        obj = self._object("in_progress")
        return [self._ev("response.created", {"response": obj}), self._ev("response.in_progress", {"response": obj})]

    def stream_events(self, events) -> list[bytes]:
        out: list[bytes] = []
        for kind, payload in events:
            if kind in ("text", "reasoning"):
                want = "message" if kind == "text" else "reasoning"
                if self.open is None or self.open["type"] != want:
                    if kind == "text":
                        self._open_item(
                            {"type": "message", "id": new_id("msg_"), "status": "in_progress", "role": "assistant"}, out
                        )
                    else:
                        self.saw_reasoning = True
                        self._open_item({"type": "reasoning", "id": new_id("rs_"), "summary": []}, out)
                item, idx = self.open, len(self.output)
                item["content"][0]["text"] += payload
                name = "response.output_text.delta" if kind == "text" else "response.reasoning_text.delta"
                extra = {"logprobs": []} if kind == "text" else {}
                out.append(
                    self._ev(
                        name,
                        {"item_id": item["id"], "output_index": idx, "content_index": 0, "delta": payload, **extra},
                    )
                )
            elif kind == "tool_call" and self._keep_call():
                self._close(out)
                item, idx = self._call_item(payload), len(self.output)
                out.append(
                    self._ev(
                        "response.output_item.added",
                        {"output_index": idx, "item": {**item, "arguments": "", "status": "in_progress"}},
                    )
                )
                out.append(
                    self._ev(
                        "response.function_call_arguments.delta",
                        {"item_id": item["id"], "output_index": idx, "delta": item["arguments"]},
                    )
                )
                out.append(
                    self._ev(
                        "response.function_call_arguments.done",
                        {
                            "item_id": item["id"],
                            "output_index": idx,
                            "name": item["name"],
                            "arguments": item["arguments"],
                        },
                    )
                )
                out.append(self._ev("response.output_item.done", {"output_index": idx, "item": item}))
                self.output.append(item)
        return out

    def stream_finish(self, job: Job) -> list[bytes]:
        out: list[bytes] = []
        self._close(out)
        status = self._status(job)
        obj = self._object(status, job)
        self._remember(obj)
        out.append(
            self._ev("response.completed" if status == "completed" else "response.incomplete", {"response": obj})
        )
        return out

    def stream_error(self, err: ApiError) -> list[bytes]:
        return [self._ev("error", {"code": err.code or err.kind, "message": err.message, "param": err.param})]

    def ping(self) -> bytes:
        from .sse import comment

        return comment()
