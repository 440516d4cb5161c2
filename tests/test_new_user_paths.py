"""What a new user meets first: mode resolution, silent fallbacks made loud, bad files, small
things on the command line. Each test here failed on the build that shipped before it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from drafter_fixtures import target, workspace, write_deepspec
from fixtures import write_model

from mlx_dspark.api import encode_prompt, generate
from mlx_dspark.errors import UserError
from mlx_dspark.models.demo import find_demo_gguf
from mlx_dspark.models.drafters import load_drafter
from mlx_dspark.models.loading import load_target

DEMO = find_demo_gguf()
needs_demo = pytest.mark.skipif(
    DEMO is None, reason="the demo GGUF is not here: run `python -m mlx_dspark.models.demo fetch` (CI does)"
)


def _cli(*args, timeout=300, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlx_dspark", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


# Which drafter auto pairs with a target is what these tests check; whether that drafter pays is the
# calibration's verdict on this machine, at its load of the moment (tests/test_policy.py has that on
# given curves), so it is turned off here: auto then runs the paired drafter.
NO_CALIBRATION = {"MLX_DSPARK_CALIBRATION": "off"}


# ------------------------------------------------------------------ mode resolution
@pytest.fixture(scope="module")
def demo_folder(tmp_path_factory):
    """The demo GGUF converted with `mlx-dspark convert` into a folder of the user's choosing."""
    out = tmp_path_factory.mktemp("converted") / "my-model"
    r = _cli("convert", str(DEMO[0]), "--out", str(out), "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    return out


@needs_demo
def test_python_auto_resolves_the_registry_like_the_cli(demo_folder, monkeypatch):
    for k, v in NO_CALIBRATION.items():
        monkeypatch.setenv(k, v)
    t, tok = load_target(str(demo_folder))
    auto = generate(t, tok, "Why is the sky blue?", max_new_tokens=12)
    assert auto.mode == "dspark"  # the registered drafter, as the CLI's auto picks it
    spark = generate(t, tok, "Why is the sky blue?", mode="dspark", max_new_tokens=12)
    base = generate(t, tok, "Why is the sky blue?", mode="baseline", max_new_tokens=12)
    assert spark.mode == "dspark" and spark.tokens == auto.tokens == base.tokens
    assert spark.text == auto.text == base.text


@needs_demo
def test_a_converted_folder_keeps_its_pairing(demo_folder):
    env = {**os.environ, **NO_CALIBRATION}
    r = _cli("generate", "--model", str(demo_folder), "--prompt", "Say hi.", "--max-new-tokens", "8", "--json", env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["mode"] == "dspark" and "dspark-smollm2-135m-instruct" in out["drafter"]


def test_python_errors_name_keywords_not_flags():
    t, tok = target(workspace()["target_qwen3"])
    with pytest.raises(UserError) as e:
        generate(t, tok, "hi", mode="dspark", max_new_tokens=4)
    msg = str(e.value)
    assert "no dspark drafter is registered" in msg and "drafter=" in msg and "--" not in msg
    with pytest.raises(UserError, match="max_draft=") as e:
        generate(t, tok, "hi", mode="lookup", max_draft=-1, max_new_tokens=4)
    assert "--" not in str(e.value)
    with pytest.raises(UserError, match="draft_vocab=") as e:
        generate(t, tok, "hi", mode="auto", draft_vocab="foo", max_new_tokens=4)


def test_python_drafter_may_be_a_folder():
    ws = workspace()
    t, tok = target(ws["target_perm"])
    res = generate(
        t,
        tok,
        "a b",
        mode="dspark",
        drafter=str(ws["perm_dspark"]),
        drafter_bits=16,
        max_new_tokens=16,
        lookup_drafts=False,
    )
    base = generate(t, tok, "a b", mode="baseline", max_new_tokens=16)
    assert res.mode == "dspark" and res.tokens == base.tokens and res.text == base.text
    assert max(res.accept_lengths) > 1


# ------------------------------------------------------------- speculation switching off
@pytest.mark.parametrize("mode", ["lookup", "dspark"])
def test_an_untrimmable_cache_is_said_once_and_reported(mode, monkeypatch, capsys):
    """A cache that cannot be rolled back: plain decoding, said once, reported as baseline."""
    from mlx_dspark.decode import loop

    ws = workspace()
    t, tok = target(ws["target_perm"])
    d = load_drafter(str(ws["perm_dspark"]), t, bits=16) if mode == "dspark" else None
    base = generate(t, tok, "a b c a b c", mode="baseline", max_new_tokens=24)
    monkeypatch.setattr(t, "can_trim", lambda cache, n: n == 0)
    monkeypatch.setattr(loop, "_warned", set())
    taps = []
    orig = t.forward

    def spy(tokens, cache, taps_asked=(), last_only=False, **kw):
        taps.append(tuple(kw.get("taps", taps_asked)))
        return orig(tokens, cache, taps=kw.get("taps", taps_asked), last_only=last_only)

    monkeypatch.setattr(t, "forward", spy)
    for _ in range(2):
        res = generate(t, tok, "a b c a b c", mode=mode, drafter=d, max_new_tokens=24)
        assert res.tokens == base.tokens and res.text == base.text
        assert res.mode == "baseline" and "cannot be rolled back" in res.stats["speculation_off"]
        assert res.accept_lengths == base.accept_lengths
    assert not any(taps)  # no hidden states are tapped for a drafter that will never draft
    assert capsys.readouterr().err.count("cannot be rolled back") == 1


def test_a_cache_that_stops_trimming_midway_keeps_the_mode_and_says_when(monkeypatch):
    ws = workspace()
    t, tok = target(ws["target_perm"])
    d = load_drafter(str(ws["perm_dspark"]), t, bits=16)
    ids = encode_prompt(tok, "x y")
    base = generate(t, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=40)
    limit = len(ids) + 16
    monkeypatch.setattr(t, "can_trim", lambda cache, n: n == 0 or t.cache_len(cache) + n <= limit)
    res = generate(t, tok, None, prompt_ids=ids, mode="dspark", drafter=d, max_new_tokens=40, lookup_drafts=False)
    assert res.tokens == base.tokens and res.text == base.text
    assert res.mode == "dspark" and 0 < res.stats["speculation_off_at_token"] < 40
    assert max(res.accept_lengths) > 1


# ------------------------------------------------------------------------ bad files
def _truncate(f: Path, keep: int) -> None:
    data = f.read_bytes()
    f.write_bytes(data[: keep if keep >= 0 else len(data) + keep])


@pytest.mark.parametrize("keep", [5, 100, -1000])
def test_a_truncated_target_is_one_line(tmp_path, keep):
    m = write_model(tmp_path / "m", "qwen3")
    _truncate(m / "model.safetensors", keep)
    with pytest.raises(UserError, match="model.safetensors is truncated or corrupt .*download it again"):
        load_target(str(m))
    r = _cli("generate", "--model", str(m), "--prompt", "hi", "--mode", "baseline")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and "truncated or corrupt" in r.stderr


def test_a_truncated_drafter_is_one_line(tmp_path):
    ws = workspace()
    d = write_deepspec(tmp_path / "d", ws["target_qwen3"])
    _truncate(d / "model.safetensors", -64)
    with pytest.raises(UserError, match="truncated or corrupt"):
        load_drafter(str(d), target(ws["target_qwen3"])[0], bits=16)
    r = _cli(
        "generate",
        "--model",
        str(ws["target_qwen3"]),
        "--drafter",
        str(d),
        "--mode",
        "dspark",
        "--prompt",
        "hi",
        "--max-new-tokens",
        "4",
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and "truncated or corrupt" in r.stderr


@pytest.mark.parametrize(
    "field,value", [("hidden_size", 128), ("intermediate_size", 7), ("num_attention_heads", 3), ("head_dim", 8)]
)
def test_a_config_that_contradicts_its_tensors_is_refused(tmp_path, field, value):
    ws = workspace()
    d = write_deepspec(tmp_path / "d", ws["target_qwen3"], config_overrides={field: value})
    with pytest.raises(UserError, match=f"config says {field}={value} but its tensors give"):
        load_drafter(str(d), target(ws["target_qwen3"])[0], bits=16)


# ---------------------------------------------------------------- small things users see
def test_models_table_fits_100_columns_and_names_the_demo_drafter():
    r = _cli("models")
    assert r.returncode == 0, r.stderr
    assert max(len(line) for line in r.stdout.splitlines()) <= 100
    assert "no drafter registered" not in r.stdout
    demo = [line for line in r.stdout.split("demo model")[-1:]][0]
    assert "dspark" in demo


def test_logprobs_without_json_are_printed():
    ws = workspace()
    r = _cli(
        "generate",
        "--model",
        str(ws["target_qwen3"]),
        "--mode",
        "baseline",
        "--prompt",
        "hi",
        "--max-new-tokens",
        "5",
        "--logprobs",
        "2",
    )
    assert r.returncode == 0, r.stderr
    table = r.stderr.split("logprobs (token, logprob, top alternatives):\n")[1].splitlines()
    rows = [line for line in table if "\t" in line]
    assert len(rows) == 5 and all(len(row.split("\t")) == 3 for row in rows)


def test_stats_after_a_stop_string_count_only_kept_tokens():
    ws = workspace()
    t, tok = target(ws["target_perm"])
    d = load_drafter(str(ws["perm_dspark"]), t, bits=16)
    free = generate(t, tok, "a b", mode="dspark", drafter=d, max_new_tokens=30, lookup_drafts=False)
    stop = tok.decode(free.tokens[3:5])
    res = generate(t, tok, "a b", mode="dspark", drafter=d, max_new_tokens=30, stop=[stop], lookup_drafts=False)
    assert res.stop_string == stop and len(res.tokens) < len(free.tokens)
    assert sum(res.accept_lengths) == len(res.tokens) - 1  # the first token is prefill's
    assert res.mean_accept_len <= len(res.tokens)
