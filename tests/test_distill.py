"""`mlx-dspark distill` on a tiny target: it learns (acceptance rises well above a random
drafter's, measured through the real verify loop), it resumes exactly, it starts from a drafter,
it refuses bad input, and a base model distills on raw prompts. test_distill_export.py has the
rest."""

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
from distill_fixtures import FAST, TINY, accept, assert_same_trained_weights, cli, distill_main, quiet, small_run
from fixtures import write_model

from mlx_dspark.errors import UserError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("distill") / "target", "qwen3", **TINY)


@pytest.mark.slow
def test_distill_raises_acceptance_above_a_random_drafter(tiny, tmp_path):
    trained, random_ = tmp_path / "trained", tmp_path / "random"
    p = cli(["--model", str(tiny), "--out", str(trained), "--steps", "250", "--export", str(tmp_path / "small"), *FAST])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "tok/s" in p.stderr and "ETA" in p.stderr  # the progress line
    # The same data, no training: the random-init drafter, through the same evaluation.
    random_.mkdir()
    shutil.copy(trained / "samples.jsonl", random_ / "samples.jsonl")
    p0 = cli(["--model", str(tiny), "--out", str(random_), "--steps", "0", *FAST])
    assert p0.returncode == 0, p0.stderr[-3000:]
    a1, a0 = accept(trained), accept(random_)
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


def test_resume_continues_exactly(tiny, tmp_path):
    from mlx_dspark.train.pipeline import run_distill

    def opts(out, **kw):
        return small_run(tiny, out, steps=12, save_every=4, prompts=3, answer_tokens=24, **kw)

    run_distill(opts(tmp_path / "full"), log=quiet)

    class Stop(Exception):
        pass

    def crash(step):
        if step == 7:
            raise Stop

    with pytest.raises(Stop):
        run_distill(opts(tmp_path / "cut"), log=quiet, on_step=crash)
    state = json.loads((tmp_path / "cut" / "train_state" / "state.json").read_text())
    assert state["step"] == 4  # the last periodic checkpoint
    from mlx_dspark.errors import UserError

    with pytest.raises(UserError, match="--resume"):
        run_distill(opts(tmp_path / "cut"), log=quiet)
    steps = []
    run_distill(opts(tmp_path / "cut", resume=True), log=quiet, on_step=steps.append)
    assert steps == list(range(5, 13))
    assert_same_trained_weights(tmp_path / "full", tmp_path / "cut")


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


def test_answers_end_where_they_start_to_loop(tiny):
    """--cut-loops N: an answer ends before the third occurrence of one of its N-grams (its first
    two kept), in the batch exactly as one at a time; an answer that never loops is untouched;
    the data key changes with it, and never for runs without it."""
    from mlx_lm.sample_utils import make_sampler

    from mlx_dspark.models.loading import load_target
    from mlx_dspark.train import data as D

    target, _ = load_target(str(tiny))
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, target.vocab_size - 8, size=int(n)).tolist() for n in rng.integers(3, 30, size=12)]
    greedy = make_sampler(temp=0.0)
    free = D.answer_batch(target.model, prompts, 48, greedy, set())
    n = 3

    def first_third(ans):  # reference: the start of the first third occurrence of an n-gram
        seen = {}
        for i in range(len(ans) - n + 1):
            g = tuple(ans[i : i + n])
            seen[g] = seen.get(g, 0) + 1
            if seen[g] == 3:
                return i
        return None

    cuts = [first_third(a) for a in free]
    assert any(c is not None for c in cuts) and any(c is None for c in cuts), cuts  # the fixture loops, sometimes
    got = D.answer_batch(target.model, prompts, 48, greedy, set(), cut_loops=n)
    assert got == [a if c is None else a[:c] for a, c in zip(free, cuts)]
    assert [D.answer_batch(target.model, [p], 48, greedy, set(), cut_loops=n)[0] for p in prompts[:4]] == got[:4]

    g = D.GenConfig()
    assert "cut_loops" not in g.key()  # the keys of runs made before the option existed
    assert D.data_key("m", [], D.GenConfig(cut_loops=8)) != D.data_key("m", [], g)
    with pytest.raises(UserError, match="at least 2"):
        D.LoopCut(1)


