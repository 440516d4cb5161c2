"""Hybrid targets (Gated DeltaNet + attention): bit-exact rollback by replay, every mode lossless.

Fixtures: tiny random qwen3_5, qwen3_5_moe and qwen3_next models written in their real HF
layouts (tests/family_fixtures.py) and loaded as a user's folder is, CPU float32.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from drafter_fixtures import write_deepspec, write_zlab
from family_fixtures import text_view, write_family
from fixtures import scratch_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_loop import _ScriptedProposer, independent_greedy

import mlx_dspark as md
from mlx_dspark.decode import loop
from mlx_dspark.models import hybrid
from mlx_dspark.models.drafters import load_drafter

HYBRIDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
_ROOT = scratch_dir("mlx-dspark-hybrid-")
_LOADED: dict = {}


def family(name: str):
    """(target, tokenizer, {kind: drafter}) for a family fixture, loaded once per process."""
    if name not in _LOADED:
        path = write_family(_ROOT / name, name, seed=len(name))
        tgt, tok = md.load_target(str(path), dtype="float32")
        view = text_view(path, _ROOT / f"{name}-view")
        drafters = {
            "dspark": load_drafter(str(write_deepspec(_ROOT / f"{name}-dspark", view)), tgt, bits=16),
            "dflash": load_drafter(str(write_zlab(_ROOT / f"{name}-dflash", view)), tgt, bits=16),
        }
        _LOADED[name] = (tgt, tok, drafters)
    return _LOADED[name]


def states(cache) -> list[np.ndarray]:
    return [np.array(x) for x in hybrid._states(cache)]


def assert_same_states(a, b):
    sa, sb = states(a), states(b)
    assert len(sa) == len(sb)
    for x, y in zip(sa, sb):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert np.array_equal(x, y)  # bitwise


@pytest.mark.parametrize("name", HYBRIDS)
def test_targets_load_with_replay_caches(name):
    tgt, _, _ = family(name)
    assert tgt.rollback_kind == "replay"
    assert tgt.rollback_refusal is None
    cache = tgt.make_cache()
    kinds = {type(c).__name__ for c in cache}
    assert kinds == {"ReplayArraysCache", "KVCache"}
    assert tgt.can_trim(cache, 7)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(HYBRIDS), data=st.data())
def test_replay_rebuilds_the_state_plain_decoding_holds(name, data):
    """A verify-shaped forward of S tokens rewound by n leaves every layer (GDN conv + recurrent
    state, KV) bitwise equal to (a) feeding the S - n kept tokens one at a time, as plain decoding
    does, and (b) re-running the whole prefix from scratch in one forward."""
    tgt, _, _ = family(name)
    V = tgt.vocab_size
    prompt = data.draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=20))
    block = data.draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=9))
    n = data.draw(st.integers(0, len(block)))
    m = len(block) - n
    wide, plain = tgt.make_cache(), tgt.make_cache()
    for c in (wide, plain):
        tgt.forward(mx.array([prompt]), c)
    tgt.forward(mx.array([block]), wide)
    tgt.trim(wide, n)
    for t in block[:m]:
        tgt.forward(mx.array([[t]]), plain)
    assert_same_states(wide, plain)
    scratch = tgt.make_cache()
    tgt.forward(mx.array([prompt + block[:m]]), scratch)
    assert_same_states(wide, scratch)
    # and the next step's logits agree bitwise
    nxt = [block[0]]
    a = tgt.forward(mx.array([nxt]), wide).logits
    b = tgt.forward(mx.array([nxt]), plain).logits
    assert np.array_equal(np.array(a), np.array(b))


def test_rewinding_a_one_token_forward_restores_the_state():
    tgt, _, _ = family("qwen3_5")
    c, ref = tgt.make_cache(), tgt.make_cache()
    for cc in (c, ref):
        tgt.forward(mx.array([[3, 5, 7, 11]]), cc)
    tgt.forward(mx.array([[13]]), c)
    tgt.trim(c, 1)
    assert_same_states(c, ref)
    with pytest.raises(RuntimeError, match="cannot roll a recurrent layer back"):
        tgt.forward(mx.array([[13, 17]]), c)
        tgt.trim(c, 3)


def test_replay_reference_matches_mlx_fast_gated_delta_update():
    """The replay's reference is mlx-lm's gated_delta_update (what the family's forward calls);
    MLX's fused op agrees with it closely and returns the state as [B, Hv, Dv, Dk]."""
    from mlx_lm.models import gated_delta

    tgt, _, _ = family("qwen3_5")
    mod = next(m for m in hybrid.gdn_modules(tgt.layers) if m is not None)
    rng = np.random.default_rng(0)
    B, T, Hk, Dk, Hv, Dv = 1, 6, mod.num_k_heads, mod.head_k_dim, mod.num_v_heads, mod.head_v_dim
    q, k = (mx.array(rng.standard_normal((B, T, Hk, Dk)).astype(np.float32)) for _ in range(2))
    q, k = gated_delta.normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    v = mx.array(rng.standard_normal((B, T, Hv, Dv)).astype(np.float32))
    a, b = (mx.array(rng.standard_normal((B, T, Hv)).astype(np.float32)) for _ in range(2))
    s0 = mx.array(rng.standard_normal((B, Hv, Dv, Dk)).astype(np.float32) * 0.1)
    ref = hybrid.replay_state(gated_delta.gated_delta_update, mod, q, k, v, a, b, s0)
    # stepping one position at a time gives the same state bitwise
    s = s0
    for t in range(T):
        s = hybrid.replay_state(
            gated_delta.gated_delta_update,
            mod,
            q[:, t : t + 1],
            k[:, t : t + 1],
            v[:, t : t + 1],
            a[:, t : t + 1],
            b[:, t : t + 1],
            s,
        )
    assert np.array_equal(np.array(ref), np.array(s))
    if hasattr(mx.fast, "gated_delta_update"):
        g = gated_delta.compute_g(mod.A_log, a, mod.dt_bias)
        _, fast = mx.fast.gated_delta_update(q, k, v, g, mx.sigmoid(b), s0)
        assert fast.shape == (B, Hv, Dv, Dk)
        assert np.allclose(np.array(fast), np.array(ref), atol=1e-4)


def test_a_replay_that_drops_the_recurrence_is_refused(monkeypatch):
    """The load-time proof can fail: a rewind that keeps the conv state but not the recurrent
    one is caught, and the target falls back to mlx-lm's caches (which cannot be trimmed)."""
    path = write_family(_ROOT / "broken", "qwen3_5", seed=11)

    def broken(self, n):
        r, self.round = self.round, None
        if n > 0:
            self[0] = mx.contiguous(r.conv_input[:, r.width - n : r.width - n + r.module.conv_kernel_size - 1, :])

    monkeypatch.setattr(hybrid.ReplayArraysCache, "rewind", broken)
    tgt, _ = md.load_target(str(path), dtype="float32")
    assert tgt.rollback_kind.startswith("none (replaying the accepted positions")
    cache = tgt.make_cache()
    assert not any(isinstance(c, hybrid.ReplayArraysCache) for c in cache)
    assert not tgt.can_trim(cache, 2)


@pytest.mark.parametrize("name", ["qwen3_5", "gemma4_text"])
def test_rollback_is_proven_on_the_decode_path_the_target_runs(name, monkeypatch, tmp_path):
    """On a GPU the native forward is not width-invariant, so a rollback proven on it could only be
    compared to the dtype's precision (and was refused on the H200 in bf16); the proof waits for
    the load's choice of decode path and runs on it. Here the native forward is declared
    width-dependent, as on a GPU, so that the load picks the kernel path, as on a GPU."""
    from mlx_dspark.models import invariance
    from mlx_dspark.models.target import Target

    rows_match = invariance.rows_match
    monkeypatch.setattr(invariance, "rows_match", lambda t: rows_match(t) and t.invariant_kernels)
    monkeypatch.setenv("MLX_DSPARK_INVARIANT", "auto")
    monkeypatch.setenv("MLX_DSPARK_INVARIANT_CACHE", "off")
    seen = []
    proof_forward = Target._proof_forward

    def recording(self, ids, cache, prefill=False):
        seen.append((self.invariant_kernels, ids.shape[1], prefill))
        return proof_forward(self, ids, cache, prefill)

    monkeypatch.setattr(Target, "_proof_forward", recording)
    tgt, _ = md.load_target(str(write_family(tmp_path / name, name, seed=5)), dtype="float32")
    assert tgt.invariance == "kernels"
    assert tgt.rollback_kind in ("replay", "rewind") and tgt.rollback_refusal is None
    assert seen and all(kernels for kernels, _, _ in seen)  # every forward of the proof: the kernel path
    assert (7, False) in [(w, p) for _, w, p in seen]  # the verify round, as a round runs it
    assert (5, True) in [(w, p) for _, w, p in seen]  # the prompt, as a prefill


def test_unknown_recurrent_modules_are_named():
    class Mamba2Mixer:
        pass

    class Layer:
        is_linear = True
        linear_attn = Mamba2Mixer()

    assert "Mamba2Mixer" in hybrid.install_recording([Layer()])


WORDS = ["the", "fox", "def", "add", "(a, b)", "return", "hello", "world", "1 2 3", "café", "\n"]
prompts = st.lists(st.sampled_from(WORDS), min_size=1, max_size=10).map(" ".join)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(HYBRIDS), prompt=prompts, n=st.integers(1, 40), max_draft=st.sampled_from([1, 3, 7]))
def test_every_mode_is_lossless_on_hybrids(name, prompt, n, max_draft):
    tgt, tok, drafters = family(name)
    ids = md.encode_prompt(tok, prompt)
    base = md.generate(tgt, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=n)
    assert base.tokens == independent_greedy(tgt, ids, n, set(md.api.stop_token_ids(tgt, tok)))
    runs = [md.generate(tgt, tok, None, prompt_ids=ids, mode="lookup", max_new_tokens=n, max_draft=max_draft)]
    for kind, d in drafters.items():
        runs.append(
            md.generate(tgt, tok, None, prompt_ids=ids, mode=kind, drafter=d, max_new_tokens=n, max_draft=max_draft)
        )
    prop = _ScriptedProposer(base.tokens + [0] * 64)
    runs.append(md.generate(tgt, tok, None, prompt_ids=ids, proposer=prop, max_new_tokens=n, max_draft=max_draft))
    for r in runs:
        assert r.tokens == base.tokens
        assert r.text == base.text
        assert "speculation_off" not in r.stats
    if n > 2:
        assert runs[1].stats["drafter_proposed"] > 0  # the drafter did draft on the hybrid


