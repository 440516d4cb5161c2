"""Drafter loading: packaging detection, refusals (each with its reason), the registry, the
CLI (`--model <dir> --drafter <dir>`, `mlx-dspark models`) and the pair API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from drafter_fixtures import target, workspace, write_deepspec, write_gemma4_target, write_zlab
from fixtures import write_model

from mlx_dspark.api import generate
from mlx_dspark.decode.modes import drafter_proposer
from mlx_dspark.errors import UserError
from mlx_dspark.models import drafters as drafters_mod
from mlx_dspark.models import registry
from mlx_dspark.models.drafters import load_drafter, resolve_drafter

REPO = Path(__file__).resolve().parents[1]


def _tq():
    return target(workspace()["target_qwen3"])[0]


@pytest.mark.parametrize(
    "key,packaging,kind,style,drafts",
    [
        ("dspark_qwen3", "deepspec-dspark", "dspark", "qwen3", 7),
        ("dspark_gemma4", "deepspec-dspark", "dspark", "gemma4", 7),
        ("dflash_deepspec", "deepspec-dflash", "dflash", "qwen3", 7),
        ("dflash_zlab", "zlab-dflash", "dflash", "qwen3", 15),
    ],
)
def test_packaging_detected(key, packaging, kind, style, drafts):
    ws = workspace()
    tgt = target(ws["target_gemma4" if style == "gemma4" else "target_qwen3"])[0]
    d = load_drafter(str(ws[key]), tgt, bits=4)
    assert (d.packaging, d.kind, d.spec.style, d.block_drafts) == (packaging, kind, style, drafts)
    assert drafter_proposer(d).block_drafts == drafts


def test_zlab_config_variants(tmp_path):
    from mlx_dspark.models.checkpoints import default_zlab_taps

    ws = workspace()
    top = write_zlab(tmp_path / "top", ws["target_qwen3"], block=8, nested=False)
    assert load_drafter(str(top), _tq(), bits=16).block_drafts == 7
    implied = write_zlab(tmp_path / "implied", ws["target_qwen3"], block=None)
    assert load_drafter(str(implied), _tq(), bits=16).block_size == 16
    assert default_zlab_taps(36, 5) == [1, 9, 17, 25, 33] and default_zlab_taps(40, 5) == [1, 10, 19, 28, 37]


def test_quantized_at_load_and_as_stored():
    ws = workspace()
    d4 = load_drafter(str(ws["dspark_qwen3"]), _tq(), bits=4)
    d8 = load_drafter(str(ws["dspark_qwen3"]), _tq(), bits=8)
    d16 = load_drafter(str(ws["dspark_qwen3"]), _tq(), bits=16)
    assert d4.model.layers[0].self_attn.q_proj.bits == 4 and d8.model.layers[0].mlp.up_proj.bits == 8
    assert not hasattr(d16.model.layers[0].self_attn.q_proj, "scales")
    assert d4.model.markov_head.markov_w2.bits == 4
    assert not hasattr(d4.model.confidence_head.proj, "scales")  # decides truncation: kept exact
    # DeepSpec's embed / lm_head copies equal the target's (tied) embedding: bound, not stored twice
    assert "embed_tokens" not in d4.model and "lm_head" not in d4.model and d4.bound == ["embed_tokens", "lm_head"]
    # Own copies (not the target's: the crafted perm drafter's zero lm_head) are quantized, and the
    # drafter computes with the quantized modules, not the float ones they replaced.
    own = load_drafter(str(ws["perm_dspark"]), target(ws["target_perm"])[0], bits=4)
    assert "lm_head" in own.model and own._head is own.model.lm_head and own._head.bits == 4


def _refused(path, tgt, match):
    with pytest.raises(UserError, match=match) as e:
        load_drafter(str(path), tgt, bits=16)
    return str(e.value)


def test_refuse_hidden_size_mismatch(tmp_path):
    big = write_model(tmp_path / "t96", "qwen3", layers=4, hidden=96, heads=4, kv_heads=2)
    msg = _refused(workspace()["dspark_qwen3"], target(big)[0], "hidden size 64 but the target's is 96")
    assert "trained for another model" in msg


def test_refuse_vocab_mismatch(tmp_path):
    ws = workspace()
    V = _tq().vocab_size
    rng = np.random.default_rng(0)
    big = {
        "embed_tokens.weight": rng.standard_normal((V + 8, 64)).astype(np.float32),
        "lm_head.weight": rng.standard_normal((V + 8, 64)).astype(np.float32),
        "markov_head.markov_w1.weight": np.zeros((V + 8, 32), np.float32),
        "markov_head.markov_w2.weight": np.zeros((V + 8, 32), np.float32),
    }
    p = write_deepspec(tmp_path / "d", ws["target_qwen3"], tensors=big, config_overrides={"vocab_size": V + 8})
    _refused(p, _tq(), f"vocabulary of {V + 8} tokens but the target's has {V}")
    z = write_zlab(tmp_path / "z", ws["target_qwen3"], config_overrides={"vocab_size": V + 1})
    _refused(z, _tq(), f"vocabulary of {V + 1} tokens")


@pytest.mark.parametrize(
    "taps,match",
    [
        ([1, 2, 9], "taps layer 9, which is out of range for a target with 4 layers"),
        ([0, 1, 3], "taps layer 3, the target's final layer"),
        ([-1, 1, 2], "taps layer -1, which is out of range"),
    ],
)
def test_refuse_taps_out_of_range(tmp_path, taps, match):
    p = write_deepspec(tmp_path / "d", workspace()["target_qwen3"], taps=taps)
    _refused(p, _tq(), match)


def test_refuse_target_depth_mismatch(tmp_path):
    p = write_deepspec(tmp_path / "d", workspace()["target_qwen3"], config_overrides={"num_target_layers": 36})
    _refused(p, _tq(), "trained against a 36-layer target; this target has 4 layers")


@pytest.mark.parametrize(
    "archs,match",
    [
        (["LlamaForCausalLM"], r"unknown drafter packaging \(architectures=\['LlamaForCausalLM'\]\)"),
        ([], "unknown drafter packaging"),
        (["DFlash2DraftModel"], "DFlash 2"),
        (["Qwen3Eagle3Model"], "EAGLE3"),
    ],
)
def test_refuse_unknown_packaging(tmp_path, archs, match):
    p = write_deepspec(tmp_path / "d", workspace()["target_qwen3"], config_overrides={"architectures": archs})
    _refused(p, _tq(), match)


def test_refuse_remote_code(tmp_path):
    ws = workspace()
    p = write_deepspec(tmp_path / "d", ws["target_qwen3"])
    (p / "modeling_dspark.py").write_text("raise SystemExit('never run')\n")
    _refused(p, _tq(), r"ships its own Python code \(Python files modeling_dspark.py\)")
    p = write_deepspec(
        tmp_path / "d2", ws["target_qwen3"], config_overrides={"auto_map": {"AutoModel": "modeling.Custom"}}
    )
    _refused(p, _tq(), "ships its own Python code.*auto_map")
    # z-lab's own dflash.py next to its known architecture is fine; any other code is not
    load_drafter(str(ws["dflash_zlab"]), _tq(), bits=16)
    z = write_zlab(tmp_path / "z", ws["target_qwen3"], extra_files={"utils.py": "x = 1\n"})
    _refused(z, _tq(), "ships its own Python code.*utils.py")
    z = write_zlab(tmp_path / "z2", ws["target_qwen3"], config_overrides={"auto_map": {"AutoModel": "dflash.Other"}})
    _refused(z, _tq(), "ships its own Python code")


def test_refuse_tensor_mismatches(tmp_path):
    ws = workspace()
    p = write_deepspec(tmp_path / "a", ws["target_qwen3"], drop=("layers.1.mlp.up_proj.weight",))
    _refused(p, _tq(), "missing tensors: layers.1.mlp.up_proj.weight")
    p = write_deepspec(tmp_path / "b", ws["target_qwen3"], tensors={"layers.0.extra.weight": np.zeros(3, np.float32)})
    _refused(p, _tq(), "unexpected tensors: layers.0.extra.weight")
    p = write_deepspec(
        tmp_path / "c", ws["target_qwen3"], tensors={"layers.0.self_attn.o_proj.weight": np.zeros((64, 32), np.float32)}
    )
    _refused(p, _tq(), r"shape mismatches: layers.0.self_attn.o_proj.weight \(64, 32\) != \(64, 64\)")
    # a confidence head the config does not announce is refused, not silently dropped
    p = write_deepspec(tmp_path / "e", ws["target_qwen3"], config_overrides={"enable_confidence_head": False})
    _refused(p, _tq(), "unexpected tensors: confidence_head.proj.bias")
    # DeepSpec DFlash config with Markov tensors present
    p = write_deepspec(tmp_path / "f", ws["target_qwen3"], confidence=False, config_overrides={"markov_rank": 0})
    _refused(p, _tq(), "unexpected tensors: markov_head")


def test_refuse_unsupported_variants(tmp_path):
    ws = workspace()
    p = write_deepspec(tmp_path / "a", ws["target_qwen3"], config_overrides={"markov_head_type": "gated"})
    _refused(p, _tq(), "Markov head type 'gated' is not supported")
    z = write_zlab(tmp_path / "z", ws["target_qwen3"], config_overrides={"layer_types": ["sliding_attention"] * 2})
    _refused(z, _tq(), "sliding-window layers are not supported")
    p = write_deepspec(
        tmp_path / "b",
        ws["target_qwen3"],
        config_overrides={"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e6}},
    )
    _refused(p, _tq(), "RoPE type 'mrope' is not supported")
    (tmp_path / "empty").mkdir()
    _refused(tmp_path / "empty", _tq(), "has no config.json")
    _refused(tmp_path / "nope", _tq(), "does not exist")


def test_mode_and_kind_must_agree():
    ws = workspace()
    with pytest.raises(UserError, match="mode='dspark' needs a dspark checkpoint.*is a dflash drafter"):
        resolve_drafter(_tq(), mode="dspark", drafter=str(ws["dflash_zlab"]), bits=16)
    with pytest.raises(UserError, match="no dspark drafter is registered"):
        resolve_drafter(_tq(), mode="dspark", drafter=None)
    assert resolve_drafter(_tq(), mode="auto", drafter=None) is None  # -> lookup
    with pytest.raises(UserError, match="needs a drafter with a confidence head"):
        drafter_proposer(load_drafter(str(ws["dflash_zlab"]), _tq(), bits=16), confidence_threshold=0.5)


# --------------------------------------------------------------------------- registry
@pytest.mark.parametrize(
    "name",
    [
        "Qwen/Qwen3-4B",
        "mlx-community/Qwen3-4B-4bit",
        "mlx-community/Qwen3-4B-8bit",
        "mlx-community/Qwen3-4B-bf16",
        "Qwen/Qwen3-4B-MLX-4bit",
        "lmstudio-community/Qwen3-4B-MLX-8bit",
        "/hf/hub/models--mlx-community--Qwen3-4B-4bit/snapshots/abc123",
        "~/models/Qwen3-4B-6bit",
    ],
)
def test_registry_is_quantization_agnostic(name):
    assert registry.canonical_name(name) == "qwen3-4b"
    tgt = stand_in_target(name, registry.QWEN3_4B)
    got = [(p.kind, p.drafter) for p in registry.pairs_for(tgt)]
    assert got[0] == ("dspark", "deepseek-ai/dspark_qwen3_4b_block7")
    assert ("dflash", "z-lab/Qwen3-4B-DFlash-b16") in got and ("dflash", "deepseek-ai/dflash_qwen3_4b_block7") in got


def stand_in_target(source: str, shape) -> SimpleNamespace:
    """What the registry reads of a loaded target (its names and shape), for a `shape` of registry.py."""
    return SimpleNamespace(
        source=source,
        name="",
        config={},
        model_type=shape.families[0],
        hidden_size=shape.hidden_size,
        num_layers=shape.num_layers,
        vocab_size=shape.vocab_size,
    )


def test_registry_needs_name_and_shape():
    assert registry.canonical_name("Qwen/Qwen3-4B-Instruct-2507") != "qwen3-4b"
    wrong_shape = SimpleNamespace(
        source="Qwen3-4B", name="", config={}, model_type="qwen3", hidden_size=64, num_layers=4, vocab_size=384
    )
    assert registry.pairs_for(wrong_shape) == []
    gemma = stand_in_target("mlx-community/gemma-4-12B-it-8bit", registry.GEMMA4_12B)
    assert [p.drafter for p in registry.pairs_for(gemma, "dspark")] == ["deepseek-ai/dspark_gemma4_12b_block7"]
    published = [r for r in registry.table() if r["publisher"] != "mlx-dspark (distill)"]  # ours: measured
    assert published and all(r["measured"] is None and "not yet measured" in r["status"] for r in published)


def test_auto_prefers_dspark_then_dflash(monkeypatch):
    """The registry path end to end, with the hub replaced by the fixture folders."""
    ws = workspace()
    tgt = _tq()
    shape = registry.Shape(("qwen3",), tgt.hidden_size, tgt.num_layers, tgt.vocab_size)
    name = registry.canonical_name(tgt.source)
    dspark = registry.Pair(name, "dspark", "fixture/dspark", "test", "deepspec-dspark", 7, shape)
    dflash = registry.Pair(name, "dflash", "fixture/dflash", "test", "zlab-dflash", 15, shape)
    folders = {"fixture/dspark": ws["dspark_qwen3"], "fixture/dflash": ws["dflash_zlab"]}
    monkeypatch.setattr(drafters_mod, "resolve_checkpoint", lambda src: Path(folders.get(src, src)))
    monkeypatch.setattr(registry, "PAIRS", (dflash, dspark))
    assert resolve_drafter(tgt, mode="auto").kind == "dspark"
    assert resolve_drafter(tgt, mode="dflash").packaging == "zlab-dflash"
    monkeypatch.setattr(registry, "PAIRS", (dflash,))
    assert resolve_drafter(tgt, mode="auto").kind == "dflash"
    broken = registry.Pair(name, "dspark", "fixture/missing", "test", "deepspec-dspark", 7, shape)
    monkeypatch.setattr(registry, "PAIRS", (broken,))
    assert resolve_drafter(tgt, mode="auto") is None  # warned, falls back to lookup
    with pytest.raises(UserError, match="fixture/missing"):
        resolve_drafter(tgt, mode="dspark")


# -------------------------------------------------------------------------------- CLI
def _cli(*args, env_extra=None):
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "mlx_dspark", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_cli_generate_with_drafter_dir(capsys):
    ws = workspace()
    args = [
        "generate",
        "--model",
        str(ws["target_qwen3"]),
        "--prompt",
        "def add(a, b): return a + b",
        "--max-new-tokens",
        "24",
        "--json",
    ]
    out = _cli(*args, "--mode", "dspark", "--drafter", str(ws["dspark_qwen3"]), "--max-draft", "0")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["mode"] == "dspark" and res["drafter"] == str(ws["dspark_qwen3"])
    tgt, tok = target(ws["target_qwen3"])
    base = generate(tgt, tok, "def add(a, b): return a + b", mode="baseline", max_new_tokens=24)
    assert res["tokens"] == base.tokens
    from mlx_dspark.cli.main import main

    rc = main(["generate", "--model", str(ws["target_qwen3"]), "--prompt", "x", "--mode", "dflash"])
    assert rc == 2 and "no dflash drafter is registered" in capsys.readouterr().err


def test_cli_models_lists_registry(capsys):
    from mlx_dspark.cli.main import main

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for p in registry.PAIRS:
        assert (f"package: {Path(p.drafter).name}" if registry.is_packaged(p.drafter) else p.drafter) in out
    assert "not yet measured by us" in out
    assert main(["models", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["pairs"]) == len(registry.PAIRS)


def test_a_pair_we_measured_but_do_not_distribute_is_listed_with_how_to_make_it(tmp_path, monkeypatch, capsys):
    """The Gemma 3 270M drafter is measured by us but not in git: `models` lists it with its
    figures and the commands that make and measure it; auto finds nothing to load for the target
    until a user's own copy registers through its pair.json (MLX_DSPARK_PAIRS)."""
    from mlx_dspark.cli.main import main

    gemma = stand_in_target("/models/gemma-3-270m-q4_k_m.gguf", registry.GEMMA3_270M)
    (row,) = [p for p in registry.PAIRS if p.target == "gemma-3-270m"]
    assert row.drafter == "" and row.measured and dict(row.accept)["humaneval"] >= 2.5 and "h200_gemma" in row.make
    assert registry.pairs_for(gemma) == []  # nothing to load
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "gemma-3-270m" in out and "not distributed (make it)" in out and "make: bench/h200_gemma_dspark.sh" in out
    assert main(["models", "--json"]) == 0
    (listed,) = [r for r in json.loads(capsys.readouterr().out)["pairs"] if r["target"] == "gemma-3-270m"]
    assert listed["make"] == row.make and listed["measured"] == row.measured

    mine = tmp_path / "gemma-drafter"
    mine.mkdir()
    pair = {"target": "gemma-3-270m", "kind": "dspark", "packaging": "deepspec-dspark", "block": 7}
    pair["shape"] = {"families": ["gemma3_text"], "hidden_size": 640, "num_layers": 18, "vocab_size": 262144}
    (mine / registry.PAIR_FILE).write_text(json.dumps(pair))
    monkeypatch.setenv(registry.ENV, str(mine))
    assert [p.drafter for p in registry.pairs_for(gemma)] == [str(mine.resolve())]