def test_answers_past_a_sliding_window_are_cut_to_it_on_a_gpu(tmp_path, monkeypatch):
    """A sliding-window target's window is read from its own cache; on a GPU the training answers
    are cut to it (MLX CUDA crashed on longer windowed training forwards), on the CPU they stay whole."""
    import mlx.core as mx

    from mlx_dspark.models.loading import load_target
    from mlx_dspark.train import data as D
    from mlx_dspark.train.pipeline import _fit_window

    gemma, _ = load_target(str(write_model(tmp_path / "g", "gemma3_text", layers=2, hidden=64)))
    dense, _ = load_target(str(write_model(tmp_path / "q", "qwen3", **TINY)))
    assert D.sliding_window(gemma.model) == 8 and D.sliding_window(dense.model) is None
    samples = [D.Sample(list(range(20)), 4, "code"), D.Sample(list(range(7)), 3, "code"), D.Sample([1] * 12, 7, "chat")]
    said = []
    assert _fit_window(samples, gemma, said.append) == samples and not said  # the CPU: whole
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    assert _fit_window(samples, dense, said.append) == samples and not said  # no window: whole
    got = _fit_window(samples, gemma, said.append)
    assert [(s.ids, s.n_prompt) for s in got] == [(list(range(8)), 4), (list(range(7)), 3)]  # 1 answer token: dropped
    assert "2 answers run past" in said[0] and "window of 8" in said[0] and "1 left" in said[0]


