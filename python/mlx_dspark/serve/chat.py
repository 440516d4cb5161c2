"""Chat templates in, the model's own syntax out.

Rendering: messages in a neutral (OpenAI-like) form, tools in the OpenAI function shape, go
through the loaded tokenizer's own chat template, so each family gets its own tool and thinking
syntax. Parsing: `OutputParser` splits what the model writes into reasoning, text and tool calls,
incrementally (the same code serves streaming and non-streaming answers). Tool syntaxes:

  Hermes JSON   <tool_call>{"name": ..., "arguments": {...}}</tool_call>        (Qwen, many)
  XML           <tool_call><function=f><parameter=p>v</parameter></function></tool_call>,
                or a bare <function=...>...</function>                         (Qwen3-Coder, qwen3_5)
  Gemma 4       <|tool_call>call:f{key:<|"|>v<|"|>}<tool_call|>
  the tokenizer's own parser, when mlx-lm inferred one for this model (GLM, Kimi, Mistral, ...)

The XML and Gemma payloads are parsed by mlx-lm's parsers (mlx_lm/tool_parsers, through compat.py).
Reasoning markers: <think>...</think> and Gemma's <|channel>thought...<channel|>.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from .validate import ApiError

THINK_PAIRS = (("<think>", "</think>"), ("<|channel>thought", "<channel|>"))

# HF fast tokenizers are not safe to drive from many threads at once: handler threads take this
# lock around rendering, encoding and decoding. The engine thread detokenizes with its own copy.
TOKENIZER_LOCK = threading.Lock()


@dataclass
class ToolCall:
    name: str
    arguments: dict

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


# ----------------------------------------------------------------------------- rendering
PROBE_TOOL = "mlx_dspark_probe_tool"
_RENDERS_TOOLS: dict = {}  # id(tokenizer) -> whether its template renders tool schemas

FALLBACK_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
FALLBACK_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>"
)


def _apply(tokenizer, messages, tools, continue_final, kwargs) -> str:
    with TOKENIZER_LOCK:
        return tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=not continue_final, **kwargs
        )


def template_renders_tools(tokenizer) -> bool:
    """Whether the chat template puts tool schemas in the prompt (probed once per tokenizer)."""
    key = id(tokenizer)
    if key not in _RENDERS_TOOLS:
        tool = {
            "type": "function",
            "function": {
                "name": PROBE_TOOL,
                "description": "probe",
                "parameters": {"type": "object", "properties": {}},
            },
        }
        try:
            text = _apply(tokenizer, [{"role": "user", "content": "x"}], [tool], False, {})
            _RENDERS_TOOLS[key] = isinstance(text, str) and PROBE_TOOL in text
        except Exception:
            _RENDERS_TOOLS[key] = False
    return _RENDERS_TOOLS[key]


def tools_as_text(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The documented fallback for templates without tool support: the schemas go into the system
    turn with Hermes instructions, past calls become <tool_call> JSON in the assistant's text and
    tool results become <tool_response> user turns. Calls are parsed back by the Hermes syntax.
    Each schema is one line of JSON without whitespace between tokens (every field kept): Claude
    Code's 24 schemas are 16,623 tokens so on the demo's tokenizer, 536 fewer than spaced JSON."""
    schemas = "\n".join(json.dumps(t, ensure_ascii=False, separators=(",", ":")) for t in tools)
    block = FALLBACK_TOOLS_HEADER + schemas + FALLBACK_TOOLS_FOOTER
    out: list[dict] = []
    for m in messages:
        m = dict(m)
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = []
            for c in m.pop("tool_calls"):
                args = c["function"]["arguments"]
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except ValueError:
                        pass
                calls.append(
                    "<tool_call>\n"
                    + json.dumps({"name": c["function"]["name"], "arguments": args}, ensure_ascii=False)
                    + "\n</tool_call>"
                )
            m["content"] = "\n".join(x for x in [m.get("content") or ""] + calls if x)
        elif m["role"] == "tool":
            m = {"role": "user", "content": "<tool_response>\n" + (m.get("content") or "") + "\n</tool_response>"}
        if out and m["role"] == "user" and out[-1]["role"] == "user":
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + m["content"]}
            continue
        out.append(m)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": (out[0]["content"] + "\n\n" if out[0]["content"] else "") + block}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out


