"""`mlx-dspark distill --kind dflash` (z-lab packaging, block 16) on a tiny target, loaded the way
a user loads it: it learns (acceptance well above a random drafter's, through the real verify
loop), it resumes exactly, its training forward is the z-lab drafter's inference forward, and the
drafter it writes is a z-lab DFlash checkpoint that `load_dflash_pair` / `--mode dflash` run
losslessly (tokens and text equal to baseline)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from distill_fixtures import FAST_SHARED, TINY, accept, cli, quiet, small_run
from fixtures import write_model

FAST = ["--kind", "dflash", *FAST_SHARED]
BACKBONE = {"fc.weight", "hidden_norm.weight", "norm.weight"}
LAYER = {
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("distill-dflash") / "target", "qwen3", **TINY)


def _assert_zlab_layout(d: Path, layers: int, block: int = 16) -> dict:
    """z-lab's DFlashDraftModel checkpoint: its config keys and exactly the backbone's tensors."""
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert cfg["block_size"] == block and cfg["num_hidden_layers"] == layers
    assert set(cfg["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    for k in ("markov_rank", "enable_confidence_head", "embeddings_from_target", "target_layer_ids", "mask_token_id"):
        assert k not in cfg, k  # DeepSpec's keys / our compact flag: not in z-lab's layout
    names = set(mx.load(str(d / "model.safetensors")))
    assert names == BACKBONE | {f"layers.{i}.{n}" for i in range(layers) for n in LAYER}
    return cfg


def test_training_forward_is_the_zlab_inference_forward(tiny, tmp_path):
    """Many blocks at once with the block mask (slots 1..15 of each) == the loaded z-lab drafter's
    cached one-block forward, which embeds with the target's embedding and drafts slots 1..B-1."""
    from mlx_dspark.models.dflash import ZLabDFlashDrafter
    from mlx_dspark.models.drafters import load_drafter
    from mlx_dspark.models.loading import load_target
    from mlx_dspark.train import checkpoint as ck
    from mlx_dspark.train.forward import block_hidden
    from mlx_dspark.train.trainer import DistillConfig, build_model

    target, tok = load_target(str(tiny))
    cfg = DistillConfig(kind="dflash", layers=2, taps=[0])
    model, hcfg, spec = build_model(target, tok, cfg, tmp_path / "d")
    assert cfg.layout == "zlab" and cfg.block_size == 16 and spec.logits_start == 1 and cfg.decay() == 7.0
    ck.init_weights(model, seed=3, std=0.2)
    ck.save_drafter(model, hcfg, tmp_path / "d")
    _assert_zlab_layout(tmp_path / "d", layers=2)
    d = load_drafter(str(tmp_path / "d"), target, bits=16)
    assert isinstance(d, ZLabDFlashDrafter) and d.packaging == "zlab-dflash" and d.block_drafts == 15
    rng = np.random.default_rng(0)
    ids = mx.array(rng.integers(0, target.vocab_size - 8, size=(2, 24)).astype(np.int32))
    taps = target.forward(ids, None, taps=spec.taps).hidden
    anchors = np.array([[0, 4, 11, 23], [2, 3, 9, 15]], np.int32)
    m = d.model
    m.embed_tokens = target.embed_tokens  # (the module under training holds a frozen copy of it)
    hb = block_hidden(m, taps, ids, mx.array(anchors), 16, spec.mask_token_id, embed=target.embed)
    for s in range(2):
        for a, p in enumerate(anchors[s]):
            ref = d.block_hidden(int(ids[s, p]), taps[s, :p] if p else None, d.new_state())
            assert ref.shape[0] == 15
            assert float(mx.abs(ref - hb[s, a, 1:]).max()) < 1e-4 * (1 + float(mx.abs(ref).max()))


def test_dflash_layout_flags_are_checked(tiny, tmp_path, capsys):
    from mlx_dspark.cli.main import main

    assert main(["distill", "--model", str(tiny), "--out", str(tmp_path / "o"), "--layout", "zlab"]) == 2
    assert "--kind dflash" in capsys.readouterr().err
    from mlx_dspark.train.trainer import DistillConfig, resolve_arch

    c = DistillConfig(kind="dflash", layout="deepspec")
    resolve_arch(c, None)
    assert c.block_size == 7 and c.decay() == 4.0 and c.arch()["layout"] == "deepspec"
    assert "layout" not in DistillConfig(kind="dspark").arch()  # (a DSpark run's resume state is unchanged)