def test_a_terminated_run_saves_its_state_and_resumes_to_the_same_weights(tiny, tmp_path):
    """SIGTERM (a job's time limit, a kill) mid-training: the step finishes, the state is saved,
    distill stops with a clear message; --resume then ends where an uninterrupted run ends."""
    import signal

    from mlx_dspark.errors import UserError
    from mlx_dspark.train.pipeline import run_distill

    def opts(out, **kw):
        return small_run(tiny, out, steps=9, save_every=0, prompts=2, answer_tokens=16, **kw)

    run_distill(opts(tmp_path / "full"), log=quiet)

    def term(step):
        if step == 5:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(UserError, match=r"stopped at step 5/9.*--resume"):
        run_distill(opts(tmp_path / "cut"), log=quiet, on_step=term)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handler is handed back
    state = json.loads((tmp_path / "cut" / "train_state" / "state.json").read_text())
    assert state["step"] == 5  # saved at the stop, not at the last periodic checkpoint (none)
    steps = []
    run_distill(opts(tmp_path / "cut", resume=True), log=quiet, on_step=steps.append)
    assert steps == list(range(6, 10))
    assert_same_trained_weights(tmp_path / "full", tmp_path / "cut")

    # A SIGTERM while the last checkpoint is being written waits for it: the drafter is there (a
    # subprocess: without that, the signal's default action would end this test run).
    script = (
        "import os, signal, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import mlx_dspark.train.checkpoint as ck\n"
        "from distill_fixtures import small_run\n"
        "from mlx_dspark.train.pipeline import run_distill\n"
        "real = ck.save_drafter\n"
        "def save(*a, **k):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return real(*a, **k)\n"
        "ck.save_drafter = save\n"
        f"run_distill(small_run(sys.argv[1], sys.argv[2], steps=3, save_every=0, prompts=2, answer_tokens=8), "
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

    first = small_run(
        tiny, tmp_path / "a", steps=30, save_every=0, prompts=2, answer_tokens=16, export=str(tmp_path / "a_x")
    )
    run_distill(first, log=quiet)

    def warm(out, steps, **arch):
        o = small_run(tiny, out, steps=steps, save_every=0, prompts=2, answer_tokens=16)
        o.train.layers, o.train.markov_rank = None, None  # nothing said: the checkpoint's
        o.train.init_from = str(tmp_path / "a_x")
        for k, v in arch.items():
            setattr(o.train, k, v)
        return o

    run_distill(warm(tmp_path / "b", 0), log=quiet)
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
    run_distill(o, log=quiet)
    wf = mx.load(str(tmp_path / "b_full" / "model.safetensors"))
    assert all(mx.array_equal(wa[k], wf[k]).item() for k in wa)

    # Trained further, it starts where the first run ended, not where a random init starts.
    run_distill(warm(tmp_path / "c", 5), log=quiet)
    first_loss = [
        h["loss"] for h in map(json.loads, (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()) if "loss" in h
    ]
    warm_loss = [
        h["loss"] for h in map(json.loads, (tmp_path / "c" / "train_log.jsonl").read_text().splitlines()) if "loss" in h
    ]
    # (nearer the first run's last loss than its first: a random init would start at the first)
    assert warm_loss[0] < first_loss[0] - 0.5 * (first_loss[0] - first_loss[-1]), (first_loss, warm_loss)

    with pytest.raises(UserError, match="--markov-rank 8 disagrees with --init-from"):
        run_distill(warm(tmp_path / "d", 1, markov_rank=8), log=quiet)
    assert not (tmp_path / "d" / "samples.jsonl").exists()  # refused before generating

    # A deeper drafter grows from it: the same layers, then one that starts as the identity, so
    # its first draft equals the checkpoint's exactly.
    run_distill(warm(tmp_path / "g", 0, layers=2), log=quiet)
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
        run_distill(o, log=quiet)
    other = write_model(tmp_path / "other", "qwen3", **dict(TINY, hidden=32, heads=2, kv_heads=1))
    o = warm(tmp_path / "e", 1)
    o.model = str(other)
    with pytest.raises(UserError, match="hidden size"):
        run_distill(o, log=quiet)


def test_bad_input_gets_a_clear_error(tiny, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert distill_main(["--model", str(tiny), "--out", str(tmp_path / "o1"), "--prompts", str(empty)]) == 2
    assert "holds no prompts" in capsys.readouterr().err

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["fine"]}\n{"text": "no turns"}\n')
    assert distill_main(["--model", str(tiny), "--out", str(tmp_path / "o2"), "--prompts", str(bad)]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err

    for taps, words in (("0,5", "out of range"), ("1", "final layer")):
        assert distill_main(["--model", str(tiny), "--out", str(tmp_path / f"o{taps}"), "--taps", taps]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, err

    plain = write_model(tmp_path / "plain", "qwen3", **TINY)
    tc = json.loads((plain / "tokenizer_config.json").read_text())
    tc.pop("chat_template")
    (plain / "tokenizer_config.json").write_text(json.dumps(tc))
    assert distill_main(["--model", str(plain), "--out", str(tmp_path / "o3")]) == 2
    err = capsys.readouterr().err
    assert "no chat template" in err and "--no-chat-template" in err

    (tmp_path / "o4").mkdir()
    (tmp_path / "o4" / "keep.txt").write_text("x")
    assert distill_main(["--model", str(tiny), "--out", str(tmp_path / "o4")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert distill_main(["--model", str(tiny), "--out", str(tmp_path / "o6"), "--cut-loops", "1"]) == 2
    assert "--cut-loops" in capsys.readouterr().err
    assert distill_main(["--model", str(tiny), "--out", str(tmp_path / "o5"), "--resume"]) == 2
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
    o = small_run(plain, tmp_path / "raw", steps=3, save_every=0, prompts=2, answer_tokens=12)
    o.train.gen.chat_template, o.evaluate, o.eval_samples, o.eval_max_tokens = False, True, 1, 8
    summary = run_distill(o, log=quiet)
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
    o = small_run(plain, tmp_path / "code", steps=1, save_every=0, prompts=2, answer_tokens=8)
    o.raw_code = True
    run_distill(o, log=quiet)
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