def lead_system(messages: list[dict]) -> list[dict]:
    """Leading system entries become one system turn (most templates read only messages[0])."""
    n = 0
    while n < len(messages) and messages[n]["role"] == "system":
        n += 1
    if n <= 1:
        return messages
    text = "\n\n".join(m["content"] for m in messages[:n] if m["content"])
    return [{"role": "system", "content": text}] + messages[n:]


def merge_mid_system(messages: list[dict]) -> list[dict]:
    """System entries after the first turn, for templates that refuse or drop them (or with
    `mid_system="merge"`): their text goes into a user turn, ahead of the user's text. Ones that
    directly follow a user turn go into that turn (Claude Code sends [user, system] and keeps the
    entry there as the conversation grows: the turn renders the same in every later request, so
    the prefix cache keeps it, and the user's request stays the last thing before the answer);
    ones that follow an assistant turn go into the next user turn, else become a user turn."""
    out: list[dict] = []
    parts: dict[int, list[str]] = {}  # index in `out` of a user turn -> its system texts, in order
    pending: list[str] = []  # system texts after an assistant turn, for the next user turn
    for i, m in enumerate(messages):
        if m["role"] == "system" and i > 0:
            if m["content"]:
                if out and out[-1]["role"] == "user":
                    parts.setdefault(len(out) - 1, []).append(m["content"])
                else:
                    pending.append(m["content"])
            continue
        if m["role"] == "user" and pending:
            parts[len(out)] = pending
            pending = []
        out.append(m)
    for k, texts in parts.items():
        text = out[k]["content"]
        out[k] = {**out[k], "content": "\n\n".join(texts + ([text] if text else []))}
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out


_MAX_TOKEN_CHARS: dict = {}  # id(tokenizer) -> the longest vocabulary entry, in characters


def max_token_chars(tokenizer) -> int:
    """The most characters one token can cover: the longest vocabulary entry (byte-level entries
    spell one character per byte, so this bounds the characters of the text too); 0 if unknown."""
    key = id(tokenizer)
    if key not in _MAX_TOKEN_CHARS:
        try:
            with TOKENIZER_LOCK:
                vocab = tokenizer.get_vocab()
            _MAX_TOKEN_CHARS[key] = max((len(t) for t in vocab), default=0)
        except Exception:
            _MAX_TOKEN_CHARS[key] = 0
    return _MAX_TOKEN_CHARS[key]


def text_floor(tokenizer, texts) -> int:
    """A floor on the token count of any text that holds each of `texts` (whitespace at their ends
    aside): no token covers more than max_token_chars characters; halved again for normalizers
    that compose two characters into one. 0 when the vocabulary is unknown."""
    most = max_token_chars(tokenizer)
    if most <= 0:
        return 0
    return sum(len(t.strip()) for t in texts if isinstance(t, str)) // (2 * most)


def refuse_if_surely_over(tokenizer, messages: list[dict], window: int | None, refuse) -> None:
    """Raise `refuse(floor, None, window)` when the user, system and tool text alone (which every
    template renders) surely holds more than `window` tokens: a 30 MB body is refused before it
    is rendered or tokenized, in the time its JSON takes to parse."""
    if window is None:
        return
    texts = [m.get("content") for m in messages if m.get("role") in ("user", "system", "tool")]
    texts = [t for t in texts if isinstance(t, str)]
    n = text_floor(tokenizer, texts)
    if n > window:
        # The count said is an estimate from a sample of the longest text (the floor is proof, not a count).
        longest = max(texts, key=len)
        mid = len(longest) // 2
        sample = longest[max(0, mid - 2048) : mid + 2048]
        per = len(encode(tokenizer, sample)) / max(1, len(sample))
        raise refuse(max(n, int(per * sum(len(t) for t in texts))), None, window)