@pytest.mark.parametrize("name", HYBRIDS)
def test_partial_accepts_at_every_point_stay_exact(name):
    tgt, tok, _ = family(name)
    ids = md.encode_prompt(tok, "hello world the fox")
    base = md.generate(tgt, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=60)
    prop = _ScriptedProposer(base.tokens + [0] * 64)
    res = md.generate(tgt, tok, None, prompt_ids=ids, proposer=prop, max_new_tokens=60, max_draft=5)
    assert res.tokens == base.tokens and res.text == base.text
    assert len(set(res.accept_lengths)) >= 4  # accepts of 1..6 tokens: rewinds at many points
    # the cache ends at the committed length, in the state plain decoding holds
    stops = md.api.stop_token_ids(tgt, tok)
    cache = tgt.make_cache()
    run = loop.run(
        tgt,
        ids,
        _ScriptedProposer(base.tokens + [0] * 64),
        max_new_tokens=60,
        max_draft=5,
        cache=cache,
        stop_token_ids=stops,
    )
    assert run.tokens == base.tokens
    plain = tgt.make_cache()
    loop.run(tgt, ids, None, max_new_tokens=60, cache=plain, stop_token_ids=stops)
    assert tgt.cache_len(cache) == tgt.cache_len(plain) >= len(ids) + len(base.tokens) - 1
    assert_same_states(cache, plain)


