"""`mlx-dspark distill`'s other halves: the training forward is the inference forward, the export
(bf16 or quantized) reads back everywhere, training on the draft vocabulary, the prompt files, the
loss masks and schedule, and the shipped reference drafter."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from distill_fixtures import TINY, distill_main, small_run
from fixtures import write_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("distill") / "target", "qwen3", **TINY)


def test_training_forward_is_the_inference_forward(tiny, tmp_path):
    """Many blocks at once with the block mask == the drafter's cached one-block forward."""
    from mlx_dspark.models.drafters import load_drafter
    from mlx_dspark.models.loading import load_target
    from mlx_dspark.train import checkpoint as ck
    from mlx_dspark.train.forward import block_hidden
    from mlx_dspark.train.trainer import DistillConfig, build_model

    target, tok = load_target(str(tiny))
    cfg = DistillConfig(layers=2, block_size=5, markov_rank=8, taps=[0])
    model, hcfg, spec = build_model(target, tok, cfg, tmp_path / "d")
    ck.init_weights(model, seed=3, std=0.2)  # larger weights: attention patterns matter
    ck.save_drafter(model, hcfg, tmp_path / "d")
    d = load_drafter(str(tmp_path / "d"), target, bits=16)
    rng = np.random.default_rng(0)
    ids = mx.array(rng.integers(0, target.vocab_size - 8, size=(2, 20)).astype(np.int32))
    taps = target.forward(ids, None, taps=spec.taps).hidden
    anchors = np.array([[0, 4, 11, 19], [2, 3, 9, 15]], np.int32)
    m = d.model  # the loaded module tree itself (bf16-rounded weights, as the loader holds them)
    if not hasattr(m, "embed_tokens"):
        m.embed_tokens = target.embed_tokens  # bound to the target's identical matrix
    hb = block_hidden(m, taps, ids, mx.array(anchors), cfg.block_size, spec.mask_token_id)
    for s in range(2):
        for a, p in enumerate(anchors[s]):
            ref = d.block_hidden(int(ids[s, p]), taps[s, :p] if p else None, d.new_state())
            assert float(mx.abs(ref - hb[s, a]).max()) < 1e-4 * (1 + float(mx.abs(ref).max()))


def test_export_stores_a_drafter_quantized_that_every_loader_reads(tiny, tmp_path):
    """`python -m mlx_dspark.train.export --bits 8`: the matrices stored quantized (MLX affine),
    a "quantization" block in config.json; the loader, the shape check and --init-from read it back
    dequantized (close to the bf16 export), and a block without its config is refused."""
    from mlx_dspark.errors import UserError
    from mlx_dspark.models.checkpoints import read_weights, tensor_shapes
    from mlx_dspark.models.drafters import load_drafter
    from mlx_dspark.models.loading import load_target
    from mlx_dspark.train import checkpoint as ck
    from mlx_dspark.train.export import main as export_main
    from mlx_dspark.train.trainer import DistillConfig, build_model, load_init_weights

    target, tok = load_target(str(tiny))
    cfg = DistillConfig(layers=2, block_size=5, markov_rank=8, taps=[0])
    model, hcfg, _ = build_model(target, tok, cfg, tmp_path / "full")
    ck.init_weights(model, seed=5, std=0.2)
    ck.save_drafter(model, hcfg, tmp_path / "full")
    assert export_main([str(tmp_path / "full"), str(tmp_path / "bf16")]) == 0
    assert export_main([str(tmp_path / "full"), str(tmp_path / "q8"), "--bits", "8"]) == 0
    q8 = tmp_path / "q8"
    assert json.loads((q8 / "config.json").read_text())["quantization"] == {
        "group_size": 64,
        "bits": 8,
        "mode": "affine",
    }
    raw = mx.load(str(q8 / "model.safetensors"))
    assert raw["layers.0.mlp.down_proj.weight"].dtype == mx.uint32 and "fc.scales" in raw
    assert "markov_head.markov_w1.scales" not in raw and "norm.scales" not in raw  # rank 8, 1-D: kept as they are
    assert (q8 / "model.safetensors").stat().st_size < 0.8 * (tmp_path / "bf16" / "model.safetensors").stat().st_size
    assert tensor_shapes(q8) == tensor_shapes(tmp_path / "bf16")
    plain, deq = read_weights(tmp_path / "bf16"), read_weights(q8)
    assert plain.keys() == deq.keys()
    for k, v in plain.items():
        err = float(mx.abs(v.astype(mx.float32) - deq[k].astype(mx.float32)).max())
        assert err <= 0.02 * float(mx.abs(v.astype(mx.float32)).max()) + 1e-6, k

    d_b, d_q = (load_drafter(str(tmp_path / n), target, bits=16) for n in ("bf16", "q8"))
    ids = mx.array(np.random.default_rng(2).integers(0, target.vocab_size - 8, size=(1, 10)).astype(np.int32))
    taps = target.forward(ids, None, taps=d_b.spec.taps).hidden[0]
    h_b = d_b.block_hidden(int(ids[0, 9]), taps[:9], d_b.new_state())
    h_q = d_q.block_hidden(int(ids[0, 9]), taps[:9], d_q.new_state())
    assert float(mx.abs(h_b - h_q).max()) < 0.05 * float(mx.abs(h_b).max())
    assert load_drafter(str(q8), target, bits=4).describe()["bits"] == 4  # and quantized again at load

    fresh, _, _ = build_model(
        target, tok, DistillConfig(layers=2, block_size=5, markov_rank=8, taps=[0]), tmp_path / "warm"
    )
    load_init_weights(fresh, q8)  # --init-from a stored-quantized drafter
    assert mx.allclose(fresh.fc.weight, deq["fc.weight"].astype(mx.float32)).item()

    c = json.loads((q8 / "config.json").read_text())
    del c["quantization"]
    (q8 / "config.json").write_text(json.dumps(c))
    with pytest.raises(UserError, match="stores quantized tensors"):
        load_drafter(str(q8), target, bits=16)