def render(
    tokenizer,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    enable_thinking: bool | None = None,
    template_kwargs: dict | None = None,
    continue_final: bool = False,
    window: int | None = None,
    refuse=None,
    mid_system: str = "turn",
) -> str:
    """The prompt text for `messages` through the model's own chat template.

    System entries anywhere are kept: leading ones merge into one system turn; later ones are a
    system turn in place where the template renders one, else (or with `mid_system="merge"`)
    they join a user turn (`merge_mid_system`).
    Tools go through the template when it renders them, else through `tools_as_text`. With
    `window` and `refuse`, a conversation that surely overflows the window is refused first
    (`refuse_if_surely_over`)."""
    if not getattr(tokenizer, "has_chat_template", getattr(tokenizer, "chat_template", None) is not None):
        raise ApiError(400, "this model has no chat template: use /v1/completions with a raw prompt")
    if refuse is not None:
        refuse_if_surely_over(tokenizer, messages, window, refuse)
    kwargs = dict(template_kwargs or {})
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    if continue_final:
        kwargs["continue_final_message"] = True
    messages = lead_system(messages)
    if tools and not template_renders_tools(tokenizer):
        messages, tools = tools_as_text(messages, tools), None
    if mid_system == "merge":
        messages = merge_mid_system(messages)
    mid = [m["content"] for m in messages[1:] if m["role"] == "system" and m["content"]]
    try:
        text = None
        if mid:
            try:
                text = _apply(tokenizer, messages, tools, continue_final, kwargs)
                if not isinstance(text, str) or not all(c in text for c in mid):
                    text = None  # the template dropped them
            except Exception:
                text = None
            if text is None:
                messages = merge_mid_system(messages)
        if text is None:
            text = _apply(tokenizer, messages, tools, continue_final, kwargs)
    except Exception as e:  # jinja raises anything: the input caused it, so it is a 400
        msg = str(e) or type(e).__name__
        raise ApiError(400, f"the model's chat template could not render these messages: {msg}") from None
    if not isinstance(text, str):
        raise ApiError(400, "the model's chat template did not produce text")
    return text


def encode(tokenizer, text: str, *, special: bool = False) -> list[int]:
    try:
        with TOKENIZER_LOCK:
            return list(tokenizer.encode(text, add_special_tokens=special))
    except Exception as e:  # e.g. lone surrogates that survived JSON decoding
        raise ApiError(400, f"the prompt could not be tokenized: {e}") from None


COUNT_CHUNK = 1 << 16  # characters per piece when a long text is counted piece by piece


