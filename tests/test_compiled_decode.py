"""The kernel path's compiled decode forward (models/compiled_decode.py): one traced graph per
width bucket, KV buffer block and taps, whose rows are width-invariant and whose generations, in
every mode, equal baseline in ids and text.

On the CPU it runs where MLX_DSPARK_COMPILE=on asks for it (auto compiles on a GPU only); the
`gpu` instances of tests/test_invariant_forward.py prove it on the device, where auto takes it."""

from __future__ import annotations

import os
import random
import weakref

import mlx.core as mx
import pytest

import mlx_dspark as md
from mlx_dspark.api import start
from mlx_dspark.models import compiled_decode, invariance
from mlx_dspark.models.compiled_rows import rows_of

SEED = int(os.environ.get("MLX_DSPARK_TEST_SEED", random.randrange(2**31)))


@pytest.fixture(scope="module")
def path(model_dir):
    return str(model_dir("llama", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, seed=33, vocab_size=384))


def load(path, dtype, compile_, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_INVARIANT", "kernels")
    monkeypatch.setenv("MLX_DSPARK_COMPILE", compile_)
    target, tok = md.load_target(path, dtype=dtype)
    assert target.invariance == "kernels", target.invariance
    return target, tok


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_of_the_compiled_forward_are_width_invariant(path, dtype, monkeypatch):
    """Row i of a width-w compiled forward equals the width-1 compiled forward of the same token,
    bitwise, w = 1..17, over a random prompt. (Not asserted: equality with the uncompiled path.
    On the CPU that one reads attention through MLX's own kernel row by row, the graph through the
    chunked reference: an exact path each, with different roundings.)"""
    target, _ = load(path, dtype, "on", monkeypatch)
    assert target.compiled_decode is not None
    rng = random.Random(SEED)
    vocab = target.vocab_size
    prefix = mx.array([[rng.randrange(vocab) for _ in range(rng.randrange(5, 200))]])
    tokens = mx.array([[rng.randrange(vocab) for _ in range(17)]], dtype=mx.int32)

    def prefilled():
        cache = target.make_cache()
        mx.eval(target.forward(prefix, cache, last_only=True).logits)
        return cache

    cache = prefilled()
    before = target.compiled_decode.traces
    ones = [target.forward(tokens[:, i : i + 1], cache).logits for i in range(17)]
    mx.eval(ones)
    for w in range(1, 18):
        rows = target.forward(tokens[:, :w], prefilled()).logits
        assert rows.shape[1] == w
        for i in range(w):
            assert mx.array_equal(rows[:, i], ones[i][:, 0]).item(), f"row {i} of width {w} (seed {SEED})"
    # widths 1..17 run as 8 traced widths (compiled_decode.BUCKETS), pad rows cut off
    assert {compiled_decode.bucket(w) for w in range(1, 18)} == {1, 2, 3, 4, 6, 8, 12, 17}
    assert target.compiled_decode.traces - before <= 8


def test_the_traced_widths_can_be_set_for_measurements(path, monkeypatch):
    """MLX_DSPARK_BUCKETS replaces the traced widths (fewer traces); rows stay those of the
    one-token steps; a list that does not start at 1 is refused with what to write."""
    from mlx_dspark.errors import UserError

    monkeypatch.setenv("MLX_DSPARK_BUCKETS", "1,8,17")
    assert [compiled_decode.bucket(w) for w in (1, 2, 8, 9, 17, 18, 40)] == [1, 8, 8, 17, 17, 32, 48]
    target, _ = load(path, "float32", "on", monkeypatch)
    vocab = target.vocab_size
    tokens = mx.array([[(7 * i + 2) % vocab for i in range(30)]], dtype=mx.int32)
    cache = target.make_cache()
    mx.eval(target.forward(tokens[:, :20], cache, last_only=True).logits)
    rows = target.forward(tokens[:, 20:25], cache).logits
    mx.eval(rows)
    # The load's probe traced widths 1 and 2, i.e. 1 and 8: width 5 ran on the width-8 trace.
    assert target.compiled_decode.traces == 2
    target.trim(cache, 5)
    for i in range(5):
        one = target.forward(tokens[:, 20 + i : 21 + i], cache).logits
        assert mx.array_equal(rows[:, i], one[:, 0]).item(), i
    monkeypatch.setenv("MLX_DSPARK_BUCKETS", "2,8")
    with pytest.raises(UserError, match="starting at 1"):
        compiled_decode.bucket(3)


def test_modes_equal_baseline_in_ids_and_text(path, monkeypatch):
    target, tok = load(path, "bfloat16", "on", monkeypatch)
    prompt = "repeat: the fox the fox the fox def add(a, b) return a + b"
    base = md.generate(target, tok, prompt, mode="baseline", max_new_tokens=48)
    look = md.generate(target, tok, prompt, mode="lookup", max_new_tokens=48)
    assert look.tokens == base.tokens and look.text == base.text
    assert target.compiled_decode.traces > 0


def test_a_step_of_a_known_shape_is_not_traced_again_and_a_grown_buffer_is(path, monkeypatch):
    """Steps replay the graph of their width; a KV buffer that grows past its capacity is traced
    once more, and the logits across the growth equal, step by step, those of a buffer that was
    large enough from the start."""
    monkeypatch.setattr(compiled_decode, "CAPACITY_STEP", 32)
    target, _ = load(path, "float32", "on", monkeypatch)
    compiled = target.compiled_decode
    vocab = target.vocab_size
    ids = [(11 * i + 3) % vocab for i in range(300)]
    cache = target.make_cache()
    mx.eval(target.forward(mx.array([ids[:250]]), cache, last_only=True).logits)  # mlx-lm's buffer: 256
    assert cache[0].keys.shape[2] == 256
    got, before = [], compiled.traces
    for j in range(250, 262):  # 256 fills at j = 255: the buffer grows to 288 there
        got.append(target.forward(mx.array([[ids[j]]]), cache).logits)
        if j == 254:
            assert compiled.traces == before  # width 1 over a 256 buffer: traced by the load's self-check
    assert compiled.traces - before == 1 and cache[0].keys.shape[2] == 288 and cache[0].offset == 262

    monkeypatch.setattr(compiled_decode, "CAPACITY_STEP", 1024)
    cache = target.make_cache()
    mx.eval(target.forward(mx.array([ids[:250]]), cache, last_only=True).logits)
    mx.eval(target.forward(mx.array([ids[250:257]]), cache).logits)
    target.trim(cache, 7)  # the buffer: 1024 from here on
    assert cache[0].keys.shape[2] == 1024
    for j, g in zip(range(250, 262), got):
        assert mx.array_equal(target.forward(mx.array([[ids[j]]]), cache).logits, g).item(), j


def test_a_buffer_of_any_length_is_padded_to_whole_blocks(path, monkeypatch):
    """mlx-lm's prefill leaves a buffer of 256s, a restored prefix one of its own length: the first
    compiled step pads either to whole blocks, so prompts of different lengths share traces."""
    target, _ = load(path, "float32", "on", monkeypatch)
    compiled = target.compiled_decode
    outs = []
    for n in (30, 300, 700):
        cache = target.make_cache()
        mx.eval(target.forward(mx.array([[(7 * i) % 300 for i in range(n)]]), cache, last_only=True).logits)
        for c in cache:  # as the prefix cache restores a slot: exactly n positions
            c.keys, c.values = c.keys[..., :n, :], c.values[..., :n, :]
        before = compiled.traces
        outs.append(target.forward(mx.array([[5]]), cache).logits)
        assert cache[0].keys.shape[2] == compiled_decode.CAPACITY_STEP and cache[0].offset == n + 1
        assert compiled.traces == before  # width 1 over one block: traced by the load's self-check
    mx.eval(outs)


def test_a_rollback_overwrites_the_stale_positions(path, monkeypatch):
    """A verify block, trimmed back, then other tokens: the buffer's stale positions are never
    read (the same logits as a cache that never saw the rejected tokens)."""
    target, _ = load(path, "float32", "on", monkeypatch)
    prefix = mx.array([[5, 6, 7, 8, 9, 10, 11]])
    a, b = target.make_cache(), target.make_cache()
    for c in (a, b):
        mx.eval(target.forward(prefix, c, last_only=True).logits)
    mx.eval(target.forward(mx.array([[1, 2, 3, 4]]), a).logits)
    target.trim(a, 3)
    mx.eval(target.forward(mx.array([[1]]), b).logits)
    after = mx.array([[40, 41, 42]])
    assert mx.array_equal(target.forward(after, a).logits, target.forward(after, b).logits).item()


def test_a_model_whose_trace_fails_keeps_the_uncompiled_kernel_path(path, monkeypatch):
    """An attention call that cannot take the invariant op inside the trace (here: a stand-in that
    says no shape is supported) makes the probe refuse: the target decodes op by op, exactly. It
    runs on the CPU, where MLX's own attention is row-invariant and the op-by-op kernel path still
    passes its check (on a GPU the stand-in leaves no invariant path at all, and the load says so)."""
    from mlx_dspark.kernels import invariant

    monkeypatch.setattr(invariant, "supported", lambda q, k, v: False)
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        target, tok = load(path, "float32", "on", monkeypatch)
        assert target.compiled_decode is None and target.invariant_kernels
        base = md.generate(target, tok, "the fox the fox the fox", mode="baseline", max_new_tokens=16)
        look = md.generate(target, tok, "the fox the fox the fox", mode="lookup", max_new_tokens=16)
        assert look.tokens == base.tokens and look.text == base.text
    finally:
        mx.set_default_device(device)


def test_auto_compiles_only_where_the_linears_run_gpu_kernels(path, monkeypatch):
    target, _ = load(path, "float32", "auto", monkeypatch)
    assert target.compiled_decode is None  # the CPU: the graph builds in a fraction of the compute
    monkeypatch.setenv("MLX_DSPARK_COMPILE", "nonsense")
    assert compiled_decode.setting() == "auto"


@pytest.mark.parametrize(
    "tkey,dkey",
    [("target_perm", "perm_dspark_noisy"), ("target_qwen3", "dspark_qwen3"), ("target_qwen3", "dflash_zlab")],
)
def test_drafters_through_the_compiled_graphs_equal_baseline(tkey, dkey, monkeypatch):
    """DSpark and DFlash read the target's tapped hidden states out of the compiled graphs, and
    their rounds accept partial blocks (the noisy drafter): ids and text equal baseline."""
    from drafter_fixtures import workspace

    from mlx_dspark.models.drafters import load_drafter

    ws = workspace()
    target, tok = load(str(ws[tkey]), "float32", "on", monkeypatch)
    assert target.compiled_decode is not None
    drafter = load_drafter(str(ws[dkey]), target, bits=16)
    prompt = [5, 9, 23, 41, 7, 12]
    base = md.generate(target, tok, None, prompt_ids=prompt, mode="baseline", max_new_tokens=40)
    spec = md.generate(target, tok, None, prompt_ids=prompt, mode="auto", drafter=drafter, max_new_tokens=40)
    assert spec.tokens == base.tokens and spec.text == base.text
    assert spec.rounds > 0 and target.compiled_decode.traces > 0


def test_graphs_traced_at_load_run_in_another_thread(path, monkeypatch):
    """The server's engine decodes in its own thread (MLX streams are per thread) with the graphs
    the load's self-check traced in the main thread, and traces new ones there: same ids and text."""
    import threading

    target, tok = load(path, "float32", "on", monkeypatch)
    prompt = "repeat: the fox the fox the fox def add(a, b) return a + b"
    base = md.generate(target, tok, prompt, mode="baseline", max_new_tokens=40)
    got = {}

    def engine():
        got["look"] = md.generate(target, tok, prompt, mode="lookup", max_new_tokens=40)
        got["base"] = md.generate(target, tok, prompt, mode="baseline", max_new_tokens=40)

    th = threading.Thread(target=engine)
    th.start()
    th.join()
    for r in got.values():
        assert r.tokens == base.tokens and r.text == base.text


def test_the_calibration_is_keyed_by_the_compiled_path_and_times_replays(path, monkeypatch):
    """Cost curves measured on compiled steps are not reused for op-by-op ones (and back), and a
    width's first (tracing) step is not what the curve records."""
    from mlx_dspark.decode import costs

    target, _ = load(path, "float32", "on", monkeypatch)
    key = costs.key_for(target)
    assert key["compiled"] is True
    seen = []
    real = target.forward
    monkeypatch.setattr(target, "forward", lambda t, c, **k: seen.append(t.shape[1]) or real(t, c, **k))
    c = costs.measure(target, budget_s=0.01)  # no budget for repeated sweeps: one timed step a width
    wide = [w for w in c.widths if w > 1]
    assert wide and all(seen.count(w) == 2 for w in wide)  # an untimed (tracing) step, then the timed one
    monkeypatch.setenv("MLX_DSPARK_COMPILE", "off")
    invariance.set_path(target, "kernels")
    assert costs.key_for(target)["compiled"] is False and costs.key_for(target) != key


EXIT_SCRIPT = """
import sys, threading
import mlx_dspark as md
target, tok = md.load_target(sys.argv[1], dtype="float32")
assert target.compiled_decode is not None
got = {}


def decode():
    got["r"] = md.generate(target, tok, "the fox the fox", mode="lookup", max_new_tokens=24)


worker = threading.Thread(target=decode)
worker.start()
worker.join()
print(len(got["r"].tokens))
"""


def test_a_process_that_decoded_in_a_thread_exits_cleanly(path, tmp_path):
    """A server decodes in its engine thread, through compiled steps, then exits: the process
    ends with code 0, not MLX's abort at teardown (compat.note_decoding_thread; without it this
    script aborted in 22 of 24 runs on the CI-like machine)."""
    import subprocess
    import sys

    script = tmp_path / "decode_in_a_thread.py"
    script.write_text(EXIT_SCRIPT)
    env = dict(os.environ, MLX_DSPARK_INVARIANT="kernels", MLX_DSPARK_COMPILE="on")
    for _ in range(4):
        p = subprocess.run([sys.executable, str(script), path], env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0 and "terminate called" not in p.stderr, (p.returncode, p.stderr[-2000:])
        assert p.stdout.strip() == "24"


@pytest.mark.parametrize("mode", ["baseline", "lookup", "dspark", "dflash"])
def test_batched_rows_run_one_compiled_graph_and_equal_solo_runs(mode, monkeypatch):
    """The batch engine's rows (decode/batch.step_rows) run as one traced graph of all rows where
    every row's cache is a compiled buffer, and the drafter's rows as one compiled pass: each row's
    ids, text and accepted lengths equal its solo run on the compiled path, with rows joining
    mid-flight at other positions and widths."""
    from drafter_fixtures import workspace

    from mlx_dspark.api import start
    from mlx_dspark.decode import batch
    from mlx_dspark.models.drafters import load_drafter

    ws = workspace()
    target, tok = load(str(ws["target_qwen3"]), "float32", "on", monkeypatch)
    compiled = target.compiled_decode
    assert compiled is not None
    assert batch.check(target, 4, 17) is None  # the load's measurement: batched rows equal solo steps
    assert compiled.batched._stack is None  # and it keeps no KV of its own rows
    fixture = {"dspark": "dspark_qwen3", "dflash": "dflash_zlab"}.get(mode)
    drafter = load_drafter(str(ws[fixture]), target, bits=16) if fixture else None
    vocab = target.vocab_size
    prompts = [[(7 * i + 11 * r + 3) % vocab for i in range(9 + 13 * r)] for r in range(4)]
    budgets, join_at = [30, 12, 25, 18], [0, 0, 2, 5]
    solo = [
        md.generate(target, tok, None, prompt_ids=p, mode=mode, drafter=drafter, max_new_tokens=n)
        for p, n in zip(prompts, budgets)
    ]
    calls, draft_calls = [], []
    batched = rows_of(compiled)
    real = batched.rows
    monkeypatch.setattr(batched, "rows", lambda feeds, taps: calls.append(len(feeds)) or real(feeds, taps))
    if drafter is not None:
        from mlx_dspark.models import compiled_draft

        passes = compiled_draft.for_drafter(drafter)
        real_draft = passes.rows
        monkeypatch.setattr(passes, "rows", lambda a, *r: draft_calls.append(len(a)) or real_draft(a, *r))
    runs, step = {}, 0
    while len(runs) < len(prompts) or any(not r.generation.done for r in runs.values()):
        for i, at in enumerate(join_at):
            if at == step:
                runs[i] = start(
                    target, tok, None, prompt_ids=prompts[i], mode=mode, drafter=drafter, max_new_tokens=budgets[i]
                )
                runs[i].generation.step()  # the prefill, alone
        live = [r.generation for r in runs.values() if not r.generation.done]
        if live:
            batch.step_rows(live)
        step += 1
        assert step < 1000
    assert calls and max(calls) >= 3  # three rows or more shared one compiled step
    if drafter is not None:  # and the drafter's rows shared its compiled pass
        assert draft_calls and max(draft_calls) >= 2
    for i, s in enumerate(solo):
        got = runs[i].result()
        assert (got.tokens, got.text, got.finish_reason) == (s.tokens, s.text, s.finish_reason)
        assert got.accept_lengths == s.accept_lengths


def test_the_first_generation_of_a_process_pays_its_round_widths_before_the_decode(path, monkeypatch):
    """decode/warmup.py: where the forward is compiled, a process's first speculative generation
    first traces every bucket width up to its cap (once per process and taps: reported as
    warm_up_s), so its decode and every later one trace no width again; the scratch rounds leave
    no trace in the answer (ids and text equal baseline, and equal a run whose warm-up had already
    happened) nor in the random state."""
    from mlx_dspark.decode import warmup

    target, tok = load(path, "float32", "on", monkeypatch)
    compiled = target.compiled_decode
    monkeypatch.setattr(warmup, "_warm", weakref.WeakKeyDictionary())
    prompt = "repeat: the fox the fox the fox def add(a, b) return a + b the fox the fox"
    base = md.generate(target, tok, prompt, mode="baseline", max_new_tokens=40)
    assert "warm_up_s" not in base.stats  # plain decoding has no rounds to warm
    state = [mx.array(s) for s in mx.random.state]
    before = compiled.traces
    run = start(target, tok, prompt, mode="lookup", max_new_tokens=40, max_draft=16)
    warmed = compiled.traces
    assert warmed > before  # widths the load's self-check had not traced (2, 3, 6, 12, ...)
    first = run.run()
    assert compiled.traces == warmed  # the decode traced no width
    assert first.stats["warm_up_s"] > 0 and len(set(first.accept_lengths)) > 2  # rounds of several widths
    assert all(mx.array_equal(a, b).item() for a, b in zip(state, mx.random.state))
    assert warmup.round_widths(target, 16) == [2, 3, 4, 6, 8, 12, 17]
    again = md.generate(target, tok, prompt, mode="lookup", max_new_tokens=40, max_draft=16)
    assert "warm_up_s" not in again.stats and compiled.traces == warmed
    for r in (first, again):
        assert r.tokens == base.tokens and r.text == base.text
    wider = md.generate(target, tok, prompt, mode="lookup", max_new_tokens=40, max_draft=32)
    assert wider.stats["warm_up_s"] > 0  # a larger cap: widths 24 and 33 are new
    monkeypatch.setenv("MLX_DSPARK_COMPILE", "off")
    plain_target, _ = md.load_target(path, dtype="float32")
    assert plain_target.compiled_decode is None and warmup.round_widths(plain_target, 16) == []


def _three_rows(target, tok, spec):
    """Three generations (prompt r: ids (a * i + b * r + c) % vocab, n0 + dn * r of them; the
    budgets given), their solo runs, and the first two prefilled."""
    (a, b, c, n0, dn), budgets = spec
    prompts = [[(a * i + b * r + c) % target.vocab_size for i in range(n0 + dn * r)] for r in range(3)]
    solo = [md.generate(target, tok, None, prompt_ids=p, max_new_tokens=n) for p, n in zip(prompts, budgets)]
    runs = [start(target, tok, None, prompt_ids=p, max_new_tokens=n) for p, n in zip(prompts, budgets)]
    for r in runs[:2]:
        r.generation.step()  # prefill
    return solo, runs


def test_batched_rows_keep_one_kv_buffer_per_layer_and_finished_rows_leave_it(monkeypatch):
    """The rows of a batched compiled step share one KV buffer per layer (RowStack), kept from
    step to step while the same rows step together: each row's cache holds views of its row. A row
    joining gathers the rows again; a row that finishes gets buffers of its own at once, equal to
    what it held; a batch down to one row, or with no row left, drops the stack. Output equals
    solo runs throughout."""
    from drafter_fixtures import workspace

    from mlx_dspark.decode import batch

    target, tok = load(str(workspace()["target_qwen3"]), "float32", "on", monkeypatch)
    compiled = target.compiled_decode
    solo, runs = _three_rows(target, tok, [(5, 13, 1, 11, 9), (6, 20, 20)])
    batch.step_rows([r.generation for r in runs[:2]])
    first = compiled.batched._stack
    assert first is not None and first.holds([r.generation.cache for r in runs[:2]])
    batch.step_rows([r.generation for r in runs[:2]])
    assert compiled.batched._stack is first  # the same rows: the same stack, reused
    for b, r in enumerate(runs[:2]):
        for i, c in enumerate(r.generation.cache):
            assert c.keys is first._views[b][0][i] and c.keys.shape[0] == 1
    lone = runs[0].generation
    views = first._views[0]
    batch.step_rows([lone])  # a batch down to one row: it steps alone, with KV of its own
    assert compiled.batched._stack is None
    assert all(c.keys is not k for c, k in zip(lone.cache, views[0]))
    runs[2].generation.step()
    seen, left = [], 0
    while any(not r.generation.done for r in runs):
        live = [r.generation for r in runs if not r.generation.done]
        batch.step_rows(live)
        stack = compiled.batched._stack
        seen.append(stack)
        for g in live:
            if g.done and stack is not None:  # finished this step, others go on: KV of its own, equal
                views = stack._views[stack.caches.index(g.cache)]
                for i, c in enumerate(g.cache):
                    assert c.keys is not views[0][i] and c.values is not views[1][i]
                    assert mx.array_equal(c.keys, views[0][i]).item() and mx.array_equal(c.values, views[1][i]).item()
                left += 1
    assert left >= 1  # a row left while others went on
    assert seen[0] is not first  # the third row joined: gathered again
    assert compiled.batched._stack is None  # every row finished: the stack went
    for r, s in zip(runs, solo):
        got = r.result()
        assert (got.tokens, got.text) == (s.tokens, s.text)


def test_rows_far_apart_in_length_keep_buffers_of_their_own():
    """Stacking pads every row to the longest row's blocks: allowed while that adds at most a
    quarter of the rows' own need (or a block a row); one long conversation among short ones is
    stepped with each row's own buffer instead."""
    from mlx_dspark.models.compiled_rows import stack_fits

    assert stack_fits([3000, 1200, 500, 2000])  # 4 blocks of padding over 8: one block a row
    assert stack_fits([100, 900, 50])
    assert not stack_fits([30000, 500, 500, 500])  # 29 blocks of padding a short row
    assert not stack_fits([9000, 100])


def test_rows_apart_equal_solo_runs(monkeypatch):
    """The apart layout (each row's own buffer, attended row by row) computes every row as its
    solo run, in ids and text, with rows joining mid-flight."""
    from drafter_fixtures import workspace

    from mlx_dspark.decode import batch
    from mlx_dspark.models import compiled_rows

    target, tok = load(str(workspace()["target_qwen3"]), "float32", "on", monkeypatch)
    monkeypatch.setattr(compiled_rows, "stack_fits", lambda needs: False)
    solo, runs = _three_rows(target, tok, [(3, 17, 2, 7, 11), (14, 9, 12)])
    batch.step_rows([r.generation for r in runs[:2]])
    runs[2].generation.step()
    while any(not r.generation.done for r in runs):
        batch.step_rows([r.generation for r in runs if not r.generation.done])
    layouts = rows_of(target.compiled_decode).layouts
    assert layouts["apart"] >= 2 and layouts["stacked"] == 0
    for r, s in zip(runs, solo):
        got = r.result()
        assert (got.tokens, got.text) == (s.tokens, s.text)


def test_the_load_check_measures_both_layouts_of_the_rows(monkeypatch):
    """batch.check runs the rows stacked and apart (compiled_rows.py), each against solo steps."""
    from drafter_fixtures import workspace

    from mlx_dspark.decode import batch

    target, _ = load(str(workspace()["target_qwen3"]), "float32", "on", monkeypatch)
    layouts = rows_of(target.compiled_decode).layouts
    target._batch_checked = {}
    before = dict(layouts)
    assert batch.check(target, 3, 5) is None
    assert layouts["stacked"] > before["stacked"] and layouts["apart"] > before["apart"]
    assert rows_of(target.compiled_decode).force is None