def _rule_target(path: Path) -> Path:
    """The perm target (drafter_fixtures.py: its greedy next token is f(current token), one cycle
    over the vocabulary) with a chat template that adds nothing after the user's text, so that
    every prompt's answer is the chain from another token: the data covers the rule f, and a
    held-out prompt's answer is a chain never seen as such. (With the stock template every
    answer starts from the same generation-prompt token: one chain, nothing to generalise.)"""
    from drafter_fixtures import write_perm_target

    p, _ = write_perm_target(path)
    tc = json.loads((p / "tokenizer_config.json").read_text())
    tc["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (p / "tokenizer_config.json").write_text(json.dumps(tc))
    return p


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One CLI run: --kind dflash, 250 steps, --export; and the same data with no training."""
    root = tmp_path_factory.mktemp("dflash-run")
    rule = _rule_target(root / "rule")
    p = cli(["--model", str(rule), "--out", str(root / "t"), "--steps", "250", "--export", str(root / "x"), *FAST])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "tok/s" in p.stderr and "ETA" in p.stderr
    (root / "r").mkdir()
    shutil.copy(root / "t" / "samples.jsonl", root / "r" / "samples.jsonl")
    p0 = cli(["--model", str(rule), "--out", str(root / "r"), "--steps", "0", *FAST])
    assert p0.returncode == 0, p0.stderr[-3000:]
    return rule, root


@pytest.mark.slow
def test_dflash_distill_raises_acceptance_above_a_random_drafter(trained):
    rule, root = trained
    a1, a0 = accept(root / "t"), accept(root / "r")
    assert set(a1) == {"chat", "code", "math", "_all"}  # per domain (held-out built-in prompts)
    assert a0["_all"] < 1.2 and a1["_all"] >= a0["_all"] + 0.8, (a0, a1)
    hist = [h for h in map(json.loads, (root / "t" / "train_log.jsonl").read_text().splitlines()) if "ce" in h]
    assert np.mean([h["ce"] for h in hist[-3:]]) < 0.5 * hist[0]["ce"], [h["ce"] for h in hist]
    # z-lab's layout, in the run folder and in the export (the same tensors, bf16).
    cfg = _assert_zlab_layout(root / "t", layers=1)
    _assert_zlab_layout(root / "x", layers=1)
    assert cfg["mlx_dspark_distill"]["kind"] == "dflash" and cfg["mlx_dspark_distill"]["layout"] == "zlab"
    assert (root / "x" / "draft_vocab.json").is_file()
    ev = json.loads((root / "t" / "eval.json").read_text())
    assert ev["drafter"] == str(root / "x")  # the evaluation ran the exported drafter


@pytest.mark.slow
def test_the_export_runs_losslessly_as_a_user_runs_it(trained):
    """load_dflash_pair + dflash_generate, and `mlx-dspark generate --mode dflash --drafter DIR`,
    equal plain decoding in tokens AND text, with whole blocks accepted (the drafts do land)."""
    from mlx_dspark.api import generate
    from mlx_dspark.pairs import dflash_generate, load_dflash_pair

    rule, root = trained
    for dv in ("auto", "full"):
        target, tok, drafter, info = load_dflash_pair(str(rule), drafter=str(root / "x"), draft_vocab=dv)
        assert info["mode"] == "dflash" and info["packaging"] == "zlab-dflash" and info["drafts_per_round"] == 15
        for prompt in ("Count on, please.", "What is the capital of France?"):
            base = generate(target, tok, prompt, mode="baseline", max_new_tokens=48)
            res = dflash_generate(target, tok, drafter, prompt, max_new_tokens=48)
            assert res.tokens == base.tokens and res.text == base.text
    assert max(res.accept_lengths) >= 4, res.accept_lengths
    common = ["--model", str(rule), "--prompt", "Count on, please.", "--max-new-tokens", "48", "--json"]
    b = cli([*common, "--mode", "baseline"], cmd="generate")
    d = cli([*common, "--mode", "dflash", "--drafter", str(root / "x"), "--max-draft", "15"], cmd="generate")
    assert b.returncode == 0 and d.returncode == 0, (b.stderr[-2000:], d.stderr[-2000:])
    jb, jd = json.loads(b.stdout), json.loads(d.stdout)
    assert jd["mode"] == "dflash" and jd["tokens"] == jb["tokens"] and jd["text"] == jb["text"]
    assert jd["stats"]["drafter_accepted"] > 0
    streamed = cli([*common[:-1], "--mode", "dflash", "--drafter", str(root / "x")], cmd="generate")
    assert streamed.returncode == 0 and streamed.stdout.rstrip("\n") == jb["text"]


def _small(model, out, *, steps, save_every, **kw):
    return small_run(model, out, steps=steps, save_every=save_every, prompts=3, answer_tokens=24, kind="dflash", **kw)


def _same_trained_weights(a_dir: Path, b_dir: Path) -> None:
    a = mx.load(str(a_dir / "train_state" / "trainable.safetensors"))
    b = mx.load(str(b_dir / "train_state" / "trainable.safetensors"))
    assert a.keys() == b.keys() and "fc.weight" in a and not any(k.startswith("embed_tokens") for k in a)
    for k in a:
        assert np.allclose(np.array(a[k]), np.array(b[k]), atol=1e-6), k
    wa, wb = mx.load(str(a_dir / "model.safetensors")), mx.load(str(b_dir / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(mx.array_equal(wa[k], wb[k]).item() for k in wa)


def test_dflash_resume_continues_exactly(tiny, tmp_path):
    """A crash after step 7 (last checkpoint at 4), then --resume: the same weights as one
    uninterrupted run, and the run refuses to restart over its own state."""
    from mlx_dspark.errors import UserError
    from mlx_dspark.train.pipeline import run_distill

    run_distill(_small(tiny, tmp_path / "full", steps=12, save_every=4), log=quiet)

    class Stop(Exception):
        pass

    def crash(step):
        if step == 7:
            raise Stop

    with pytest.raises(Stop):
        run_distill(_small(tiny, tmp_path / "cut", steps=12, save_every=4), log=quiet, on_step=crash)
    assert json.loads((tmp_path / "cut" / "train_state" / "state.json").read_text())["step"] == 4
    with pytest.raises(UserError, match="--resume"):
        run_distill(_small(tiny, tmp_path / "cut", steps=12, save_every=4), log=quiet)
    other = _small(tiny, tmp_path / "cut", steps=12, save_every=4, resume=True)
    other.train.layout = "deepspec"
    with pytest.raises(UserError, match="other settings"):
        run_distill(other, log=quiet)
    steps = []
    run_distill(_small(tiny, tmp_path / "cut", steps=12, save_every=4, resume=True), log=quiet, on_step=steps.append)
    assert steps == list(range(5, 13))
    _same_trained_weights(tmp_path / "full", tmp_path / "cut")


def test_init_from_a_zlab_drafter_keeps_its_layout_and_weights(tiny, tmp_path):
    """--init-from a z-lab checkpoint (ours here; any z-lab DFlash of this target alike): its
    architecture and layout come with it, its weights are the starting point; a DSpark --kind
    against it is refused before any answer is made."""
    from mlx_dspark.errors import UserError
    from mlx_dspark.train.pipeline import run_distill

    run_distill(_small(tiny, tmp_path / "a", steps=6, save_every=0, export=str(tmp_path / "a_x")), log=quiet)
    o = _small(tiny, tmp_path / "b", steps=0, save_every=0)
    o.train.kind, o.train.layers, o.train.init_from = None, None, str(tmp_path / "a_x")
    run_distill(o, log=quiet)
    _assert_zlab_layout(tmp_path / "b", layers=1)
    wa, wb = mx.load(str(tmp_path / "a" / "model.safetensors")), mx.load(str(tmp_path / "b" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(mx.array_equal(wa[k], wb[k]).item() for k in wa)
    o = _small(tiny, tmp_path / "c", steps=1, save_every=0)
    o.train.kind, o.train.init_from = "dspark", str(tmp_path / "a_x")
    with pytest.raises(UserError, match="--kind dspark disagrees with --init-from"):
        run_distill(o, log=quiet)
    assert not (tmp_path / "c" / "samples.jsonl").exists()


def test_a_dflash_drafter_starts_from_a_dspark_drafters_backbone(tiny, tmp_path):
    """--kind dflash --init-from a DSpark drafter: the DFlash drafter (z-lab layout, block 16)
    starts from the DSpark backbone's tensors exactly (its depth, taps and mask token too); the
    Markov and confidence heads are dropped. A DSpark drafter cannot start from a DFlash one."""
    from mlx_dspark.errors import UserError
    from mlx_dspark.train.pipeline import run_distill

    o = _small(tiny, tmp_path / "s", steps=3, save_every=0, export=str(tmp_path / "s_x"))
    o.train.kind, o.train.markov_rank = "dspark", 8
    run_distill(o, log=quiet)
    ws = mx.load(str(tmp_path / "s" / "model.safetensors"))
    assert any(k.startswith("markov_head.") for k in ws)

    o = _small(tiny, tmp_path / "d", steps=0, save_every=0)
    o.train.layers, o.train.init_from = None, str(tmp_path / "s_x")
    run_distill(o, log=quiet)
    cfg = _assert_zlab_layout(tmp_path / "d", layers=1)
    src = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["dflash_config"] == {"mask_token_id": src["mask_token_id"], "target_layer_ids": src["target_layer_ids"]}
    wd = mx.load(str(tmp_path / "d" / "model.safetensors"))
    for k in wd:  # bf16 -> float32 -> bf16 is exact
        assert mx.array_equal(wd[k], ws[k]).item(), k

    o = _small(tiny, tmp_path / "e", steps=1, save_every=0)
    o.train.kind, o.train.layers, o.train.init_from = "dspark", None, str(tmp_path / "d")
    with pytest.raises(UserError, match="--kind dspark disagrees with --init-from"):
        run_distill(o, log=quiet)


@pytest.mark.slow
def test_a_distilled_dflash_drafter_registers_with_its_figures_and_command(trained, tmp_path, monkeypatch):
    """write_pair_file registers the exported drafter (pair.json beside its weights) with the
    figures measured and the command that reproduces them: MLX_DSPARK_PAIRS names it, then
    `mlx-dspark models` lists it with both, and load_dflash_pair / --mode dflash / --mode auto
    find it with no --drafter and decode losslessly (tokens and text)."""
    from mlx_dspark.api import generate
    from mlx_dspark.errors import UserError
    from mlx_dspark.models import registry
    from mlx_dspark.models.loading import load_target
    from mlx_dspark.pairs import dflash_generate, load_dflash_pair

    rule, root = trained
    drafter = tmp_path / "dflash-rule"
    shutil.copytree(root / "x", drafter)
    acc = accept(root / "t")["_all"]
    measured = f"CPU float32: held-out accept {acc:.2f} (4 built-in prompts per domain)"
    command = f"mlx-dspark distill --model {rule} --kind dflash --steps 250 ..."
    target, _ = load_target(str(rule))
    registry.write_pair_file(
        drafter, target, measured=measured, reproduce=command, note="test fixture", accept={"held-out": acc}
    )
    pair = registry.read_pair_file(drafter)
    assert (pair.target, pair.kind, pair.packaging, pair.block) == ("rule", "dflash", "zlab-dflash", 15)
    assert pair.accept == (("held-out", round(acc, 3)),)
    assert registry.pairs_for(target, "dflash") == []  # not registered until named
    monkeypatch.setenv(registry.ENV, str(tmp_path))  # a folder of drafter folders
    assert registry.pairs_for(target, "dflash") == [pair] and registry.pairs_for(target, "dspark") == []
    assert registry.typical_acceptance(str(drafter)) == round(acc, 3)  # what --mode auto weighs it by

    env = {registry.ENV: str(drafter)}
    listing = subprocess.run(
        [sys.executable, "-m", "mlx_dspark", "models", "--json"],
        capture_output=True,
        text=True,
        env=dict(os.environ, **env),
        timeout=120,
    )
    rows = [r for r in json.loads(listing.stdout)["pairs"] if r["drafter"] == str(drafter.resolve())]
    assert len(rows) == 1 and rows[0]["measured"] == measured and rows[0]["reproduce"] == command
    text = subprocess.run(
        [sys.executable, "-m", "mlx_dspark", "models"], capture_output=True, text=True, env=dict(os.environ, **env)
    ).stdout
    assert f"measured: {measured}" in text and "reproduce: mlx-dspark distill" in text

    t, tok, d, info = load_dflash_pair(str(rule))
    assert info["drafter"] == str(drafter.resolve()) and info["packaging"] == "zlab-dflash"
    base = generate(t, tok, "Count on, please.", mode="baseline", max_new_tokens=40)
    res = dflash_generate(t, tok, d, "Count on, please.", max_new_tokens=40)
    assert res.tokens == base.tokens and res.text == base.text and max(res.accept_lengths) > 1
    common = ["--model", str(rule), "--prompt", "Count on, please.", "--max-new-tokens", "40", "--json"]
    for mode in ("dflash", "auto"):
        p = subprocess.run(
            [sys.executable, "-m", "mlx_dspark", "generate", *common, "--mode", mode, "--max-draft", "15"],
            capture_output=True,
            text=True,
            env=dict(os.environ, **env),
            timeout=120,
        )
        j = json.loads(p.stdout)
        assert j["mode"] == "dflash" and j["drafter"] == str(drafter.resolve()), (mode, p.stderr[-500:])
        assert j["tokens"] == base.tokens and j["text"] == base.text

    # Shipped the same way: a folder with pair.json under the package's assets/ is registered.
    monkeypatch.delenv(registry.ENV)
    monkeypatch.setattr(registry, "ASSETS", tmp_path)
    assert registry._shipped() == (pair,) and registry.is_packaged(str(drafter))
    (drafter / registry.PAIR_FILE).write_text('{"target": "rule"}')
    monkeypatch.setenv(registry.ENV, str(drafter))
    with pytest.raises(UserError, match="pair.json is unreadable"):
        registry.pairs_for(target)
    monkeypatch.setenv(registry.ENV, str(tmp_path / "nothing-here"))
    with pytest.raises(UserError, match="holds no pair.json"):
        registry.table()


@pytest.mark.slow
def test_bench_dflash_measures_checks_and_registers(trained, tmp_path, monkeypatch):
    """bench/bench_dflash.py (what the device script runs after training): acceptance per eval
    domain, each prompt checked against plain greedy on tokens and text, and --register writes
    the pair.json that the registry then reads, with these figures and this command."""
    import importlib.util

    from mlx_dspark.models import registry

    rule, root = trained
    drafter = tmp_path / "d"
    shutil.copytree(root / "x", drafter)
    evald = tmp_path / "eval"
    evald.mkdir()
    for dom, texts in {"humaneval": ["def f(x): return x", "Sort a list."], "mt-bench": ["Tell me a story."]}.items():
        (evald / f"{dom}.jsonl").write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in texts))
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "bench"))  # (its _package import)
    spec = importlib.util.spec_from_file_location("bench_dflash", Path(__file__).parents[1] / "bench/bench_dflash.py")
    bd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bd)
    args = ["--model", str(rule), "--drafter", str(drafter), "--eval-dir", str(evald), "--domains", "humaneval"]
    args += ["mt-bench", "--samples", "2", "--max-new-tokens", "24", "--json", str(tmp_path / "a.json"), "--register"]
    assert bd.main(args) == 0
    res = json.loads((tmp_path / "a.json").read_text())["result"]
    assert res["_all"]["prompts"] == 3 and res["_all"]["lossless"] == 3 and res["humaneval"]["prompts"] == 2
    assert res["_all"]["mean_accept"] > 1.2  # the trained drafter's drafts land on these prompts too
    pair = registry.read_pair_file(drafter)
    assert pair.measured.startswith("CPU float32: accept ") and "lossless on all 3" in pair.measured
    assert f"{res['humaneval']['mean_accept']:.2f} humaneval" in pair.measured
    assert pair.reproduce.startswith("python ") and "--drafter" in pair.reproduce and pair.kind == "dflash"
    assert dict(pair.accept) == {d: round(res[d]["mean_accept"], 3) for d in ("humaneval", "mt-bench")}