def _pieces(text: str, size: int = COUNT_CHUNK):
    """`text` cut before a space that follows a non-space and precedes a letter or digit: a
    boundary of the byte-level and metaspace pre-tokenizers, so piece counts add up."""
    i, n = 0, len(text)
    while i < n:
        j = min(i + size, n)
        if j < n:
            k = text.rfind(" ", i + size // 2, j)
            while k > i and (text[k - 1].isspace() or not text[k + 1 : k + 2].isalnum()):
                k = text.rfind(" ", i + size // 2, k)
            if k > i:
                j = k
        yield text[i:j]
        i = j


def count_tokens(tokenizer, text: str, *, special: bool = False, stop_above: int | None = None) -> tuple[int, bool]:
    """(token count, exact) of `text`, piece by piece: the tokenizer lock is released between
    pieces (a huge body never starves other requests) and memory stays bounded. With
    `stop_above`, counting stops once the count passes it; the rest is extrapolated by length
    and `exact` is False."""
    done, total = 0, 0
    for piece in _pieces(text):
        total += len(encode(tokenizer, piece, special=special and done == 0))
        done += len(piece)
        if stop_above is not None and total > stop_above and done < len(text):
            return int(total * len(text) / done), False
    return total, True


def encode_within(tokenizer, text: str, limit: int | None, *, special: bool = False) -> tuple[list[int] | None, int]:
    """(ids, count) of the prompt, or (None, estimate) when it surely holds more than `limit`
    tokens. A cheap bound first: a long text is counted piece by piece and refused as soon as
    the count passes the limit, so an over-context body of any size is refused quickly."""
    if limit is None or len(text) <= 4 * limit + COUNT_CHUNK:
        ids = encode(tokenizer, text, special=special)
        return ids, len(ids)
    n, exact = count_tokens(tokenizer, text, special=special, stop_above=limit)
    if n > limit:
        return None, n
    ids = encode(tokenizer, text, special=special)
    return ids, len(ids)


def decode_token(tokenizer, token: int) -> str:
    with TOKENIZER_LOCK:
        return tokenizer.decode([int(token)])


def starts_in_reasoning(prompt_text: str) -> bool:
    """True when the template opened a reasoning block for the model (the prompt ends inside it)."""
    tail = prompt_text.rstrip()
    return any(tail.endswith(start) for start, _ in THINK_PAIRS)


def think_end_token(tokenizer) -> int | None:
    """The id of the single token that closes reasoning, if there is one."""
    try:
        ids = tokenizer.think_end_tokens
    except Exception:
        ids = None
    return int(ids[0]) if ids and len(ids) == 1 else None


# ----------------------------------------------------------------------------- tool syntaxes
def _hermes(inner: str, tools) -> list[ToolCall]:
    inner = inner.strip()
    if inner.startswith("<function="):
        return _xml(inner, tools)
    obj = json.loads(inner)
    items = obj if isinstance(obj, list) else [obj]
    out = []
    for it in items:
        if not isinstance(it, dict) or not isinstance(it.get("name"), str) or not it["name"]:
            raise ValueError("a tool call needs a name")
        args = it.get("arguments", it.get("parameters", {}))
        out.append(ToolCall(it["name"], _as_object(args)))
    return out


def _xml(inner: str, tools) -> list[ToolCall]:
    from ..compat import mlx_lm_tool_call

    out = []
    for part in inner.split("</function>"):
        if "<function=" not in part:
            if part.strip():
                raise ValueError("text between XML function calls")
            continue
        body = part[part.index("<function=") :] + "</function>"
        got = mlx_lm_tool_call("qwen3_coder", body, tools)
        out.append(ToolCall(got["name"], _as_object(got["arguments"])))
    if not out:
        raise ValueError("no function in the XML tool call")
    return out


def _gemma(inner: str, tools) -> list[ToolCall]:
    from ..compat import mlx_lm_tool_call

    got = mlx_lm_tool_call("gemma4", inner, tools)
    return [ToolCall(g["name"], _as_object(g["arguments"])) for g in (got if isinstance(got, list) else [got])]


def _as_object(args: Any) -> dict:
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    if not isinstance(args, dict):
        raise ValueError("tool arguments must be an object")
    return args


@dataclass
class ToolSyntax:
    start: str
    end: str
    parse: Callable[[str, Any], list[ToolCall]]  # parse(text between start and end, tools)


BUILTIN_SYNTAXES = [
    ToolSyntax("<tool_call>", "</tool_call>", _hermes),
    ToolSyntax(
        "<|tool_call>", "<tool_call|>", lambda inner, tools: _gemma("<|tool_call>" + inner + "<tool_call|>", tools)
    ),
    ToolSyntax("<function=", "</function>", lambda inner, tools: _xml("<function=" + inner + "</function>", tools)),
]


def tool_syntaxes(tokenizer) -> list[ToolSyntax]:
    """The built-in syntaxes, plus the tokenizer's own when mlx-lm inferred another one."""
    out = list(BUILTIN_SYNTAXES)
    start = getattr(tokenizer, "tool_call_start", None) if tokenizer is not None else None
    end = getattr(tokenizer, "tool_call_end", None) if tokenizer is not None else None
    parser = getattr(tokenizer, "tool_parser", None) if tokenizer is not None else None
    if (
        isinstance(start, str)
        and isinstance(end, str)
        and start
        and parser is not None
        and all(s.start != start for s in out)
    ):

        def parse(inner, tools, _p=parser):
            got = _p(inner, tools)
            return [ToolCall(g["name"], _as_object(g["arguments"])) for g in (got if isinstance(got, list) else [got])]

        out.insert(0, ToolSyntax(start, end, parse))
    return out


# ----------------------------------------------------------------------------- output parsing
def _partial_suffix(text: str, markers) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


def _trailing_ws(text: str) -> int:
    return len(text) - len(text.rstrip())


@dataclass
class OutputParser:
    """Splits model output into ("reasoning", str), ("text", str) and ("tool_call", ToolCall) events.

    feed() returns the events that are certain so far; text that could still turn into a marker
    is held back. finish() flushes. Non-streaming answers run the same parser over the whole text.
    """

    in_reasoning: bool = False  # the template opened a reasoning block
    continuing: bool = False  # the model continues a prefilled answer: its text is taken as is
    tools: list | None = None  # tool definitions (OpenAI shape); None = do not parse tool calls
    syntaxes: list = field(default_factory=lambda: list(BUILTIN_SYNTAXES))

    def __post_init__(self):
        self.mode = "reasoning" if self.in_reasoning else "text" if self.continuing else "start"
        self.think_end = THINK_PAIRS[0][1]
        self.buf = ""
        self.syntax: ToolSyntax | None = None
        self.strip_next = not self.continuing  # drop leading whitespace of the next text/reasoning run

    def feed(self, text: str) -> list[tuple]:
        self.buf += text
        out: list[tuple] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[tuple]:
        out: list[tuple] = []
        while self._step(out, final=True):
            pass
        if self.mode == "tool" and self.buf:
            self._close_tool(self.buf[len(self.syntax.start) :], self.buf, out)
            self.buf = ""
        if self.buf:
            kind = "reasoning" if self.mode == "reasoning" else "text"
            text = self.buf.strip() if kind == "reasoning" or self.strip_next else self.buf
            if text:
                out.append((kind, text))
            self.buf = ""
        return out

    # one transition at a time; returns True when it made progress and should run again
    def _step(self, out: list, final: bool) -> bool:
        if self.mode == "start":
            s = self.buf.lstrip()
            for start, end in THINK_PAIRS:
                if s.startswith(start):
                    self.mode, self.think_end, self.buf, self.strip_next = "reasoning", end, s[len(start) :], True
                    return True
            if not final and (not s or any(start.startswith(s) for start, _ in THINK_PAIRS)):
                return False
            self.mode = "text"
            return bool(self.buf)
        if self.mode == "reasoning":
            return self._run(out, "reasoning", [self.think_end], final, self._end_reasoning)
        if self.mode == "text":
            if self.tools is None:
                return self._run(out, "text", [], final, None)
            return self._run(out, "text", [s.start for s in self.syntaxes], final, self._open_tool)
        if self.mode == "tool":
            i = self.buf.find(self.syntax.end, len(self.syntax.start))
            if i < 0:
                return False
            j = i + len(self.syntax.end)
            self._close_tool(self.buf[len(self.syntax.start) : i], self.buf[:j], out)
            self.buf = self.buf[j:]
            self.mode, self.strip_next = "text", True
            return True
        return False

    def _run(self, out, kind, markers, final, on_marker) -> bool:
        if self.strip_next:
            self.buf = self.buf.lstrip()
            if not self.buf:
                return False
            self.strip_next = False
        hits = [(self.buf.find(m), m) for m in markers]
        hits = [(i, m) for i, m in hits if i >= 0]
        if hits:
            i, m = min(hits)
            before = self.buf[:i].rstrip()
            if before:
                out.append((kind, before))
            self.buf = self.buf[i:]
            on_marker(m)
            return True
        if final:
            return False
        part = _partial_suffix(self.buf, markers)  # a marker may be starting: hold it and the blanks before it
        hold = part + _trailing_ws(self.buf[: len(self.buf) - part])
        ready = self.buf[: len(self.buf) - hold]
        if ready:
            out.append((kind, ready))
            self.buf = self.buf[len(ready) :]
        return False

    def _end_reasoning(self, marker: str) -> None:
        self.buf = self.buf[len(marker) :]
        self.mode, self.strip_next = "text", True

    def _open_tool(self, marker: str) -> None:
        self.syntax = next(s for s in self.syntaxes if s.start == marker)
        self.mode = "tool"

    def _close_tool(self, inner: str, raw: str, out: list) -> None:
        try:
            calls = self.syntax.parse(inner, self.tools)
        except Exception:  # malformed: the model's text stays text, never silently dropped
            out.append(("text", raw))
            return
        out.extend(("tool_call", c) for c in calls)


def collect(events: list[tuple]) -> tuple[str, str, list[ToolCall]]:
    """(reasoning, text, tool_calls) from a whole answer's events."""
    reasoning = "".join(p for k, p in events if k == "reasoning")
    text = "".join(p for k, p in events if k == "text")
    calls = [p for k, p in events if k == "tool_call"]
    return reasoning, text, calls
