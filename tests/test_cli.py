"""The CLI as a user runs it: `--model <dir>`, JSON output, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "mlx_dspark", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def qwen(model_dir):
    return str(model_dir("qwen3", scale=4.0, seed=11))


def test_generate_json_and_flat_form_agree(qwen):
    r = cli(
        "generate", "--model", qwen, "--prompt", "hello world", "--max-new-tokens", "12", "--json", "--mode", "baseline"
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["tokens"]) == 12 and out["mode"] == "baseline" and out["model"] == qwen
    assert set(out["timings"]) >= {"prefill_s", "decode_s", "decode_tps", "e2e_tps"}
    assert all(a == 1 for a in out["accept_lengths"])
    flat = cli("--model", qwen, "--prompt", "hello world", "--max-new-tokens", "12", "--json", "--mode", "lookup")
    assert flat.returncode == 0, flat.stderr
    assert json.loads(flat.stdout)["tokens"] == out["tokens"]


def test_streamed_text_equals_json_text(qwen):
    r = cli("generate", "--model", qwen, "--prompt", "the fox", "--max-new-tokens", "16", "--mode", "baseline")
    j = cli(
        "generate", "--model", qwen, "--prompt", "the fox", "--max-new-tokens", "16", "--json", "--mode", "baseline"
    )
    assert r.returncode == 0 and j.returncode == 0
    assert r.stdout.rstrip("\n") == json.loads(j.stdout)["text"]
    assert "tok/s" in r.stderr


def test_no_chat_template_changes_the_prompt(qwen):
    a = json.loads(cli("generate", "--model", qwen, "--prompt", "hi", "--max-new-tokens", "2", "--json").stdout)
    b = json.loads(
        cli(
            "generate", "--model", qwen, "--prompt", "hi", "--max-new-tokens", "2", "--json", "--no-chat-template"
        ).stdout
    )
    assert a["prompt_tokens"] > b["prompt_tokens"]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "/nonexistent/model", "--prompt", "hi"], "does not exist"),
        (["--model", "{tmp}", "--prompt", "hi"], "not a model folder"),
        (["--model", "{qwen}", "--prompt", ""], "prompt is empty"),
        (["--model", "{qwen}", "--prompt", "   "], "prompt is empty"),
        (["--model", "{qwen}", "--prompt", "hi", "--max-new-tokens", "0"], "at least 1"),
        (["--model", "{qwen}", "--prompt", "hi", "--max-new-tokens", "-4"], "at least 1"),
        (["--model", "{qwen}", "--prompt", "hi", "--mode", "dspark"], "drafter"),
        (["--model", "{qwen}", "--prompt", "hi", "--temperature", "-1"], "temperature"),
    ],
)
def test_bad_input_gets_one_line_and_nonzero_exit(args, needle, qwen, tmp_path):
    args = [a.format(tmp=tmp_path, qwen=qwen) for a in args]
    r = cli("generate", *args)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert needle in lines[0]


def test_doctor_reports_backend_and_fallbacks():
    r = cli("doctor", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["mlx"] and info["device"]
    assert "native" in info and "loaded" in info["native"]


def test_doctor_lists_every_compat_adjustment_and_flags_versions_outside_their_range(monkeypatch):
    from mlx_dspark import compat
    from mlx_dspark.cli import doctor

    r = cli("doctor", "--json")
    assert r.returncode == 0, r.stderr
    listed = json.loads(r.stdout)["shims"]
    assert [s["name"] for s in listed] == [s["name"] for s in compat.shims()]
    assert {s["name"] for s in compat.vlm_shims()} <= {s["name"] for s in listed}
    assert all(s["fits"] for s in listed)  # this environment is the one they were written for
    # A fresh process routes nothing until a target loads; the detokenizer copy is per generation.
    assert {s["name"] for s in listed if s["active"]} == {"private detokenizer per generation"}
    versions = {"mlx": (0, 33, 0), "mlx-lm": (0, 32, 2), "mlx-vlm": None, "transformers": None}
    monkeypatch.setattr(compat, "dist_version", versions.get)
    moved = [s for s in compat.shims() if not s["fits"]]
    assert moved and all("MLX 0.32.x" in s["for"] for s in moved)
    line = doctor._shim_line(moved[0])
    assert "mlx 0.33.0" in line and line.endswith("installed: check it still holds")


def test_python_m_help_lists_subcommands():
    r = cli("--help")
    assert r.returncode == 0
    for name in ("generate", "doctor"):
        assert name in r.stdout
