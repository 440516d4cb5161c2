"""PrismML Bonsai packs: the ternary 2-bit pack (mlx-lm `prism_hadamard_qwen35`) runs every mode
through the hybrid path, lossless; the 1-bit pack is refused at load with a pointer to plain
mlx-vlm generation. Fixtures: tests/ternary_fixtures.py, loaded from disk, CPU float32."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import pytest
from drafter_fixtures import write_deepspec, write_zlab
from family_fixtures import text_view
from fixtures import scratch_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ternary_fixtures import write_one_bit, write_ternary
from test_hybrid import assert_same_states
from test_loop import _ScriptedProposer, independent_greedy

import mlx_dspark as md
from mlx_dspark.errors import UserError
from mlx_dspark.models.drafters import load_drafter

_ROOT = scratch_dir("mlx-dspark-ternary-")
_LOADED: dict = {}


def ternary():
    if not _LOADED:
        path = write_ternary(_ROOT / "ternary", seed=1)
        tgt, tok = md.load_target(str(path), dtype="float32")
        view = text_view(path, _ROOT / "ternary-view")
        drafters = {
            "dspark": load_drafter(str(write_deepspec(_ROOT / "t-dspark", view)), tgt, bits=16),
            "dflash": load_drafter(str(write_zlab(_ROOT / "t-dflash", view)), tgt, bits=16),
        }
        _LOADED["t"] = (tgt, tok, drafters)
    return _LOADED["t"]


def test_the_ternary_pack_loads_as_a_replayable_hybrid():
    from mlx_lm.models.prism_hadamard_qwen35 import HadamardQuantizedLinear

    tgt, _, _ = ternary()
    gdn = tgt.layers[0].linear_attn
    assert isinstance(gdn.in_proj_qkv, HadamardQuantizedLinear) and gdn.in_proj_qkv.bits == 2
    assert gdn.in_proj_qkv.block == 512
    assert tgt.rollback_kind == "replay" and tgt.rollback_refusal is None
    assert {type(c).__name__ for c in tgt.make_cache()} == {"ReplayArraysCache", "KVCache"}


@pytest.mark.parametrize("n", [0, 2, 5, 7])
def test_replay_on_the_ternary_pack_is_plain_decoding_bitwise(n):
    tgt, _, _ = ternary()
    prompt, block = [5, 9, 13, 2], [3, 1, 4, 1, 5, 9, 2]
    wide, plain = tgt.make_cache(), tgt.make_cache()
    for c in (wide, plain):
        tgt.forward(mx.array([prompt]), c)
    tgt.forward(mx.array([block]), wide)
    tgt.trim(wide, n)
    for t in block[: len(block) - n]:
        tgt.forward(mx.array([[t]]), plain)
    assert_same_states(wide, plain)


WORDS = ["the", "fox", "def", "add", "(a, b)", "return", "hello", "world", "1 2 3"]


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(prompt=st.lists(st.sampled_from(WORDS), min_size=1, max_size=8).map(" ".join), n=st.integers(1, 32))
def test_every_mode_is_lossless_on_the_ternary_pack(prompt, n):
    tgt, tok, drafters = ternary()
    ids = md.encode_prompt(tok, prompt)
    base = md.generate(tgt, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=n)
    assert base.tokens == independent_greedy(tgt, ids, n, set(md.api.stop_token_ids(tgt, tok)))
    runs = [md.generate(tgt, tok, None, prompt_ids=ids, mode="lookup", max_new_tokens=n, max_draft=4)]
    for mode, d in drafters.items():
        runs.append(md.generate(tgt, tok, None, prompt_ids=ids, mode=mode, drafter=d, max_new_tokens=n))
    prop = _ScriptedProposer(base.tokens + [0] * 64)
    runs.append(md.generate(tgt, tok, None, prompt_ids=ids, proposer=prop, max_new_tokens=n, max_draft=5))
    for r in runs:
        assert r.tokens == base.tokens and r.text == base.text
        assert "speculation_off" not in r.stats
    if n > 2:
        assert max(runs[-1].accept_lengths) > 1


def test_the_one_bit_pack_is_refused_with_a_pointer(tmp_path):
    path = write_one_bit(tmp_path / "one-bit")
    with pytest.raises(UserError, match=r"1-bit pack.*mlx_vlm\.generate --model"):
        md.load_target(str(path))
    r = subprocess.run(
        [sys.executable, "-m", "mlx_dspark", "generate", "--model", str(path), "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    assert "1-bit pack" in lines[0] and "mlx_vlm.generate" in lines[0]


def test_per_module_one_bit_overrides_are_refused_too():
    from mlx_dspark.models.packs import one_bit_refusal

    assert one_bit_refusal({"quantization": {"bits": 2, "group_size": 128}}, "m") is None
    assert one_bit_refusal({"quantization": {"bits": 4, "model.layers.0.mlp": {"bits": 1}}}, "m")
    assert one_bit_refusal({"text_config": {"quantization_config": {"bits": 1}}}, "m")
    assert one_bit_refusal({}, "m") is None