def test_auto_bits_quantizes_only_large_drafters_on_a_gpu(monkeypatch):
    from mlx_dspark.models import drafters

    if mx.default_device() == mx.cpu:
        assert drafters.auto_bits(10) == drafters.auto_bits(10**10) == 16
    monkeypatch.setattr(drafters.mx, "default_device", lambda: mx.gpu)
    assert drafters.auto_bits(20_000_000) == 16
    assert drafters.auto_bits(drafters.SMALL_DRAFTER_PARAMS + 1) == 4
    assert drafters.auto_bits() == 4


# ----------------------------------------------------------------------------- pairs
def test_load_pair_and_generate():
    from mlx_dspark.pairs import load_dflash_pair, load_pair, speculative_generate

    ws = workspace()
    tgt, tok, d, cfg = load_pair(str(ws["target_qwen3"]), drafter=str(ws["dspark_qwen3"]))
    assert (
        d.kind == "dspark"
        and cfg["drafter"] == str(ws["dspark_qwen3"])
        and cfg["bits"] == 16  # a small drafter stays as stored, on every device
    )
    res = speculative_generate(tgt, tok, d, prompt_ids=[7, 8, 9, 7, 8, 9], max_new_tokens=30)
    base = generate(tgt, tok, None, prompt_ids=[7, 8, 9, 7, 8, 9], mode="baseline", max_new_tokens=30)
    assert res.tokens == base.tokens and res.mode == "dspark"
    _, _, dz, cfg = load_dflash_pair(str(ws["target_qwen3"]), drafter=str(ws["dflash_zlab"]), bits=16)
    assert dz.kind == "dflash" and cfg["drafts_per_round"] == 15
    with pytest.raises(UserError, match="is a dspark drafter"):
        load_dflash_pair(str(ws["target_qwen3"]), drafter=str(ws["dspark_qwen3"]))
    _, _, none, cfg = load_pair(str(ws["target_qwen3"]))
    assert none is None and cfg["mode"] == "lookup"


def test_gemma4_target_pairs_with_gemma4_drafter(tmp_path):
    """The Gemma 4 drafter against a real (tiny) gemma4_text target through the loader."""
    ws = workspace()
    tgt, tok = target(ws["target_gemma4"])
    d = load_drafter(str(ws["dspark_gemma4"]), tgt, bits=16)
    assert d.spec.backbone.k_eq_v and d.spec.embed_scale == 8.0 and d.spec.softcap == 1.0
    other = write_gemma4_target(tmp_path / "g", layers=6, seed=9)
    _refused(ws["dspark_gemma4"], target(other)[0], "trained against a 4-layer target; this target has 6 layers")
