"""Gemma 3 / Gemma 4 through mlx-vlm (models/vlm.py), and the mlx-vlm shims of compat.py.

Fixtures: tiny random multimodal gemma3 / gemma4 checkpoints in mlx-vlm's layout
(tests/vlm_fixtures.py) with a sliding window of 8, loaded from disk as a user's folder is,
CPU float32. The reference is mlx-vlm's own greedy generation (mlx_vlm.generate's generate_step
over mlx-vlm's model and caches).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from drafter_fixtures import write_deepspec, write_zlab
from family_fixtures import text_view
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_loop import _ScriptedProposer

import mlx_dspark as md
from mlx_dspark import compat
from mlx_dspark.errors import UserError
from mlx_dspark.models import vlm
from mlx_dspark.models.drafters import load_drafter

pytest.importorskip("mlx_vlm")
from fixtures import scratch_dir
from vlm_fixtures import write_vlm_gemma  # noqa: E402

WINDOW = 8
_ROOT = scratch_dir("mlx-dspark-vlm-")
_LOADED: dict = {}


def gemma(kind: str):
    """(target, tokenizer, drafters, path) for a fixture, loaded once per process."""
    if kind not in _LOADED:
        path = write_vlm_gemma(_ROOT / kind, kind, window=WINDOW, seed=1)
        tgt, tok = md.load_target(str(path), dtype="float32")
        view = text_view(path, _ROOT / f"{kind}-view")
        drafters = {
            # Gemma 4 pairs with DSpark's gemma4 drafter variant (its own norms and softcap)
            "dspark": load_drafter(
                str(
                    write_deepspec(
                        _ROOT / f"{kind}-dspark",
                        view,
                        **({"style": "gemma4", "softcap": 1.0} if kind == "gemma4" else {}),
                    )
                ),
                tgt,
                bits=16,
            ),
            "dflash": load_drafter(str(write_zlab(_ROOT / f"{kind}-dflash", view)), tgt, bits=16),
        }
        _LOADED[kind] = (tgt, tok, drafters, path)
    return _LOADED[kind]


def mlx_vlm_greedy(path, ids: list[int], n: int, stops: set[int]) -> list[int]:
    """Plain mlx-vlm greedy decoding: its loader, its model, its caches, its generate_step."""
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.utils import load_model

    model = _VLM_MODELS.get(path) or _VLM_MODELS.setdefault(path, load_model(Path(path)))
    out = []
    for tok, _ in generate_step(mx.array([ids]), model, None, None, max_tokens=n, temperature=0.0):
        if int(tok) in stops:
            break
        out.append(int(tok))
        if len(out) == n:
            break
    return out


def detokenize(tok, ids: list[int]) -> str:
    """The text mlx-lm's streaming detokenizer makes of ids (what a plain generation prints)."""
    d = compat.fresh_detokenizer(tok)
    for t in ids:
        d.add_token(t)
    d.finalize()
    return d.text


_VLM_MODELS: dict = {}


@pytest.mark.parametrize("kind", ["gemma3", "gemma4"])
def test_multimodal_gemma_loads_through_mlx_vlm(kind):
    tgt, _, _, _ = gemma(kind)
    assert isinstance(tgt.model, vlm.VLMText)
    assert type(tgt.model.language_model).__module__.startswith(f"mlx_vlm.models.{kind}.")
    assert tgt.rollback_kind == "rewind" and tgt.rollback_refusal is None and tgt.tap_refusal is None
    cache = tgt.make_cache()
    assert {type(c).__name__ for c in cache} == {"RewindableRotatingKVCache", "KVCache"}
    assert {c.max_size for c in cache if hasattr(c, "max_size")} == {WINDOW}


WORDS = ["the", "fox", "def", "add", "(a, b)", "return", "hello", "world", "1 2 3", "café", "\n"]
prompts = st.lists(st.sampled_from(WORDS), min_size=1, max_size=10).map(" ".join)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(["gemma3", "gemma4"]), prompt=prompts, n=st.integers(1, 40))
def test_baseline_is_mlx_vlm_greedy(kind, prompt, n):
    tgt, tok, _, path = gemma(kind)
    ids = md.encode_prompt(tok, prompt)
    base = md.generate(tgt, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=n)
    ref = mlx_vlm_greedy(path, ids, n, set(md.api.stop_token_ids(tgt, tok)))
    assert base.tokens == ref
    assert base.text == detokenize(tok, ref)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(["gemma3", "gemma4"]), prompt=prompts, max_draft=st.sampled_from([1, 3, 7]))
