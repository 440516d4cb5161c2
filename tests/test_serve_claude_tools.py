"""Claude Code's Read -> Edit round trip through the server, with its own recorded tool schemas
(tests/claude_code_read_edit.json) and the official `anthropic` SDK, on a scripted model: the
schemas reach the prompt, the model's <tool_call> comes back as tool_use with the arguments
Claude Code's tools need, the tool results are rendered back, and applying the Edit as Claude
Code does changes the file. On SmolLM2's template (no tools: the Hermes fallback) and on the
fixture's Qwen-style one (the template renders the tools itself), streaming and not."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import pytest
from serve_support import LiveServer, make_model, module_timer
from test_serve_clients import KEY, smol_model

_timer = module_timer("Claude Code tools suite")
TOOLS = json.loads((Path(__file__).parent / "claude_code_read_edit.json").read_text())["tools"]
PROMPT = "Read notes.txt, then fix the typo in it with the Edit tool."


def call(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


@pytest.fixture(scope="module", params=["smol", "qwen"])
def srv(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "smol":
        s = LiveServer(smol_model(tmp), api_key=KEY, context_window=16384)
    else:
        s = LiveServer(make_model(tmp), api_key=KEY, context_window=16384)
    yield s
    s.close()


def read_like_claude_code(path: Path) -> str:
    """Claude Code's Read result: numbered lines, a tab after each number."""
    lines = path.read_text().split("\n")
    return "\n".join(f"{i}\t{ln}" for i, ln in enumerate(lines, 1))


def edit_like_claude_code(args: dict) -> str:
    path = Path(args["file_path"])
    text = path.read_text()
    assert text.count(args["old_string"]) == 1, "Claude Code refuses an Edit whose old_string is not unique"
    path.write_text(text.replace(args["old_string"], args["new_string"]))
    return f"The file {path} has been updated successfully."


def prompt_of(s) -> str:
    return s.tokenizer.decode(s.script.last_prompt)


def ask(client, s, messages, stream: bool):
    kw = dict(model=s.model, max_tokens=400, tools=TOOLS, system="You are Claude Code.", messages=messages)
    if not stream:
        return client.messages.create(**kw)
    with client.messages.stream(**kw) as st:
        return st.get_final_message()


@pytest.mark.parametrize("stream", [False, True])
def test_read_then_edit_round_trip(srv, tmp_path, stream):
    client = anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0, timeout=60)
    notes = tmp_path / "notes.txt"
    notes.write_text("# shopping\n- teh bread\n- milk\n")
    messages = [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]

    srv.script.say(call("Read", {"file_path": str(notes)}))
    m = ask(client, srv, messages, stream)
    prompt = prompt_of(srv)
    for t in TOOLS:  # every schema reached the model, descriptions and parameters included
        assert f'"{t["name"]}"' in prompt and t["description"].split("\n")[0] in prompt
    assert '"old_string"' in prompt and '"replace_all"' in prompt
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    read = m.content[0]
    assert read.name == "Read" and read.input == {"file_path": str(notes)} and read.id.startswith("toolu_")

    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": read.id, "content": read_like_claude_code(notes)}],
        },
    ]
    edit_args = {"replace_all": False, "file_path": str(notes), "old_string": "teh bread", "new_string": "the bread"}
    srv.script.say(call("Edit", edit_args))
    m = ask(client, srv, messages, stream)
    assert "2\t- teh bread" in prompt_of(srv)  # the Read result was rendered back to the model
    assert m.stop_reason == "tool_use" and m.content[-1].type == "tool_use"
    edit = m.content[-1]
    assert edit.name == "Edit" and edit.input == edit_args and edit.id != read.id
    result = edit_like_claude_code(edit.input)
    assert notes.read_text() == "# shopping\n- the bread\n- milk\n"

    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": edit.id, "content": result}]},
    ]
    srv.script.say("Fixed the typo: teh -> the.")
    m = ask(client, srv, messages, stream)
    assert "has been updated successfully" in prompt_of(srv)
    assert m.stop_reason == "end_turn" and m.content[0].text == "Fixed the typo: teh -> the."
