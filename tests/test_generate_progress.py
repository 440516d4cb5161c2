"""`mlx-dspark generate` shows a long prefill's progress on stderr (cli/generate.py PrefillProgress)."""

from __future__ import annotations

import io

from mlx_dspark.cli import generate as gen_cli
from mlx_dspark.cli.main import main
from mlx_dspark.decode import loop


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_silent_for_a_short_prefill_then_one_line_per_chunk():
    clock, out = Clock(), io.StringIO()
    p = gen_cli.PrefillProgress(out, clock=clock)
    clock.t += 1.0
    p(2048, 8192)
    assert out.getvalue() == ""  # under AFTER_S: nothing
    clock.t += 3.0
    p(4096, 8192)
    clock.t += 4.0
    p(8191, 8192)
    lines = out.getvalue().splitlines()
    assert lines == [
        "prefill 4096/8192 tokens (50%), 1024 tok/s, 4 s, about 4 s left",
        "prefill 8191/8192 tokens (99%), 1024 tok/s, 8 s",
    ]


def test_on_a_terminal_the_line_is_rewritten_and_ended_when_the_prefill_is():
    clock, out = Clock(), Tty()
    p = gen_cli.PrefillProgress(out, clock=clock)
    clock.t += 5.0
    p(1000, 3001)
    assert out.getvalue().startswith("\r\x1b[Kprefill 1000/3001 tokens (33%)") and not out.getvalue().endswith("\n")
    clock.t += 5.0
    p(3000, 3001)
    assert out.getvalue().endswith("prefill 3000/3001 tokens (99%), 300 tok/s, 10 s\n")
    p.close()  # already ended: no second newline
    assert not out.getvalue().endswith("\n\n")


def test_generate_prints_progress_for_a_long_prompt(model_dir, monkeypatch, capsys):
    monkeypatch.setattr(loop, "PREFILL_CHUNK", 64)
    monkeypatch.setattr(gen_cli.PrefillProgress, "AFTER_S", 0.0)
    prompt = " ".join(["the fox jumps"] * 80)
    rc = main(
        ["generate", "--model", str(model_dir("qwen3", scale=4.0, seed=11)), "--prompt", prompt]
        + ["--max-new-tokens", "3", "--mode", "baseline", "--no-chat-template"]
    )
    assert rc == 0
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("prefill ")]
    assert len(lines) >= 3 and lines[0].startswith("prefill 64/")
    total = int(lines[0].split("/")[1].split()[0])
    assert lines[-1].startswith(f"prefill {total - 1}/{total} tokens")