def test_training_on_the_draft_vocabulary_is_the_loss_of_drafting_from_it(tiny, tmp_path):
    """--train-vocab: over every token it is the full loss; over a subset S it is the loss of the
    drafter that drafts from S (q = 0 outside, as at inference): L1 against the target's full
    softmax, no CE for labels outside S, and no gradient into Markov rows outside S."""
    from mlx.utils import tree_flatten

    from mlx_dspark.models.loading import load_target
    from mlx_dspark.train import checkpoint as ck
    from mlx_dspark.train.losses import LossWeights, TrainVocab, block_loss
    from mlx_dspark.train.trainer import DistillConfig, build_model

    target, tok = load_target(str(tiny))
    V = target.vocab_size
    model, _, _ = build_model(target, tok, DistillConfig(layers=1, block_size=4, markov_rank=8, taps=[0]), tmp_path)
    ck.init_weights(model, seed=5, std=0.3)
    rng = np.random.default_rng(1)
    N, B, H = 6, 4, target.hidden_size
    hidden = mx.array(rng.normal(size=(N, B, H)).astype(np.float32))
    prev = mx.array(rng.integers(0, V, size=(N, B)).astype(np.int32))
    labels = mx.array(rng.integers(0, V, size=(N, B)).astype(np.int32))
    mask = mx.array(np.cumprod(rng.random((N, B)) < 0.9, axis=1).astype(np.float32))
    tlog = mx.array(rng.normal(size=(N, B, V)).astype(np.float32) * 3)
    w = LossWeights()

    every = TrainVocab.of(range(V), V)
    full_loss, full_m = block_loss(model, hidden, prev, labels, mask, tlog, w)
    all_loss, all_m = block_loss(model, hidden, prev, labels, mask, every.target_terms(tlog), w, vocab=every)
    assert abs(float(full_loss) - float(all_loss)) < 1e-4 * abs(float(full_loss))
    for k in ("ce", "tv", "conf", "tau", "top1"):
        assert abs(float(full_m[k]) - float(all_m[k])) < 1e-4 * (1 + abs(float(full_m[k]))), k

    keep = sorted(rng.choice(V, size=V // 3, replace=False).tolist())
    sub = TrainVocab.of(keep, V)
    loss, m = block_loss(model, hidden, prev, labels, mask, sub.target_terms(tlog), w, vocab=sub)
    # The same loss from full-vocabulary tensors, the draft restricted by -inf outside S.
    from mlx_dspark.train.losses import draft_logits

    z = draft_logits(model, hidden, prev, None)
    outside = np.ones(V, bool)
    outside[keep] = False
    z = mx.where(mx.array(outside), -mx.inf, z)
    q = mx.softmax(z, axis=-1)
    l1 = mx.abs(q - mx.softmax(tlog, axis=-1)).sum(-1)
    pos_w = mx.exp(-mx.arange(B, dtype=mx.float32) / w.gamma)
    wt = mask * pos_w
    W = wt.sum()
    lab_in = mx.array(~outside)[labels]
    ce = -mx.where(lab_in, mx.log(mx.take_along_axis(q, labels[..., None], -1)[..., 0]), 0.0)
    assert abs(float((wt * l1).sum() / W) - float(m["tv"])) < 1e-4
    assert abs(float((wt * ce).sum() / W) - float(m["ce"])) < 1e-3
    assert 0 < float(m["tv"]) < 2

    def f(mod):
        return block_loss(mod, hidden, prev, labels, mask, sub.target_terms(tlog), w, vocab=sub)[0]

    import mlx.nn as nn

    g = dict(tree_flatten(nn.value_and_grad(model, f)(model)[1]))["markov_head.markov_w2.weight"]
    rows = np.abs(np.array(g)).sum(axis=1)
    assert rows[outside].max() == 0 and rows[keep].min() > 0


def test_distill_trains_on_the_draft_vocabulary(tiny, tmp_path):
    """End to end: --train-vocab auto trains (its L1 falls), the resulting drafter loads and
    drafts from the same subset; a bad value is refused. The target is a peaked one, as language
    models are (a near-uniform random one puts most of its mass outside any answer-token subset)."""
    from mlx_dspark.models.drafters import load_drafter
    from mlx_dspark.models.loading import load_target
    from mlx_dspark.train.pipeline import run_distill

    peaked = write_model(tmp_path / "peaked", "qwen3", **dict(TINY, scale=6.0))
    said = []
    o = small_run(
        peaked, tmp_path / "v", steps=100, save_every=0, prompts=3, answer_tokens=24, export=str(tmp_path / "v_x")
    )
    o.train.train_vocab, o.train.anchors, o.train.batch_size = "auto", 16, 4
    o.export_bits = 8  # (--export-bits 8: the drafter below loads from a stored-quantized export)
    run_distill(o, log=said.append)
    shipped = json.loads((tmp_path / "v_x" / "config.json").read_text())
    assert shipped["quantization"]["bits"] == 8 and shipped["mlx_dspark_distill"]["train_vocab"] == "auto"
    target, _ = load_target(str(peaked))
    d = load_drafter(str(tmp_path / "v_x"), target, bits=16, draft_vocab="auto")
    k = int(d.vocab_ids.size)
    assert 0 < k < target.vocab_size
    assert any(f"training on the {k} answer tokens" in s for s in said), said  # the subset it drafts from
    hist = [h for h in map(json.loads, (tmp_path / "v" / "train_log.jsonl").read_text().splitlines()) if "loss" in h]
    late = np.mean([h["tv"] for h in hist[-3:]])  # single batches are noisy
    assert late < 0.8 * hist[0]["tv"], [h["tv"] for h in hist]
    assert distill_main(["--model", str(tiny), "--out", str(tmp_path / "bad"), "--train-vocab", "some"]) == 2


def test_make_prompts_writes_prompt_files_distill_reads(tmp_path):
    """bench/make_prompts.py (more training prompts for the reference drafter): valid prompt files,
    the same for the same seed, none of them an eval prompt, code prompts from real signatures."""
    import importlib.util

    from mlx_dspark.train.data import read_prompt_file

    spec = importlib.util.spec_from_file_location("make_prompts", Path(__file__).parents[1] / "bench/make_prompts.py")
    mp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mp)
    evald = tmp_path / "eval"
    evald.mkdir()
    first = mp.chat_prompts(1, __import__("random").Random(1))[0]  # what seed 0's chat file starts with
    (evald / "x.jsonl").write_text(json.dumps({"turns": [first]}) + "\n")
    for out in ("a", "b"):
        assert mp.main(["--out", str(tmp_path / out), "--code", "120", "--chat", "80", "--eval-dir", str(evald)]) == 0
    code = read_prompt_file(tmp_path / "a" / "code-stdlib.jsonl")
    chat = read_prompt_file(tmp_path / "a" / "chat-topics.jsonl")
    assert len(code) == 120 and len(chat) == 79  # the one equal to an "eval" prompt is left out
    assert first not in {p.text for p in chat}
    assert (tmp_path / "a" / "code-stdlib.jsonl").read_text() == (tmp_path / "b" / "code-stdlib.jsonl").read_text()
    stubs = [p.text for p in code if "```python" in p.text]
    assert stubs and all("def " in t and '"""' in t for t in stubs)
    assert len({p.text for p in code}) == len(code)
    assert (
        mp.main(
            ["--out", str(tmp_path / "c"), "--code", "30", "--chat", "1", "--packages", "pip", "--chat-kinds", "60"]
            + ["--code-files", "40"]
        )
        == 0
    )
    files = [p.text for p in read_prompt_file(tmp_path / "c" / "code-files.jsonl")]
    assert len(files) == len(set(files)) == 40
    from mlx_dspark.train.data import raw_code

    for t in files:  # as raw code: the excerpt itself, from a definition on, a real file's lines
        src = raw_code(t)
        assert src.lstrip().startswith(("def ", "class ", "@")) and 200 <= len(src.strip()) <= 2500
        assert src.count("\n") >= 4
    pip_code = read_prompt_file(tmp_path / "c" / "code-packages.jsonl")
    assert len(pip_code) == 30 and not {p.text for p in pip_code} & {p.text for p in code}
    kinds = [p.text for p in read_prompt_file(tmp_path / "c" / "chat-kinds.jsonl")]
    assert len(kinds) == len(set(kinds)) == 60
    assert any("Pretend you are" in t or "role" in t or "character" in t for t in kinds)  # role-play
    assert any(t.startswith("Solve for x") or "derivative" in t or "probability" in t for t in kinds)  # maths
    assert not any("{" in t.split("\n")[0] and "}" in t.split("\n")[0] for t in kinds)  # every slot filled
    with pytest.raises(SystemExit, match="not installed"):
        mp.main(["--out", str(tmp_path / "d"), "--packages", "no_such_package_here"])


def test_loss_masks_and_schedule():
    from mlx_dspark.train.losses import anchor_targets
    from mlx_dspark.train.trainer import lr_at

    toks = list(range(100, 112))  # 12 tokens, the answer starts at 5
    lab, prev, m = anchor_targets(toks, 5, 12, np.array([5, 9]), 4)
    assert lab.tolist() == [[106, 107, 108, 109], [110, 111, 111, 111]]
    assert prev.tolist() == [[105, 106, 107, 108], [109, 110, 111, 111]]
    assert m.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]  # past the end: masked, cumulatively
    assert lr_at(0, 100, 1.0, 0.04) == pytest.approx(0.25)
    assert lr_at(3, 100, 1.0, 0.04) == pytest.approx(1.0)
    assert lr_at(99, 100, 1.0, 0.04) < 1e-3 and lr_at(51, 100, 1.0, 0.04) == pytest.approx(0.5, abs=0.02)