@pytest.mark.parametrize("name", ["qwen3_5", "gemma3_text"])
def test_cli_generate_on_a_family_folder(name, tmp_path):
    """`mlx-dspark generate --model DIR` on a folder written by fixtures.write_model: lookup and
    baseline give the same ids and text, and the run does not fall back to plain decoding."""
    import json
    import subprocess
    import sys

    from fixtures import write_model

    path = str(write_model(tmp_path / name, name, seed=5))
    out = {}
    for mode in ("baseline", "lookup"):
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "mlx_dspark",
                "generate",
                "--model",
                path,
                "--prompt",
                "the fox def add the fox def add the fox",
                "--max-new-tokens",
                "40",
                "--json",
                "--mode",
                mode,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        assert "cannot be rolled back" not in r.stderr
        out[mode] = json.loads(r.stdout)
    assert out["lookup"]["tokens"] == out["baseline"]["tokens"]
    assert out["lookup"]["text"] == out["baseline"]["text"]


@pytest.mark.parametrize("name", ["qwen3_5", "gemma3_text"])
def test_quantized_targets_stay_lossless(name):
    """A 4-bit re-quantized target (MLX affine) rolls back the same way, token-identical."""
    path = write_family(_ROOT / f"{name}-q", name, seed=21)
    tgt, tok = md.load_target(str(path), dtype="float32", quantize=4)
    assert tgt.rollback_kind in ("replay", "rewind")
    ids = md.encode_prompt(tok, "the fox def add hello world the fox")
    base = md.generate(tgt, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=50)
    assert base.tokens == independent_greedy(tgt, ids, 50, set(md.api.stop_token_ids(tgt, tok)))
    res = md.generate(
        tgt,
        tok,
        None,
        prompt_ids=ids,
        proposer=_ScriptedProposer(base.tokens + [0] * 64),
        max_new_tokens=50,
        max_draft=5,
    )
    assert res.tokens == base.tokens and res.text == base.text
    assert max(res.accept_lengths) > 1