def test_every_mode_is_identical_to_baseline_past_the_window(kind, prompt, max_draft):
    tgt, tok, drafters, _ = gemma(kind)
    ids = md.encode_prompt(tok, prompt)
    n = 48  # the window is 8: every run goes well past the wrap
    base = md.generate(tgt, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=n)
    runs = [md.generate(tgt, tok, None, prompt_ids=ids, mode="lookup", max_new_tokens=n, max_draft=max_draft)]
    for mode, d in drafters.items():
        runs.append(
            md.generate(tgt, tok, None, prompt_ids=ids, mode=mode, drafter=d, max_new_tokens=n, max_draft=max_draft)
        )
    prop = _ScriptedProposer(base.tokens + [0] * 64)
    runs.append(md.generate(tgt, tok, None, prompt_ids=ids, proposer=prop, max_new_tokens=n, max_draft=max_draft))
    for r in runs:
        assert r.tokens == base.tokens and r.text == base.text
        assert "speculation_off" not in r.stats
    if len(base.tokens) > 2:  # (a prompt the model answers with its end token at once has no round)
        assert runs[1].stats["drafter_proposed"] > 0  # the drafter did draft on the mlx-vlm target
    if max_draft > 1 and len(base.tokens) > WINDOW + 2:
        assert max(runs[-1].accept_lengths) > 1  # verify rounds did run and roll back past the wrap


def test_cli_generate_on_a_multimodal_gemma_folder():
    _, _, _, path = gemma("gemma4")
    out = {}
    for mode in ("baseline", "lookup"):
        r = subprocess.run(
            [sys.executable, "-m", "mlx_dspark", "generate", "--model", str(path), "--prompt", "the fox def add"]
            + ["--max-new-tokens", "30", "--json", "--mode", mode],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        out[mode] = json.loads(r.stdout)
    assert out["lookup"]["tokens"] == out["baseline"]["tokens"] and out["lookup"]["text"] == out["baseline"]["text"]


def test_the_loader_can_be_chosen(monkeypatch):
    _, _, _, path = gemma("gemma3")
    monkeypatch.setenv("MLX_DSPARK_GEMMA_LOADER", "mlx-lm")
    assert not vlm.wants_vlm(path)
    monkeypatch.setenv("MLX_DSPARK_GEMMA_LOADER", "mlx-vlm")
    assert vlm.wants_vlm(path)
    monkeypatch.setenv("MLX_DSPARK_GEMMA_LOADER", "vllm")
    with pytest.raises(UserError, match="must be auto, mlx-vlm or mlx-lm"):
        vlm.wants_vlm(path)
    monkeypatch.delenv("MLX_DSPARK_GEMMA_LOADER")
    monkeypatch.setattr(vlm, "vlm_available", lambda: False)
    assert not vlm.wants_vlm(path)  # without the extra, mlx-lm reads the checkpoint (text only)
    monkeypatch.setenv("MLX_DSPARK_GEMMA_LOADER", "mlx-vlm")
    with pytest.raises(UserError, match=r"mlx-dspark\[gemma\]"):
        vlm.wants_vlm(path)


def test_a_cache_kind_without_rollback_is_named():
    tgt, _, _, _ = gemma("gemma3")

    class PoolingCache:
        pass

    class Fake:
        language_model = type("LM", (), {"make_cache": lambda self: [PoolingCache()], "layers": []})()
        config = type("C", (), {"model_type": "gemma3"})()

    with pytest.raises(UserError, match="PoolingCache"):
        vlm.VLMText(Fake()).make_cache()


# ----------------------------------------------------------------------------- compat shims
def test_shim_version_ranges():
    assert compat.vlm_rope_utils_shim_active((0, 6, 4)) and not compat.vlm_rope_utils_shim_active((0, 6, 5))
    assert not compat.vlm_rope_utils_shim_active((0, 7, 10))
    assert compat.vlm_video_processor_shim_active((0, 6, 4), (5, 12, 0))
    assert compat.vlm_video_processor_shim_active((0, 6, 3), (5, 24, 0))
    assert not compat.vlm_video_processor_shim_active((0, 6, 4), (5, 11, 9))
    assert not compat.vlm_video_processor_shim_active((0, 6, 5), (5, 24, 0))
    assert not compat.vlm_video_processor_shim_active((0, 6, 2), (5, 24, 0))
    assert not compat.vlm_video_processor_shim_active(None, (5, 24, 0))


def test_the_installed_mlx_vlm_needs_no_shim():
    """mlx-vlm on the PyPI mirror (0.7.10) has the new rope-utils layout and the video-processor
    fix: both shims report inactive and the video one is not installed by a load."""
    assert compat.dist_version("mlx-vlm") >= (0, 6, 5)
    shims = {s["name"]: s for s in compat.vlm_shims()}
    assert len(shims) == 2 and not any(s["active"] for s in shims.values())
    gemma("gemma4")
    assert compat._video_shim_original is None
    assert compat.vlm_rope_utils().__name__ == "mlx_vlm.models.rope_utils"


def test_rope_utils_shim_reads_the_old_layout(tmp_path):
    """An mlx-vlm <= 0.6.4 layout (rope_utils under models/gemma4/ only) on the path first."""
    pkg = tmp_path / "mlx_vlm" / "models" / "gemma4"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "mlx_vlm", tmp_path / "mlx_vlm" / "models", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "rope_utils.py").write_text("def initialize_rope(*a, **k):\n    return 'old layout'\n")
    code = "from mlx_dspark import compat; print(compat.vlm_rope_utils().initialize_rope())"
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(tmp_path), "PATH": ""}
    )
    assert r.returncode == 0 and r.stdout.strip() == "old layout", r.stderr


