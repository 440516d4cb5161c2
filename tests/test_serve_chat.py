"""The output parser (reasoning, text, tool calls in each syntax) and message rendering."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_dspark.serve.chat import OutputParser, ToolCall, collect, render, starts_in_reasoning
from mlx_dspark.serve.validate import ApiError

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    }
]


def parse(text, *, tools=TOOLS, in_reasoning=False, chunks=None):
    p = OutputParser(in_reasoning=in_reasoning, tools=tools)
    events = []
    for c in chunks if chunks is not None else [text]:
        events += p.feed(c)
    events += p.finish()
    return collect(events)


def test_plain_text_passes_through():
    assert parse("Hello, world!") == ("", "Hello, world!", [])
    text = "leading space is dropped, trailing kept \n"
    assert parse("  " + text) == ("", text, [])


def test_think_block_becomes_reasoning():
    r, t, c = parse("<think>\nstep one\nstep two\n</think>\n\nThe answer is 4.")
    assert r == "step one\nstep two" and t == "The answer is 4." and c == []


def test_template_opened_think_block():
    # The prompt ended with <think>: the output starts inside the reasoning.
    r, t, _ = parse("pondering</think>Done.", in_reasoning=True)
    assert (r, t) == ("pondering", "Done.")
    assert starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_truncated_reasoning_stays_reasoning():
    r, t, _ = parse("<think>never finished", tools=None)
    assert (r, t) == ("never finished", "")


def test_gemma_channel_reasoning():
    r, t, _ = parse("<|channel>thought\nhmm<channel|>Yes.")
    assert (r, t) == ("hmm", "Yes.")


def test_hermes_json_tool_calls():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>'
    )
    r, t, calls = parse(text)
    assert t == "Let me check."
    assert calls == [ToolCall("get_weather", {"city": "Paris"}), ToolCall("get_weather", {"city": "Oslo"})]


def test_xml_function_tool_call_with_schema_types():
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    assert parse(text)[2] == [ToolCall("get_weather", {"city": "San Francisco", "days": 3})]
    bare = "<function=get_weather><parameter=city>Rome</parameter></function>"
    assert parse(bare)[2] == [ToolCall("get_weather", {"city": "Rome"})]


def test_gemma_tool_call():
    text = '<|tool_call>call:get_weather{city:<|"|>Paris, France<|"|>,days:2}<tool_call|>'
    assert parse(text)[2] == [ToolCall("get_weather", {"city": "Paris, France", "days": 2})]


def test_malformed_tool_call_stays_text():
    text = "<tool_call>{not json}</tool_call>"
    r, t, calls = parse(text)
    assert calls == [] and t == text


def test_no_tools_means_no_parsing():
    text = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    assert parse(text, tools=None) == ("", text, [])


def test_unterminated_tool_call_is_parsed_at_finish():
    r, t, calls = parse('<tool_call>{"name": "get_weather", "arguments": {"city": "Lima"}}')
    assert calls == [ToolCall("get_weather", {"city": "Lima"})] and t == ""


SAMPLES = [
    "<think>a\nb</think>\n\nAnswer <b>bold</b> text.",
    'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> trailing',
    '<think>x</think><|tool_call>call:get_weather{city:<|"|>Oslo<|"|>}<tool_call|>',
    "text with < and <t and <tool but no call, and a </think> that is just text",
    "<function=get_weather><parameter=city>Rome</parameter></function>",
]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(SAMPLES), st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=80))
def test_streaming_split_gives_the_same_answer(text, cuts):
    """However the text is cut into chunks, the events add up to the one-shot parse."""
    chunks, i = [], 0
    for c in cuts:
        if i >= len(text):
            break
        chunks.append(text[i : i + c])
        i += c
    if i < len(text):
        chunks.append(text[i:])
    assert parse(text, chunks=chunks) == parse(text)


def test_render_errors_are_client_errors():
    class Broken:
        has_chat_template = True

        def apply_chat_template(self, *a, **k):
            raise TypeError("roles must alternate")

    with pytest.raises(ApiError) as e:
        render(Broken(), [{"role": "user", "content": "x"}])
    assert e.value.status == 400 and "roles must alternate" in e.value.message


def test_tool_call_arguments_json_round_trip():
    c = ToolCall("f", {"a": [1, 2], "b": "ü"})
    assert json.loads(c.arguments_json()) == {"a": [1, 2], "b": "ü"}


def test_tool_fallback_keeps_every_schema_compactly():
    """The Hermes fallback (templates without tools): one line of whitespace-free JSON per tool,
    each equal to the tool it came from, so nothing is dropped and the prompt is shorter."""
    from mlx_dspark.serve.chat import FALLBACK_TOOLS_FOOTER, FALLBACK_TOOLS_HEADER, tools_as_text

    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": "Does ü things.",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string", "description": "a file"}, "n": {"type": "integer"}},
                    "required": ["path"],
                    "additionalProperties": False,
                },
            },
        }
        for i in range(3)
    ]
    out = tools_as_text([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], tools)
    system = out[0]["content"]
    assert system.startswith("Be brief.\n\n" + FALLBACK_TOOLS_HEADER) and system.endswith(FALLBACK_TOOLS_FOOTER)
    lines = system[len("Be brief.\n\n" + FALLBACK_TOOLS_HEADER) : -len(FALLBACK_TOOLS_FOOTER)].split("\n")
    assert [json.loads(line) for line in lines] == tools
    assert all(", " not in line and '": ' not in line for line in lines) and "ü" in lines[0]
    assert out[1] == {"role": "user", "content": "hi"}
