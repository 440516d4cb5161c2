"""Context extension by RoPE scaling (models/rope.py): the block planned from the served window,
applied to the checkpoint as mlx-lm would read it from its own config, refused where a family does
not take it, identical output in every decoding mode on the scaled target, and what `serve` says."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from fixtures import write_model

from mlx_dspark.api import generate
from mlx_dspark.errors import UserError
from mlx_dspark.models import rope
from mlx_dspark.models.loading import load_target

ROOT = Path(__file__).resolve().parents[1]
TRAINED = 64  # the fixtures' trained window here: prompts below run far past it
PROMPT = "Tell me a long story about a dragon and a tiny robot who wander the hills. " * 6


def short_trained(path: Path, trained: int = TRAINED) -> Path:
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = trained
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("rope")
    llama = short_trained(write_model(base / "llama", "llama", seed=11))
    qwen3 = short_trained(write_model(base / "qwen3", "qwen3", seed=5, scale=3.0))  # varied greedy text
    return {"base": base, "llama": llama, "qwen3": qwen3}


def test_plan():
    cfg = {"max_position_embeddings": 8192}
    yarn = {"rope_type": "yarn", "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
    assert rope.plan(cfg, 32768, "yarn") == yarn
    assert rope.plan(cfg, 32768, "auto") == yarn
    assert rope.plan(cfg, 20480, "linear") == {"rope_type": "linear", "type": "linear", "factor": 2.5}
    for window, kind in ((32768, "none"), (8192, "yarn"), (4096, "auto"), (None, "yarn")):
        assert rope.plan(cfg, window, kind) is None
    assert rope.plan({}, 32768, "yarn") is None  # no trained window known: nothing to scale from
    nested = {"text_config": dict(cfg)}
    assert rope.plan(nested, 16384, "yarn")["factor"] == 2.0
    assert rope.model_config(nested, yarn) == {"text_config": {"max_position_embeddings": 8192, "rope_scaling": yarn}}
    own = {"max_position_embeddings": 8192, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    assert rope.plan(own, 32768, "auto") is None  # the model's own scaling stays as it is
    with pytest.raises(UserError, match="already scales its RoPE"):
        rope.plan(own, 32768, "yarn")
    assert rope.plan({**own, "rope_scaling": {"type": "default"}}, 32768, "yarn")["factor"] == 4.0
    with pytest.raises(UserError, match="must be one of"):
        rope.plan(cfg, 32768, "ntk")


def _logits(target, ids):
    out = target.forward(mx.array([ids], dtype=mx.int32), target.make_cache())
    return np.array(out.logits[0].astype(mx.float32))


@pytest.mark.parametrize("kind", ["yarn", "linear"])
def test_scaled_load_equals_a_checkpoint_that_ships_the_block(models, tmp_path, kind):
    """The override gives exactly the model mlx-lm builds from a config.json that has the same
    rope_scaling, and it changes the arithmetic (the scaling is really in effect)."""
    src = models["llama"]
    target, tok = load_target(str(src), context_window=4 * TRAINED, rope_scaling=kind)
    block = target.rope_scaling
    assert block["rope_type"] == kind and block["factor"] == 4.0
    assert target.max_context == TRAINED  # the trained window stays what the checkpoint says
    assert target.config["rope_scaling"] == block
    shipped = tmp_path / "shipped"
    shutil.copytree(src, shipped)
    cfg = json.loads((shipped / "config.json").read_text())
    cfg["rope_scaling"] = block
    (shipped / "config.json").write_text(json.dumps(cfg))
    ref, _ = load_target(str(shipped))
    plain, _ = load_target(str(src), context_window=4 * TRAINED, rope_scaling="none")
    assert plain.rope_scaling is None
    ids = tok.encode(PROMPT)[:160]
    assert len(ids) > 2 * TRAINED
    got = _logits(target, ids)
    np.testing.assert_array_equal(got, _logits(ref, ids))
    assert np.abs(got - _logits(plain, ids)).max() > 1e-3


def test_window_within_the_trained_one_changes_nothing(models):
    target, _ = load_target(str(models["llama"]), context_window=TRAINED, rope_scaling="yarn")
    assert target.rope_scaling is None and not target.config.get("rope_scaling")


def test_family_that_ignores_rope_scaling_is_refused(tmp_path):
    """mlx-lm's qwen3_moe builds nn.RoPE without reading rope_scaling: refused, not dropped."""
    path = short_trained(write_model(tmp_path / "moe", "qwen3_moe"))
    with pytest.raises(UserError, match="did not take it"):
        load_target(str(path), context_window=4 * TRAINED, rope_scaling="yarn")
    target, _ = load_target(str(path), context_window=4 * TRAINED, rope_scaling="auto")
    assert target.rope_scaling is None and "did not take it" in target.rope_scaling_skipped  # serve says it
    assert not target.config.get("rope_scaling")