def test_the_shipped_reference_drafter_is_registered_and_loadable():
    """The SmolLM2-135M-Instruct drafter in the package: registered for the demo target (any
    storage of it), <= 30 MB, and a checkpoint our loader accepts (compact: embed/lm_head bound)."""
    from mlx_dspark.models import registry
    from mlx_dspark.models.checkpoints import build_spec, read_config, tensor_shapes

    pairs = registry.pairs_for_name("SmolLM2-135M-Instruct.Q4_1.gguf", "dspark")
    assert pairs and pairs == registry.pairs_for_name("HuggingFaceTB/SmolLM2-135M-Instruct", "dspark")
    path = Path(pairs[0].drafter)
    assert sum(f.stat().st_size for f in path.iterdir()) <= 30e6
    spec = build_spec(path, read_config(path), tensor_shapes(path))
    assert spec.packaging == "deepspec-dspark" and spec.vocab_size == 49152 and spec.backbone.hidden_size == 576
    assert spec.config["embeddings_from_target"] and "lm_head.weight" not in spec.shapes
    assert max(spec.taps) <= 28 and spec.num_target_layers == 30
    from mlx_dspark.models.draft_vocab import select

    assert 4000 < len(select(path, "auto", 49152)) < 16384  # a draft vocabulary ships with it