def test_video_processor_shim_turns_that_oserror_into_the_default(monkeypatch):
    import transformers

    class Auto:
        @classmethod
        def from_pretrained(cls, path, **kw):
            if path == "missing":
                raise OSError("Can't load video processor for 'missing'. Make sure ...")
            if path == "other":
                raise OSError("disk on fire")
            return "loaded"

    monkeypatch.setattr(transformers, "AutoVideoProcessor", Auto)
    assert not compat.apply_vlm_video_processor_shim()  # not in the affected range here
    try:
        assert compat.apply_vlm_video_processor_shim(force=True)
        assert transformers.AutoVideoProcessor.from_pretrained("missing") is None
        assert transformers.AutoVideoProcessor.from_pretrained("ok") == "loaded"
        with pytest.raises(OSError, match="disk on fire"):
            transformers.AutoVideoProcessor.from_pretrained("other")
        assert any(s["active"] for s in compat.vlm_shims() if "video" in s["name"])
    finally:
        compat.remove_vlm_video_processor_shim()
    with pytest.raises(OSError):
        transformers.AutoVideoProcessor.from_pretrained("missing")


def test_doctor_lists_the_shims(monkeypatch):
    from mlx_dspark.cli import doctor

    r = subprocess.run([sys.executable, "-m", "mlx_dspark", "doctor", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    vlm = {s["name"] for s in compat.vlm_shims()}
    shims = [s for s in json.loads(r.stdout)["shims"] if s["name"] in vlm]
    assert len(shims) == len(vlm) == 2
    assert not any(s["active"] for s in shims)
    versions = {"mlx-vlm": (0, 6, 4), "transformers": (5, 13, 0), "mlx": (0, 32, 4), "mlx-lm": (0, 32, 2)}
    monkeypatch.setattr(compat, "dist_version", versions.get)
    active = {s["name"]: s["active"] for s in doctor.collect()["shims"] if s["name"] in vlm}
    assert len(active) == 2 and all(active.values())


def test_target_embed_is_the_models_own_scaling():
    """Drafters embed through Target.embed: for Gemma 4 that is sqrt(hidden) unrounded (gemma3
    rounds it to bf16); at hidden 96 the two differ, and the model's own forward on
    Target.embed's rows gives its own logits bitwise."""
    path = write_vlm_gemma(_ROOT / "gemma4-h96", "gemma4", hidden=96, window=WINDOW, seed=2)
    tgt, _ = md.load_target(str(path), dtype="float32")
    ids = mx.array([[3, 17, 40, 99, 7]])
    lm = tgt.model.language_model
    own = lm(ids, cache=lm.make_cache()).logits
    via = lm(None, inputs_embeds=tgt.embed(ids), cache=lm.make_cache()).logits
    assert mx.array_equal(own, via).item()
    rounded = tgt.embed_tokens(ids) * mx.array(96**0.5, dtype=mx.bfloat16).astype(mx.float32)
    assert not mx.array_equal(tgt.embed(ids), rounded).item()
