"""Claude Code reads a file and edits it with its Edit tool, against `mlx-dspark serve` on a scripted model.

    python bench/claude_code_scripted.py [--claude claude] [--workdir DIR]

The server is the product's own (in-process, on 127.0.0.1, a free port); the target is the tests'
tiny random model with SmolLM2's chat template (no tool support: Claude Code's tools go through
the Hermes fallback in the system turn, as on the demo model). Only what the model says is
scripted (tests/serve_support.py Script: the real forward runs, then its logits are replaced),
chosen from the rendered prompt: no tool result yet -> a Read call of notes.txt; the file's text
in a tool result -> an Edit call (teh -> the); the Edit's result -> a closing sentence. Everything
else is real: Claude Code 2.1.x in its default mode (`mlx-dspark claude -- -p ...`), the
Anthropic dialect, streaming, tool schemas rendered, <tool_call> parsed back into tool_use, the
tool_result turn, and Claude Code running its own Read and Edit tools on the file.

Prints each request (prompt tokens, reply, seconds), Claude Code's output and exit status, and
the file before and after. Exit status 0 when the file was edited.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from serve_support import LiveServer, Script  # noqa: E402

SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BEFORE = "# shopping\n- teh bread\n- milk\n"
AFTER = "# shopping\n- the bread\n- milk\n"


def call(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


class Director(Script):
    """Says the next step of the Read -> Edit -> done exchange, chosen from the prompt."""

    def __init__(self, target, tokenizer, path: Path):
        super().__init__(target, tokenizer)
        self.path = str(path)
        self.log: list[dict] = []
        self.tokens = []

    def forward(self, tokens, cache, taps=(), last_only=False):
        if last_only and tokens.shape[-1] == 1:  # the prompt's last token: the whole prompt is known
            prompt = self.tokenizer.decode(self.last_prompt + tokens.reshape(-1).tolist())
            tail = prompt[prompt.rfind("<|im_start|>user") :]
            if "has been updated" in tail or "updated successfully" in tail:
                step, text = "done", "Fixed the typo in notes.txt: teh -> the."
            elif "teh bread" in tail and "<tool_response>" in tail:
                step = "edit"
                text = call("Edit", {"file_path": self.path, "old_string": "teh bread", "new_string": "the bread"})
            else:
                step, text = "read", call("Read", {"file_path": self.path})
            self.say(text)
            self.log.append({"step": step, "prompt_tokens": len(self.last_prompt) + 1, "t": time.perf_counter()})
        return super().forward(tokens, cache, taps=taps, last_only=last_only)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--claude", default="claude")
    ap.add_argument("--workdir", help="folder for notes.txt (default: a fresh temporary one)")
    ap.add_argument("--timeout", type=float, default=1200)
    a = ap.parse_args()

    from fixtures import write_model

    tmp = Path(tempfile.mkdtemp(prefix="cc-scripted-"))
    atexit.register(shutil.rmtree, tmp, True)
    model = write_model(tmp / "tiny-smol", "qwen3")
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = SMOL_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    work = Path(a.workdir) if a.workdir else tmp / "work"
    work.mkdir(parents=True, exist_ok=True)
    notes = work / "notes.txt"
    notes.write_text(BEFORE)
    home = tmp / "home"
    home.mkdir()

    srv = LiveServer(model, mode="baseline", context_window=65536)
    director = Director(srv.target, srv.tokenizer, notes)
    srv.script = director
    print(f"server {srv.url}, model {srv.model} (scripted), work folder {work}")
    env = {**os.environ, "HOME": str(home), "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "1024"}
    cmd = [sys.executable, "-m", "mlx_dspark", "claude", "--url", srv.url, "--claude", a.claude, "--"]
    cmd += ["-p", "Read notes.txt, then fix the typo in it with the Edit tool."]
    cmd += ["--tools", "Read,Edit", "--allowedTools", "Read,Edit", "--max-turns", "6"]
    t0 = time.perf_counter()
    try:
        run = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=a.timeout)
        rc, out, err = run.returncode, run.stdout, run.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", e.stdout or "", e.stderr or ""
    took = time.perf_counter() - t0
    srv.close()
    print(f"command: mlx-dspark claude --url {srv.url} -- {' '.join(cmd[cmd.index('--') + 1 :])}")
    for i, r in enumerate(director.log, 1):
        print(f"request {i}: prompt {r['prompt_tokens']} tokens, model says: {r['step']} ({r['t'] - t0:.1f} s)")
    print(f"Claude Code exit status {rc} after {took:.1f} s; stdout: {out.strip()!r}")
    if err.strip():
        print(f"stderr: {err.strip()[-600:]!r}")
    now = notes.read_text()
    print(f"notes.txt before: {BEFORE!r}\nnotes.txt after:  {now!r}")
    ok = now == AFTER
    print("EDITED" if ok else "NOT EDITED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
