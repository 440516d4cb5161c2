"""The Responses API as the official `openai` SDK drives it: client.responses.create (streaming and
not), the SDK's own stream accumulator (client.responses.stream), tools, previous_response_id."""

from __future__ import annotations

import json

import openai
import pytest
from serve_support import LiveServer, make_model, module_timer

_timer = module_timer("Responses API SDK suite")

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = LiveServer(make_model(tmp_path_factory.mktemp("r")))
    yield s
    s.close()


@pytest.fixture
def client(srv):
    srv.script.say(None)
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def prompt_text(srv) -> str:
    return srv.tokenizer.decode(srv.script.last_prompt)


def test_create_text(client, srv):
    srv.script.say("Paris is the capital.")
    r = client.responses.create(
        model=srv.model, instructions="Be brief.", input="Capital of France?", max_output_tokens=40
    )
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert r.output_text == "Paris is the capital."
    assert [o.type for o in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens == len(srv.script.last_prompt) and r.usage.output_tokens == len(
        srv.tokenizer.encode("Paris is the capital.", add_special_tokens=False)
    )
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    p = prompt_text(srv)
    assert p.index("Be brief.") < p.index("Capital of France?")
    assert client.responses.retrieve(r.id).output_text == "Paris is the capital."


def test_incomplete_at_max_output_tokens(client, srv):
    srv.script.say("one two three four five six seven")
    r = client.responses.create(model=srv.model, input="count", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_items_input_and_previous_response_id(client, srv):
    srv.script.say("First answer.")
    r1 = client.responses.create(
        model=srv.model,
        input=[
            {"role": "developer", "content": "SYS-RULE"},
            {"role": "user", "content": [{"type": "input_text", "text": "QUESTION-ONE"}]},
        ],
    )
    srv.script.say("Second answer.")
    r2 = client.responses.create(model=srv.model, previous_response_id=r1.id, input="QUESTION-TWO")
    assert r2.output_text == "Second answer." and r2.previous_response_id == r1.id
    p = prompt_text(srv)
    assert p.index("SYS-RULE") < p.index("QUESTION-ONE") < p.index("First answer.") < p.index("QUESTION-TWO")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=srv.model, previous_response_id="resp_nope", input="x")
    r3 = client.responses.create(model=srv.model, input="not kept", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r3.id)


def test_tools_round_trip(client, srv):
    srv.script.say("Checking." + CALL)
    r = client.responses.create(model=srv.model, input="Weather in Paris?", tools=[TOOL], max_output_tokens=60)
    assert [o.type for o in r.output] == ["message", "function_call"]
    call = r.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert '"name": "get_weather"' in prompt_text(srv)  # the template rendered the tool
    srv.script.say("Sunny.")
    r2 = client.responses.create(
        model=srv.model,
        previous_response_id=r.id,
        tools=[TOOL],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "SUNNY-22C"}],
    )
    assert r2.output_text == "Sunny."
    p = prompt_text(srv)
    assert p.index('"city": "Paris"') < p.index("SUNNY-22C")
    # the same conversation sent in full, without previous_response_id
    srv.script.say("Sunny.")
    r3 = client.responses.create(
        model=srv.model,
        tools=[TOOL],
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "SUNNY-22C"},
        ],
    )
    assert r3.output_text == "Sunny." and "SUNNY-22C" in prompt_text(srv)


def test_stream_events(client, srv):
    srv.script.say("<think>hmm</think>Streaming works." + CALL)
    events = list(client.responses.create(model=srv.model, input="hi", tools=[TOOL], stream=True, max_output_tokens=80))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Streaming works."
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "hmm"
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "Paris"}
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Streaming works." and final.usage.output_tokens > 0
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    assert added == [0, 1, 2]


def test_sdk_stream_helper_accumulates(client, srv):
    srv.script.say("Hello from the helper.")
    with client.responses.stream(model=srv.model, input="hi", max_output_tokens=40) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == "Hello from the helper." and final.output_text == "Hello from the helper."


def test_errors(client, srv):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=srv.model, input="x", tools=[{"type": "web_search"}])
    assert "function tools" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=srv.model, input="hello world " * 3000)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "input"
    assert e.value.body["message"].startswith("Your input exceeds the context window of this model.")
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=srv.model, input=[{"type": "input_image", "image_url": "x"}])
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-5", input="x")
