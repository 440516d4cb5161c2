"""`mlx-dspark distill` on a tiny target: it learns (acceptance rises well above a random
drafter's, measured through the real verify loop), it resumes exactly, it refuses bad input,
and its training forward is the inference forward."""

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
from fixtures import write_model

TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, tie=False, scale=1.0)
# Small, fast settings shared by the runs below (greedy answers: deterministic data).
FAST = [
    "--answer-tokens",
    "64",
    "--batch-size",
    "4",
    "--anchors",
    "16",
    "--layers",
    "1",
    "--markov-rank",
    "32",
    "--temperature",
    "0",
    "--lr",
    "2e-3",
    "--eval-samples",
    "4",
    "--eval-max-tokens",
    "48",
    "--save-every",
    "0",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("distill") / "target", "qwen3", **TINY)


def _cli(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "mlx_dspark", "distill", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def _accept(out: Path) -> dict:
    res = json.loads((out / "eval.json").read_text())["result"]
    return {d: r["mean_accept"] for d, r in res.items()}


@pytest.mark.slow
def test_distill_raises_acceptance_above_a_random_drafter(tiny, tmp_path):
    trained, random_ = tmp_path / "trained", tmp_path / "random"
    p = _cli(
        ["--model", str(tiny), "--out", str(trained), "--steps", "250", "--export", str(tmp_path / "small"), *FAST]
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "tok/s" in p.stderr and "ETA" in p.stderr  # the progress line
    # The same data, no training: the random-init drafter, through the same evaluation.
    random_.mkdir()
    shutil.copy(trained / "samples.jsonl", random_ / "samples.jsonl")
    p0 = _cli(["--model", str(tiny), "--out", str(random_), "--steps", "0", *FAST])
    assert p0.returncode == 0, p0.stderr[-3000:]
    a1, a0 = _accept(trained), _accept(random_)
    assert set(a1) == {"chat", "code", "math", "_all"}  # per domain (held-out built-in prompts)
    assert a1["_all"] >= a0["_all"] + 0.6 and a1["_all"] >= 1.4 * a0["_all"], (a0, a1)

    # DeepSpec layout, loaded by our loader (the evaluation above went through it too).
    cfg = json.loads((trained / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["markov_rank"] == 32
    assert cfg["enable_confidence_head"] and cfg["target_layer_ids"] == [0]
    names = set(mx.load(str(trained / "model.safetensors")))
    assert {
        "embed_tokens.weight",
        "lm_head.weight",
        "fc.weight",
        "markov_head.markov_w1.weight",
        "confidence_head.proj.weight",
        "layers.0.self_attn.q_proj.weight",
    } <= names
    small = set(mx.load(str(tmp_path / "small" / "model.safetensors")))
    assert small == names - {"embed_tokens.weight", "lm_head.weight"}
    from mlx_dspark.models.drafters import load_drafter
    from mlx_dspark.models.loading import load_target

    target, _ = load_target(str(tiny))
    d = load_drafter(str(tmp_path / "small"), target, bits=16)
    assert d.kind == "dspark" and d.bound == ["embed_tokens", "lm_head"]
    # The answer-token ranking (the draft vocabulary) is written and shipped with the export.
    rank = json.loads((trained / "draft_vocab.json").read_text())
    assert (tmp_path / "small" / "draft_vocab.json").read_text() == (trained / "draft_vocab.json").read_text()
    answers = [
        t
        for line in (trained / "samples.jsonl").read_text().splitlines()[1:]
        for r in [json.loads(line)]
        for t in r["ids"][r["n_prompt"] :]
    ]
    assert rank["tokens"] == len(answers) and set(rank["ids"]) == set(answers)
    assert rank["counts"] == sorted(rank["counts"], reverse=True)
    assert d.describe()["draft_vocab"] <= len(rank["ids"])


def _small_run(tiny, out, *, steps, save_every, prompts, answer_tokens, **kw):
    """DistillOptions of a short, deterministic run (greedy answers) on the tiny target."""
    from mlx_dspark.train.data import GenConfig
    from mlx_dspark.train.pipeline import DistillOptions
    from mlx_dspark.train.trainer import DistillConfig

    cfg = DistillConfig(
        layers=1,
        markov_rank=16,
        steps=steps,
        batch_size=2,
        anchors=4,
        save_every=save_every,
        lr=2e-3,
        gen=GenConfig(max_new_tokens=answer_tokens, batch_size=16),
    )
    return DistillOptions(
        model=str(tiny), out=str(out), max_train_prompts=prompts, evaluate=False, temperature=0.0, train=cfg, **kw
    )


def _assert_same_trained_weights(a_dir: Path, b_dir: Path) -> None:
    a = mx.load(str(a_dir / "train_state" / "trainable.safetensors"))
    b = mx.load(str(b_dir / "train_state" / "trainable.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert np.allclose(np.array(a[k]), np.array(b[k]), atol=1e-6), k


def _quiet(s: str) -> None:
    pass


def test_resume_continues_exactly(tiny, tmp_path):
    from mlx_dspark.train.pipeline import run_distill

    def opts(out, **kw):
        return _small_run(tiny, out, steps=12, save_every=4, prompts=3, answer_tokens=24, **kw)

    run_distill(opts(tmp_path / "full"), log=_quiet)

    class Stop(Exception):
        pass

    def crash(step):
        if step == 7:
            raise Stop

    with pytest.raises(Stop):
        run_distill(opts(tmp_path / "cut"), log=_quiet, on_step=crash)
    state = json.loads((tmp_path / "cut" / "train_state" / "state.json").read_text())
    assert state["step"] == 4  # the last periodic checkpoint
    from mlx_dspark.errors import UserError

    with pytest.raises(UserError, match="--resume"):
        run_distill(opts(tmp_path / "cut"), log=_quiet)
    steps = []
    run_distill(opts(tmp_path / "cut", resume=True), log=_quiet, on_step=steps.append)
    assert steps == list(range(5, 13))
    _assert_same_trained_weights(tmp_path / "full", tmp_path / "cut")


def _main(args: list[str]) -> int:
    from mlx_dspark.cli.main import main

    return main(["distill", *args])


def test_batched_answers_equal_one_at_a_time_greedy_and_stop_at_their_stop_token(tiny):
    """answer_batch (left-padded static batch, finished rows dropped as it thins) gives every
    prompt exactly the answer a plain one-sequence greedy loop gives: the same tokens, ending
    at the first stop token (kept) or at max_new."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    from mlx_dspark.models.loading import load_target
    from mlx_dspark.train import data as D

    target, tok = load_target(str(tiny))
    m = target.model
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, target.vocab_size - 8, size=int(n)).tolist() for n in rng.integers(3, 30, size=9)]

    def one(p, stops, n):
        cache = make_prompt_cache(m)
        logits = m(mx.array([p]), cache=cache)[:, -1]
        out = []
        for _ in range(n):
            t = int(mx.argmax(logits, axis=-1).item())
            out.append(t)
            if t in stops:
                break
            logits = m(mx.array([[t]]), cache=cache)[:, -1]
        return out

    free = [one(p, set(), 24) for p in prompts]
    # Stop tokens that the free answers do emit, at different depths, so rows finish at
    # different steps (and some never).
    stops = {free[0][3], free[1][9], free[2][15]}
    want = [one(p, stops, 24) for p in prompts]
    assert len({len(w) for w in want}) >= 3, want
    got = D.answer_batch(m, prompts, 24, make_sampler(temp=0.0), stops)
    assert got == want
    assert D.answer_batch(m, prompts, 24, make_sampler(temp=0.0), set()) == free


def test_a_terminated_run_saves_its_state_and_resumes_to_the_same_weights(tiny, tmp_path):
    """SIGTERM (a job's time limit, a kill) mid-training: the step finishes, the state is saved,
    distill stops with a clear message; --resume then ends where an uninterrupted run ends."""
    import signal

    from mlx_dspark.errors import UserError
    from mlx_dspark.train.pipeline import run_distill

    def opts(out, **kw):
        return _small_run(tiny, out, steps=9, save_every=0, prompts=2, answer_tokens=16, **kw)

    run_distill(opts(tmp_path / "full"), log=_quiet)

    def term(step):
        if step == 5:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(UserError, match=r"stopped at step 5/9.*--resume"):
        run_distill(opts(tmp_path / "cut"), log=_quiet, on_step=term)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handler is handed back
    state = json.loads((tmp_path / "cut" / "train_state" / "state.json").read_text())
    assert state["step"] == 5  # saved at the stop, not at the last periodic checkpoint (none)
    steps = []
    run_distill(opts(tmp_path / "cut", resume=True), log=_quiet, on_step=steps.append)
    assert steps == list(range(6, 10))
    _assert_same_trained_weights(tmp_path / "full", tmp_path / "cut")

    # A SIGTERM while the last checkpoint is being written waits for it: the drafter is there (a
    # subprocess: without that, the signal's default action would end this test run).
    script = (
        "import os, signal, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import mlx_dspark.train.checkpoint as ck\n"
        "from test_distill import _small_run\n"
        "from mlx_dspark.train.pipeline import run_distill\n"
        "real = ck.save_drafter\n"
        "def save(*a, **k):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return real(*a, **k)\n"
        "ck.save_drafter = save\n"
        f"run_distill(_small_run(sys.argv[1], sys.argv[2], steps=3, save_every=0, prompts=2, answer_tokens=8), "
        "log=lambda s: None)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", script, str(tiny), str(tmp_path / "last")], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert (tmp_path / "last" / "model.safetensors").is_file() and (tmp_path / "last" / "config.json").is_file()


def test_init_from_starts_from_a_drafter_and_keeps_its_architecture(tiny, tmp_path):
    """--init-from: the compact export of one run is the exact starting point of the next (its
    architecture taken from its config, no flags), which then trains on; a larger --layers grows
    it into a deeper drafter that drafts the same at first; a disagreeing architecture flag and a
    checkpoint for another target are refused before any answer is made."""
    from mlx_dspark.errors import UserError
    from mlx_dspark.train.pipeline import run_distill

    first = _small_run(
        tiny, tmp_path / "a", steps=30, save_every=0, prompts=2, answer_tokens=16, export=str(tmp_path / "a_x")
    )
    run_distill(first, log=_quiet)

    def warm(out, steps, **arch):
        o = _small_run(tiny, out, steps=steps, save_every=0, prompts=2, answer_tokens=16)
        o.train.layers, o.train.markov_rank = None, None  # nothing said: the checkpoint's
        o.train.init_from = str(tmp_path / "a_x")
        for k, v in arch.items():
            setattr(o.train, k, v)
        return o

    run_distill(warm(tmp_path / "b", 0), log=_quiet)
    cfg_a = json.loads((tmp_path / "a" / "config.json").read_text())
    cfg_b = json.loads((tmp_path / "b" / "config.json").read_text())
    for k in ("num_hidden_layers", "markov_rank", "block_size", "target_layer_ids", "mask_token_id"):
        assert cfg_b[k] == cfg_a[k], k
    assert cfg_b["mlx_dspark_distill"]["init_from"] == str(tmp_path / "a_x")
    wa, wb = mx.load(str(tmp_path / "a" / "model.safetensors")), mx.load(str(tmp_path / "b" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:  # bf16 -> float32 -> bf16 is exact
        assert mx.array_equal(wa[k], wb[k]).item(), k
    # The full checkpoint (with its embed_tokens / lm_head copies) starts the same drafter.
    o = warm(tmp_path / "b_full", 0)
    o.train.init_from = str(tmp_path / "a")
    run_distill(o, log=_quiet)
    wf = mx.load(str(tmp_path / "b_full" / "model.safetensors"))
    assert all(mx.array_equal(wa[k], wf[k]).item() for k in wa)

    # Trained further, it starts where the first run ended, not where a random init starts.
    run_distill(warm(tmp_path / "c", 5), log=_quiet)
    first_loss = [
        h["loss"] for h in map(json.loads, (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()) if "loss" in h
    ]
    warm_loss = [
        h["loss"] for h in map(json.loads, (tmp_path / "c" / "train_log.jsonl").read_text().splitlines()) if "loss" in h
    ]
    # (nearer the first run's last loss than its first: a random init would start at the first)
    assert warm_loss[0] < first_loss[0] - 0.5 * (first_loss[0] - first_loss[-1]), (first_loss, warm_loss)

    with pytest.raises(UserError, match="--markov-rank 8 disagrees with --init-from"):
        run_distill(warm(tmp_path / "d", 1, markov_rank=8), log=_quiet)
    assert not (tmp_path / "d" / "samples.jsonl").exists()  # refused before generating

    # A deeper drafter grows from it: the same layers, then one that starts as the identity, so
    # its first draft equals the checkpoint's exactly.
    run_distill(warm(tmp_path / "g", 0, layers=2), log=_quiet)
    cfg_g = json.loads((tmp_path / "g" / "config.json").read_text())
    assert cfg_g["num_hidden_layers"] == 2 and cfg_g["mlx_dspark_distill"]["grown_from_layers"] == 1
    wg = mx.load(str(tmp_path / "g" / "model.safetensors"))
    assert all(mx.array_equal(wa[k], wg[k]).item() for k in wa)
    for k in ("layers.1.self_attn.o_proj.weight", "layers.1.mlp.down_proj.weight"):
        assert not mx.any(wg[k]).item(), k
    assert mx.any(wg["layers.1.self_attn.q_proj.weight"]).item()  # the rest of the new layer is a fresh init
    from mlx_dspark.models.drafters import load_drafter
    from mlx_dspark.models.loading import load_target

    target, _ = load_target(str(tiny))
    d_a, d_g = (load_drafter(str(tmp_path / n), target, bits=16) for n in ("a", "g"))
    ids = mx.array(np.random.default_rng(1).integers(0, target.vocab_size - 8, size=(1, 12)).astype(np.int32))
    taps = target.forward(ids, None, taps=d_a.spec.taps).hidden[0]
    h_a = d_a.block_hidden(int(ids[0, 11]), taps[:11], d_a.new_state())
    h_g = d_g.block_hidden(int(ids[0, 11]), taps[:11], d_g.new_state())
    assert mx.array_equal(h_a, h_g).item()
    # ... and a shallower one is refused: layers cannot be dropped.
    o = warm(tmp_path / "g2", 1, layers=1)
    o.train.init_from = str(tmp_path / "g")
    with pytest.raises(UserError, match="--layers 1 disagrees with --init-from .*or make it deeper"):
        run_distill(o, log=_quiet)
    other = write_model(tmp_path / "other", "qwen3", **dict(TINY, hidden=32, heads=2, kv_heads=1))
    o = warm(tmp_path / "e", 1)
    o.model = str(other)
    with pytest.raises(UserError, match="hidden size"):
        run_distill(o, log=_quiet)


def test_bad_input_gets_a_clear_error(tiny, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert _main(["--model", str(tiny), "--out", str(tmp_path / "o1"), "--prompts", str(empty)]) == 2
    assert "holds no prompts" in capsys.readouterr().err

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["fine"]}\n{"text": "no turns"}\n')
    assert _main(["--model", str(tiny), "--out", str(tmp_path / "o2"), "--prompts", str(bad)]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err

    for taps, words in (("0,5", "out of range"), ("1", "final layer")):
        assert _main(["--model", str(tiny), "--out", str(tmp_path / f"o{taps}"), "--taps", taps]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, err

    plain = write_model(tmp_path / "plain", "qwen3", **TINY)
    tc = json.loads((plain / "tokenizer_config.json").read_text())
    tc.pop("chat_template")
    (plain / "tokenizer_config.json").write_text(json.dumps(tc))
    assert _main(["--model", str(plain), "--out", str(tmp_path / "o3")]) == 2
    err = capsys.readouterr().err
    assert "no chat template" in err and "--no-chat-template" in err

    (tmp_path / "o4").mkdir()
    (tmp_path / "o4" / "keep.txt").write_text("x")
    assert _main(["--model", str(tiny), "--out", str(tmp_path / "o4")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert _main(["--model", str(tiny), "--out", str(tmp_path / "o5"), "--resume"]) == 2
    assert "no interrupted training run" in capsys.readouterr().err


def test_a_base_model_distills_on_raw_prompts(tmp_path):
    """--no-chat-template (a base model: no chat template): the target continues each prompt's raw
    text, as `generate --no-chat-template` feeds it; the drafter trains and is evaluated on those
    prompts, and its config says so. The answers of a templated run are not reused for it."""
    from mlx_dspark.api import encode_prompt
    from mlx_dspark.models.loading import load_target
    from mlx_dspark.train import data as D
    from mlx_dspark.train.data import load_samples
    from mlx_dspark.train.pipeline import run_distill

    plain = write_model(tmp_path / "plain", "qwen3", **TINY)
    tc = json.loads((plain / "tokenizer_config.json").read_text())
    tc.pop("chat_template")
    (plain / "tokenizer_config.json").write_text(json.dumps(tc))
    o = _small_run(plain, tmp_path / "raw", steps=3, save_every=0, prompts=2, answer_tokens=12)
    o.train.gen.chat_template, o.evaluate, o.eval_samples, o.eval_max_tokens = False, True, 1, 8
    summary = run_distill(o, log=_quiet)
    assert summary["eval"]["_all"]["prompts"] > 0
    cfg = json.loads((tmp_path / "raw" / "config.json").read_text())
    assert cfg["mlx_dspark_distill"]["chat_template"] is False

    _, tok = load_target(str(plain))
    lines = (tmp_path / "raw" / "samples.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines[1:]]
    prompts = [p.text for p in D.load_prompts([], builtin=True)]
    raw = {tuple(encode_prompt(tok, t, chat_template=False)) for t in prompts}
    assert rows and all(tuple(r["ids"][: r["n_prompt"]]) in raw for r in rows)

    assert load_samples(tmp_path / "raw" / "samples.jsonl", json.loads(lines[0])["key"]) is not None
    g, every = o.train.gen, D.load_prompts([], builtin=True)
    key_raw = D.data_key(str(plain), every, g)
    g.chat_template = True
    assert D.data_key(str(plain), every, g) != key_raw
    assert "chat_template" not in g.key()  # templated runs keep the keys they had before the switch

    # --raw-code: each prompt as raw code (no template either): the answers continue that code.
    o = _small_run(plain, tmp_path / "code", steps=1, save_every=0, prompts=2, answer_tokens=8)
    o.raw_code = True
    run_distill(o, log=_quiet)
    meta = json.loads((tmp_path / "code" / "config.json").read_text())["mlx_dspark_distill"]
    assert meta["prompts_as"] == "raw code" and meta["chat_template"] is False
    coded = {tuple(encode_prompt(tok, D.raw_code(t), chat_template=False)) for t in prompts}
    rows = [json.loads(x) for x in (tmp_path / "code" / "samples.jsonl").read_text().splitlines()[1:]]
    assert rows and all(tuple(r["ids"][: r["n_prompt"]]) in coded for r in rows)


def test_raw_code_is_the_code_block_else_the_request_as_comments():
    from mlx_dspark.train.data import raw_code

    he = 'Write a solution:\n```python\ndef f(x):\n    """Double x."""\n\n```\nThanks'
    assert raw_code(he) == 'def f(x):\n    """Double x."""\n'
    assert raw_code("Write a function to sort a list.\nUse sorted.") == (
        "# Write a function to sort a list.\n# Use sorted.\n"
    )
    assert raw_code("Empty block:\n```\n\n```") == "# Empty block:\n# ```\n#\n# ```\n"


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
    o = _small_run(
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
    assert _main(["--model", str(tiny), "--out", str(tmp_path / "bad"), "--train-vocab", "some"]) == 2


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
        )
        == 0
    )
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