def test_every_mode_identical_on_the_scaled_target(models):
    """Speculative decoding verifies against the scaled target: tokens and text equal plain
    decoding of the same scaled model, far past the trained window."""
    from drafter_fixtures import write_deepspec

    from mlx_dspark.models.drafters import load_drafter

    target, tok = load_target(str(models["qwen3"]), context_window=8 * TRAINED, rope_scaling="yarn")
    assert target.rope_scaling["factor"] == 8.0
    drafter = load_drafter(str(write_deepspec(models["base"] / "dspark", models["qwen3"])), target, bits=16)
    runs = {
        mode: generate(
            target, tok, PROMPT, mode=mode, drafter=drafter if mode == "dspark" else None, max_new_tokens=120
        )
        for mode in ("baseline", "lookup", "dspark")
    }
    base = runs["baseline"]
    assert base.prompt_tokens + len(base.tokens) > 3 * TRAINED
    for mode, r in runs.items():
        assert r.tokens == base.tokens, mode
        assert r.text == base.text, mode
    assert any(a > 1 for a in runs["lookup"].accept_lengths + runs["dspark"].accept_lengths)  # drafts were accepted
    plain, _ = load_target(str(models["qwen3"]))
    assert generate(plain, tok, PROMPT, mode="baseline", max_new_tokens=120).tokens != base.tokens


def _serve(model: Path, tmp: Path, *args) -> tuple[str, dict]:
    """Start `mlx-dspark serve`, read its start-up lines and /health, stop it."""
    import urllib.request

    env = {"PYTHONPATH": str(ROOT / "python"), "HOME": str(tmp), "XDG_RUNTIME_DIR": str(tmp), "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_dspark", "serve", "--model", str(model), "--port", "0", "--no-warmup", *args],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 120:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if " at http://" in line:
                url = line.rsplit(" at ", 1)[1].strip()
                with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                    url + "/health", timeout=10
                ) as r:
                    return "".join(lines), json.loads(r.read())
        pytest.fail("serve did not start:\n" + "".join(lines) + (proc.stderr.read() if proc.poll() is not None else ""))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_says_what_it_does(models, tmp_path):
    out, health = _serve(models["llama"], tmp_path, "--context-window", str(4 * TRAINED), "--mode", "baseline")
    assert f"beyond the {TRAINED} tokens" in out and "RoPE is scaled (yarn x4, --rope-scaling auto)" in out
    assert health["rope_scaling"]["rope_type"] == "yarn" and health["trained_context"] == TRAINED
    assert health["context_window"] == 4 * TRAINED
    out, health = _serve(
        models["llama"], tmp_path, "--context-window", str(4 * TRAINED), "--rope-scaling", "none", "--mode", "baseline"
    )
    assert "not rescaled (--rope-scaling none)" in out and health["rope_scaling"] is None


def test_spilled_prefix_cache_of_a_scaled_model_is_kept_apart(models, tmp_path):
    """Prefix-cache entries on disk are keyed by the weights; a rescaled model's KV differs, so
    its entries go to their own folder and never meet the unscaled model's."""
    import argparse

    from mlx_dspark.cli.serve import _prefix_cache

    args = argparse.Namespace(
        no_prefix_cache=False, prefix_cache_slots=2, prefix_cache_max_ram_mb=None, prefix_cache_dir=str(tmp_path)
    )
    scaled, _ = load_target(str(models["llama"]), context_window=4 * TRAINED, rope_scaling="yarn")
    plain, _ = load_target(str(models["llama"]))
    a, b = _prefix_cache(args, scaled), _prefix_cache(args, plain)
    assert a.dir.parent == tmp_path / "rope-yarn-x4" and b.dir.parent == tmp_path