@pytest.mark.parametrize("quantize", [None, 4])
def test_qwen3_moe_every_mode_lossless(quantize):
    """The MoE path (SwitchGLU experts; 4-bit: quantized gather matmuls) on a dense-KV qwen3_moe:
    lookup, DSpark, DFlash and partial accepts identical to baseline and to mlx-lm."""
    path = write_family(_ROOT / f"qwen3_moe-{quantize}", "qwen3_moe", seed=2)
    tgt, tok = md.load_target(str(path), dtype="float32", quantize=quantize)
    assert tgt.rollback_kind == "trim"
    view = text_view(path, _ROOT / f"qwen3_moe-{quantize}-view")
    ds = load_drafter(str(write_deepspec(_ROOT / f"qwen3_moe-{quantize}-dspark", view)), tgt, bits=16)
    df = load_drafter(str(write_zlab(_ROOT / f"qwen3_moe-{quantize}-dflash", view)), tgt, bits=16)
    ids = md.encode_prompt(tok, "the fox def add hello world the fox")
    base = md.generate(tgt, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=40)
    assert base.tokens == independent_greedy(tgt, ids, 40, set(md.api.stop_token_ids(tgt, tok)))
    runs = [
        md.generate(tgt, tok, None, prompt_ids=ids, mode="lookup", max_new_tokens=40),
        md.generate(tgt, tok, None, prompt_ids=ids, mode="dspark", drafter=ds, max_new_tokens=40),
        md.generate(tgt, tok, None, prompt_ids=ids, mode="dflash", drafter=df, max_new_tokens=40),
        md.generate(
            tgt,
            tok,
            None,
            prompt_ids=ids,
            proposer=_ScriptedProposer(base.tokens + [0] * 64),
            max_new_tokens=40,
            max_draft=5,
        ),
    ]
    for r in runs:
        assert r.tokens == base.tokens and r.text == base.text
    assert max(runs[-1].accept_lengths) > 1


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next", "gemma3_text"])
def test_snapshot_restores_a_cache_that_continues_bitwise(name):
    """Target.snapshot at a prompt boundary, the original decoding on (writing in place), then
    Target.restore: the restored cache continues exactly as the original did, and a generation
    resumed from it (speculative, partial accepts) equals the cold baseline."""
    from test_rotating import gemma

    tgt, tok = gemma()[:2] if name == "gemma3_text" else family(name)[:2]
    ids = md.encode_prompt(tok, "the fox def add hello world the fox def add")
    cache = tgt.make_cache()
    tgt.forward(mx.array([ids[:-4]]), cache, last_only=True)
    for t in ids[-4:-1]:  # a few plain steps first: a sliding window now writes its ring in place
        tgt.forward(mx.array([[t]]), cache)
    snap = tgt.snapshot(cache)
    assert snap is not None
    steps = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49]
    a = mx.concatenate([tgt.forward(mx.array([[t]]), cache).logits for t in steps], axis=1)
    for _ in range(2):  # the snapshot is not written through by the original or by a restored copy
        r = tgt.restore(snap)
        b = mx.concatenate([tgt.forward(mx.array([[t]]), r).logits for t in steps], axis=1)
        assert np.array_equal(np.array(a), np.array(b))
        assert_same_states(cache, r)
    base = md.generate(tgt, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=40)
    resumed = loop.run(
        tgt,
        ids[-1:],
        _ScriptedProposer(base.tokens + [0] * 64),
        max_new_tokens=40,
        max_draft=5,
        cache=tgt.restore(snap),
        stop_token_ids=md.api.stop_token_ids(tgt, tok),
    )
    assert resumed.tokens == base.tokens
    assert max(resumed.accept_lengths) > 1
