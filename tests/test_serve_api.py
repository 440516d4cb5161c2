"""The server driven by the unmodified `openai` and `anthropic` SDKs, on a fixture model on loopback."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from serve_support import LiveServer, make_model, module_timer

_timer = module_timer("openai + anthropic SDK suite")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
WEATHER_A = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": WEATHER["function"]["parameters"],
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = LiveServer(make_model(tmp_path_factory.mktemp("m")))
    yield s
    s.close()


@pytest.fixture
def oai(srv):
    srv.script.say(None)
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture
def ant(srv):
    srv.script.say(None)
    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=30)


def prompt_text(srv) -> str:
    """What the model was last prefilled with (the fixture prompts fit one prefill chunk)."""
    return srv.tokenizer.decode(srv.script.last_prompt)


def n_tokens(srv, text: str) -> int:
    return len(srv.tokenizer.encode(text, add_special_tokens=False))


# ----------------------------------------------------------------------------- OpenAI
def test_models(oai, srv):
    models = oai.models.list()
    assert [m.id for m in models.data] == [srv.model]
    assert oai.models.retrieve(srv.model).id == srv.model
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")


def test_chat_real_model_output(oai, srv):
    # The random model's own greedy output: gibberish, but exactly max_tokens tokens of it.
    r = oai.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "Hello"}], max_tokens=7)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens == (7 if r.choices[0].finish_reason == "length" else r.usage.completion_tokens)
    assert r.usage.prompt_tokens == len(srv.script.last_prompt)
    x = r.model_extra["x_mlx_dspark"]
    assert x["mode"] == "lookup" and x["mean_accept_len"] >= 1.0 and x["tokens_per_sec"] > 0


def test_chat_multi_turn_and_usage(oai, srv):
    srv.script.say("Paris is the capital of France.")
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "Say it in a sentence."},
    ]
    r = oai.chat.completions.create(model=srv.model, messages=msgs, max_tokens=50)
    m = r.choices[0].message
    assert m.content == "Paris is the capital of France." and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == n_tokens(srv, "Paris is the capital of France.")
    assert r.usage.prompt_tokens == len(srv.script.last_prompt)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    p = prompt_text(srv)
    assert "Be brief." in p and "Capital of France?" in p and "Paris." in p and p.rstrip().endswith("assistant")


def test_chat_streaming(oai, srv):
    srv.script.say("Streaming works fine.")
    chunks = list(
        oai.chat.completions.create(
            model=srv.model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Streaming works fine."
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "stop"
    assert "x_mlx_dspark" in finals[0].model_extra
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n_tokens(srv, text)


def test_chat_length_and_stop(oai, srv):
    srv.script.say("one two three four five six seven eight")
    r = oai.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "count"}], max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    r = oai.chat.completions.create(
        model=srv.model, messages=[{"role": "user", "content": "count"}], max_tokens=30, stop=[" four"]
    )
    assert r.choices[0].message.content == "one two three" and r.choices[0].finish_reason == "stop"


def test_completion(oai, srv):
    srv.script.say(" world, and more")
    r = oai.completions.create(model=srv.model, prompt="Hello", max_tokens=20, logprobs=2)
    assert r.choices[0].text == " world, and more"
    assert r.usage.prompt_tokens == len(srv.tokenizer.encode("Hello"))
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == " world, and more" and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) == 2 for t in lp.top_logprobs)
    text = "".join(
        c.choices[0].text
        for c in oai.completions.create(model=srv.model, prompt="Hello", max_tokens=20, stream=True)
        if c.choices
    )
    assert text == " world, and more"


def test_chat_logprobs(oai, srv):
    srv.script.say("Yes.")
    r = oai.chat.completions.create(
        model=srv.model, messages=[{"role": "user", "content": "ok?"}], max_tokens=5, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == "Yes."
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob for c in content)


def test_tool_round_trip_openai(oai, srv):
    srv.script.say("<think>The user wants weather.</think>\n\n" + CALL)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = oai.chat.completions.create(model=srv.model, messages=msgs, tools=[WEATHER], max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == "The user wants weather."
    assert not choice.message.content
    (tc,) = choice.message.tool_calls
    assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {"city": "Paris"}
    assert r.usage.completion_tokens_details.reasoning_tokens > 0
    assert '"name": "get_weather"' in prompt_text(srv)  # the tools went through the template

    srv.script.say("It is sunny in Paris.")
    msgs += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": tc.id, "content": "sunny, 21C"},
    ]
    r2 = oai.chat.completions.create(model=srv.model, messages=msgs, tools=[WEATHER], max_tokens=40)
    assert r2.choices[0].message.content == "It is sunny in Paris."
    p = prompt_text(srv)
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in p
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in p


def test_tool_call_streaming_openai(oai, srv):
    srv.script.say("Checking." + CALL)
    chunks = list(
        oai.chat.completions.create(
            model=srv.model,
            messages=[{"role": "user", "content": "Paris?"}],
            tools=[WEATHER],
            max_tokens=80,
            stream=True,
        )
    )
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather" and calls[0].index == 0
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Checking."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_xml_tool_syntax_through_the_server(oai, srv):
    srv.script.say(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n</function>\n</tool_call>"
    )
    r = oai.chat.completions.create(
        model=srv.model, messages=[{"role": "user", "content": "Lima?"}], tools=[WEATHER], max_tokens=80
    )
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Lima"}


def test_thinking_toggle_per_request(oai, srv):
    srv.script.say("Plain answer.")
    r = oai.chat.completions.create(
        model=srv.model,
        messages=[{"role": "user", "content": "q"}],
        max_tokens=20,
        extra_body={"enable_thinking": False},
    )
    assert prompt_text(srv).rstrip().endswith("</think>") and r.choices[0].message.content == "Plain answer."
    oai.chat.completions.create(
        model=srv.model,
        messages=[{"role": "user", "content": "q"}],
        max_tokens=20,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    assert not prompt_text(srv).rstrip().endswith("</think>")


def test_unknown_params_are_reported(oai, srv):
    srv.script.say("ok")
    r = oai.chat.completions.create(
        model=srv.model,
        messages=[{"role": "user", "content": "q"}],
        max_tokens=5,
        user="someone",
        extra_body={"frobnicate": 1},
    )
    assert r.model_extra["x_mlx_dspark"]["ignored_params"] == ["frobnicate", "user"]


def test_sampling_request(oai, srv):
    """T > 0 works once the sampling decoder exists; until then it is a clear 400, not a crash."""
    from mlx_dspark.serve.engine import sampled_decoding_available

    srv.script.say(None)
    kw = dict(
        model=srv.model,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=8,
        temperature=0.8,
        top_p=0.9,
        seed=7,
    )
    if not sampled_decoding_available():
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(**kw)
        assert "temperature" in e.value.body["message"]
        return
    a = oai.chat.completions.create(**kw)
    b = oai.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content  # same seed, same sample
    assert a.usage.completion_tokens >= 1
    streamed = "".join(
        c.choices[0].delta.content or "" for c in oai.chat.completions.create(**kw, stream=True) if c.choices
    )
    assert streamed == a.choices[0].message.content
    pen = oai.chat.completions.create(**{**kw, "temperature": 0}, presence_penalty=1.0, frequency_penalty=0.5)
    assert pen.usage.completion_tokens >= 1


def test_concurrent_requests_are_isolated(srv):
    """Requests from several clients at once each get what they would get alone (greedy, real model)."""
    import concurrent.futures

    srv.script.say(None)
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
    prompts = ["Hello", "The quick brown fox", "def add(a, b):", "1 2 3 4"]

    def ask(p, stream=False):
        kw = dict(model=srv.model, messages=[{"role": "user", "content": p}], max_tokens=12)
        if not stream:
            return c.chat.completions.create(**kw).choices[0].message.content
        return "".join(
            ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**kw, stream=True) if ch.choices
        )

    alone = {p: ask(p) for p in prompts}
    jobs = [(p, i % 2 == 1) for i, p in enumerate(prompts * 3)]
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        got = list(ex.map(lambda j: ask(*j), jobs))
    assert got == [alone[p] for p, _ in jobs]


# ----------------------------------------------------------------------------- Anthropic
def test_messages(ant, srv):
    srv.script.say("Bonjour!")
    m = ant.messages.create(
        model=srv.model, max_tokens=20, system="You are French.", messages=[{"role": "user", "content": "Hi"}]
    )
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "Bonjour!"
    assert m.stop_reason == "end_turn" and m.usage.output_tokens == n_tokens(srv, "Bonjour!")
    assert m.usage.input_tokens == len(srv.script.last_prompt)
    assert "You are French." in prompt_text(srv)
    assert m.model_extra["x_mlx_dspark"]["mode"] == "lookup"


def test_messages_streaming_event_sequence(ant, srv):
    srv.script.say("<think>hmm</think>Streamed text.")
    with ant.messages.stream(
        model=srv.model,
        max_tokens=40,
        messages=[{"role": "user", "content": "Hi"}],
        thinking={"type": "enabled", "budget_tokens": 1024},
    ) as s:
        kinds = [
            e.type
            for e in s
            if e.type in ("message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop")
        ]
        final = s.get_final_message()
    assert kinds == [
        "message_start",
        "content_block_start",
        "content_block_stop",
        "content_block_start",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "hmm" and final.content[1].text == "Streamed text."
    assert final.usage.output_tokens == n_tokens(srv, "<think>hmm</think>Streamed text.")


def test_raw_anthropic_stream_has_ping_and_named_events(srv):
    import http.client

    srv.script.say("Hi.")
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    c.request(
        "POST",
        "/v1/messages?beta=true",
        json.dumps(
            {"model": srv.model, "max_tokens": 10, "stream": True, "messages": [{"role": "user", "content": "x"}]}
        ),
        {"Content-Type": "application/json"},
    )
    r = c.getresponse()
    body = r.read().decode()
    events = [line[7:] for line in body.splitlines() if line.startswith("event: ")]
    assert (
        events
        == [
            "message_start",
            "ping",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ][:3]
        + events[3:]
    )
    assert events[-2:] == ["message_delta", "message_stop"] and "content_block_delta" in events
    assert r.getheader("Content-Type").startswith("text/event-stream")


def test_thinking_disabled_drops_blocks(ant, srv):
    srv.script.say("<think>secret</think>Visible.")
    m = ant.messages.create(
        model=srv.model, max_tokens=30, thinking={"type": "disabled"}, messages=[{"role": "user", "content": "Hi"}]
    )
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "Visible."
    assert prompt_text(srv).rstrip().endswith("</think>")  # the template was asked for no thinking


def test_stop_sequences_and_exact_counts(ant, srv):
    # A repeating script lets lookup draft many tokens per round, past the stop string; the
    # reported count must still be the tokens up to the stop string, as in one-token decoding.
    stop = ("alpha beta gamma delta " * 3).strip()
    srv.script.say("Intro: " + "alpha beta gamma delta " * 8, eos=False)
    m = ant.messages.create(
        model=srv.model,
        max_tokens=200,
        stop_sequences=["never there", stop],
        messages=[{"role": "user", "content": "go"}],
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == "Intro: "
    ids = srv.script.tokens
    need = next(i for i in range(1, len(ids) + 1) if stop in srv.tokenizer.decode(ids[:i]))
    assert m.usage.output_tokens == need
    res = srv.engine.finished[-1].outcome.result
    assert len(res.tokens) == need
    # Lookup drafted (its rounds committed past the stop string), yet the reported rounds count
    # only the tokens kept: the first comes from prefill, the rest from rounds.
    assert res.stats.get("lookup_accepted", 0) > 0
    assert sum(res.accept_lengths) == need - 1


def test_max_tokens_stop_reason(ant, srv):
    srv.script.say("a b c d e f g h i j k")
    m = ant.messages.create(model=srv.model, max_tokens=4, messages=[{"role": "user", "content": "go"}])
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 4


def test_count_tokens(ant, srv):
    msgs = [{"role": "user", "content": "How many tokens is this?"}]
    n = ant.messages.count_tokens(model=srv.model, messages=msgs, system="sys", tools=[WEATHER_A]).input_tokens
    srv.script.say("ok")
    m = ant.messages.create(model=srv.model, max_tokens=5, messages=msgs, system="sys", tools=[WEATHER_A])
    assert n == m.usage.input_tokens == len(srv.script.last_prompt)


def test_tool_round_trip_anthropic(ant, srv):
    srv.script.say("Let me look." + CALL)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    m = ant.messages.create(model=srv.model, max_tokens=80, tools=[WEATHER_A], messages=msgs)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["text", "tool_use"]
    use = m.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id.startswith("toolu_")

    srv.script.say("Sunny.")
    msgs += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21C"},
                {"type": "text", "text": "Thanks!"},
            ],
        },
    ]
    m2 = ant.messages.create(model=srv.model, max_tokens=20, tools=[WEATHER_A], messages=msgs)
    assert m2.content[0].text == "Sunny." and m2.stop_reason == "end_turn"
    p = prompt_text(srv)
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in p and "Thanks!" in p
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in p


def test_tool_use_streaming_anthropic(ant, srv):
    srv.script.say(CALL)
    with ant.messages.stream(
        model=srv.model, max_tokens=80, tools=[WEATHER_A], messages=[{"role": "user", "content": "Paris?"}]
    ) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].type == "tool_use"
    assert final.content[0].input == {"city": "Paris"}


def test_assistant_prefill_is_continued(ant, srv):
    srv.script.say(" continued.")
    m = ant.messages.create(
        model=srv.model,
        max_tokens=20,
        messages=[{"role": "user", "content": "Say something"}, {"role": "assistant", "content": "I have"}],
    )
    assert m.content[0].text == " continued."  # the continuation, as is
    assert prompt_text(srv).rstrip().endswith("I have")


# ----------------------------------------------------------------------------- auth
@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    s = LiveServer(make_model(tmp_path_factory.mktemp("k")), api_key="s3cret-key")
    yield s
    s.close()


def test_auth_accepted_and_refused(keyed):
    keyed.script.say("ok")
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key="s3cret-key", max_retries=0)
    assert (
        good.chat.completions.create(model=keyed.model, messages=[{"role": "user", "content": "x"}], max_tokens=3)
        .choices[0]
        .message.content
        == "ok"
    )
    assert good.models.list().data[0].id == keyed.model
    bad = openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.body["code"] == "invalid_api_key"

    a_good = anthropic.Anthropic(base_url=keyed.url, api_key="s3cret-key", max_retries=0)  # sends x-api-key
    assert (
        a_good.messages.create(model=keyed.model, max_tokens=3, messages=[{"role": "user", "content": "x"}])
        .content[0]
        .text
        == "ok"
    )
    a_tok = anthropic.Anthropic(base_url=keyed.url, auth_token="s3cret-key", max_retries=0)  # sends Bearer
    assert a_tok.messages.count_tokens(model=keyed.model, messages=[{"role": "user", "content": "x"}]).input_tokens > 0
    a_bad = anthropic.Anthropic(base_url=keyed.url, api_key="s3cret-kez", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        a_bad.messages.create(model=keyed.model, max_tokens=3, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "authentication_error"


def test_every_route_needs_the_key(keyed):
    import http.client

    for method, path in [
        ("GET", "/health"),
        ("GET", "/metrics"),
        ("GET", "/v1/models"),
        ("GET", "/"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/messages"),
    ]:
        c = http.client.HTTPConnection("127.0.0.1", keyed.port, timeout=5)
        c.request(method, path, body=b"{}" if method == "POST" else None, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        assert r.status == 401, (method, path)
        c.close()
