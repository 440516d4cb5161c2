"""Drafter math against a float64 numpy reference of the spec (tests/drafter_reference.py).

Every packaging is loaded from disk through the real loader. The Gemma 4 details (proportional
partial RoPE, k_eq_v with scale-free v_norm, attention scale 1.0, sandwich norms, layer_scalar,
softcap before the Markov bias, embedding scale, plain RMSNorm weights) are each shown to be
observable: the reference matches, and the reference with that one detail changed does not.
"""

from __future__ import annotations

import math
import sys

import mlx.core as mx
import numpy as np
import pytest
from drafter_fixtures import target, workspace
from drafter_reference import MUTATIONS_GEMMA, Reference

from mlx_dspark.decode.drafting import confident_prefix
from mlx_dspark.decode.modes import drafter_proposer
from mlx_dspark.decode.sampling import SamplingParams
from mlx_dspark.errors import UserError
from mlx_dspark.models.checkpoints import build_spec
from mlx_dspark.models.drafter_backbone import ProportionalRoPE
from mlx_dspark.models.drafters import load_drafter

CASES = {  # fixture -> its target
    "dspark_qwen3": "target_qwen3",
    "dspark_gemma4": "target_gemma4",
    "dflash_deepspec": "target_qwen3",
    "dflash_zlab": "target_qwen3",
    "dflash_zlab_gemma4": "target_gemma4",
}
TOL = 2e-4


def _greedy(row, drafted):
    return mx.argmax(row).astype(mx.int32), None


def _two_rounds(key, seed=0):
    """MLX drafter over two rounds of context (9 rows, then 5 more): the second round's slot
    states, its tokens and confidences, plus the context rows and anchors used."""
    ws = workspace()
    tgt, _ = target(ws[CASES[key]])
    d = load_drafter(str(ws[key]), tgt, bits=16)
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((14, d.spec.backbone.context_dim)).astype(np.float32)
    state = d.new_state()
    h1 = d.block_hidden(17, mx.array(rows[:9]), state)
    h2 = d.block_hidden(23, mx.array(rows[9:]), state)
    assert state[0].offset == 14  # context kept, block rows dropped
    toks, _, conf = d.sample(h2, 23, _greedy, with_conf=d.spec.confidence)
    return d, rows, np.array(h1), np.array(h2), mx.stack(toks).tolist(), conf


@pytest.mark.parametrize("key", list(CASES))
def test_matches_reference(key):
    ws = workspace()
    d, rows, h1, h2, toks, conf = _two_rounds(key)
    ref = Reference(ws[key], ws[CASES[key]])
    assert np.abs(h1 - ref.hidden(rows[:9], 17)).max() < TOL
    rt, rz, rc, rh = ref.draft(rows, 23)
    assert np.abs(h2 - rh).max() < TOL
    assert toks == rt
    # Markov-corrected logits z_j (teacher-forced on the reference's previous tokens)
    U = d.logits(mx.array(h2))
    prevs = [23] + rt[:-1]
    for j in range(len(rt)):
        z = U[j]
        if d.spec.markov_rank:
            z = z + d.markov_bias(mx.array(prevs[j]))
        assert np.abs(np.array(z) - rz[j]).max() < TOL * 10
    if rc is not None:
        assert np.abs(np.array(conf) - rc).max() < TOL
    # slot convention: z-lab drafts B-1 slots (slot 0 is the anchor), DeepSpec all B
    assert len(toks) == {"dflash_zlab": 15, "dflash_zlab_gemma4": 7}.get(key, 7)


@pytest.mark.parametrize("mutation", MUTATIONS_GEMMA)
def test_gemma4_detail_is_observable(mutation):
    ws = workspace()
    _, rows, _, h2, _, _ = _two_rounds("dspark_gemma4")
    ref = Reference(ws["dspark_gemma4"], ws["target_gemma4"])
    _, rz, _, rh = ref.draft(rows, 23)
    _, mz, _, mh = Reference(ws["dspark_gemma4"], ws["target_gemma4"], mutate=mutation).draft(rows, 23)
    assert np.abs(h2 - rh).max() < TOL  # the spec's version matches the MLX drafter ...
    assert max(np.abs(mz - rz).max(), np.abs(mh - rh).max()) > 1e-2  # ... the changed one does not


def _gemma12b_shapes(H=3840, hd=512, nh=16, I=15360, V=262144, r=256, taps=5):
    s = {
        "fc.weight": (H, taps * H),
        "hidden_norm.weight": (H,),
        "norm.weight": (H,),
        "embed_tokens.weight": (V, H),
        "lm_head.weight": (V, H),
        "markov_head.markov_w1.weight": (V, r),
        "markov_head.markov_w2.weight": (V, r),
        "confidence_head.proj.weight": (1, H + r),
        "confidence_head.proj.bias": (1,),
    }
    for i in range(5):
        p = f"layers.{i}."
        s.update(
            {
                p + "self_attn.q_proj.weight": (nh * hd, H),
                p + "self_attn.k_proj.weight": (hd, H),
                p + "self_attn.o_proj.weight": (H, nh * hd),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (I, H),
                p + "mlp.up_proj.weight": (I, H),
                p + "mlp.down_proj.weight": (H, I),
                p + "layer_scalar": (1,),
            }
        )
    return s


def test_gemma4_12b_config_from_shapes(tmp_path):
    """The released Gemma-4-12B DSpark layout: dims from the tensors (global_head_dim 512, one KV
    head, k_eq_v), embed scale bf16(sqrt(3840)) = 62.0, proportional RoPE over 512 dims."""
    cfg = {
        "architectures": ["Gemma4DSparkModel"],
        "model_type": "gemma4_text",
        "block_size": 7,
        "head_dim": 256,
        "global_head_dim": 512,
        "num_key_value_heads": 8,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "final_logit_softcapping": 30.0,
        "markov_rank": 256,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "mask_token_id": 4,
        "target_layer_ids": [5, 17, 29, 41, 46],
        "num_hidden_layers": 5,
        "num_target_layers": 48,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_type": "proportional", "rope_theta": 1000000},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000},
        },
    }
    spec = build_spec(tmp_path, cfg, _gemma12b_shapes())
    b = spec.backbone
    assert (b.head_dim, b.num_heads, b.num_kv_heads, b.k_eq_v, b.attn_scale) == (512, 16, 1, True, 1.0)
    assert spec.embed_scale == 62.0 and spec.softcap == 30.0 and spec.kind == "dspark"
    freqs = np.array(ProportionalRoPE(512, 1e6, 0.25).freqs)
    assert np.isfinite(freqs[:64]).all() and np.isinf(freqs[64:]).all() and len(freqs) == 256
    assert np.allclose(1 / freqs[:64], 1e6 ** (-np.arange(64) * 2 / 512))


def test_confident_prefix_is_per_position():
    # sigmoid = 0.9, 0.8, 0.7: a cumulative product (0.9, 0.72, 0.504) would cut at 2 for 0.6
    s = [math.log(p / (1 - p)) for p in (0.9, 0.8, 0.7)]
    assert confident_prefix(s, 0.6) == 3
    assert confident_prefix(s, 0.75) == 2
    assert confident_prefix(s, 0.95) == 0
    assert confident_prefix(s, 0.0) == 3


def test_proposer_truncates_at_first_unconfident_slot():
    ws = workspace()
    tgt, _ = target(ws["target_qwen3"])
    d = load_drafter(str(ws["dspark_qwen3"]), tgt, bits=16)
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((12, d.spec.backbone.context_dim)).astype(np.float32)
    _, _, rc, _ = Reference(ws["dspark_qwen3"], ws["target_qwen3"]).draft(rows, 41)
    sig = 1 / (1 + np.exp(-rc))
    history = list(range(100, 112)) + [41]
    seen = set()
    for tau in sorted(set(np.round(sig, 6))) + [0.999]:
        tau = float(min(tau + 1e-4, 0.999))
        expect = next((j for j, c in enumerate(sig) if c < tau), len(sig))
        p = drafter_proposer(d, confidence_threshold=tau, lookup_drafts=False)
        p.begin(tgt, history[:-1], mx.array(rows))
        assert len(p.propose(history, 7, None).tokens) == expect
        seen.add(expect)
    assert len(seen) >= 3  # the thresholds really cut at different places


def test_sampled_drafts_report_markov_corrected_q(monkeypatch):
    """T > 0: each token is drawn from the q it reports, and q_j is the Markov-corrected
    distribution at the verify temperature given the token actually drawn at j-1."""
    monkeypatch.setenv("MLX_DSPARK_DRAFT_PANELS", "off")  # float32 weights, as the reference's
    ws = workspace()
    tgt, _ = target(ws["target_qwen3"])
    d = load_drafter(str(ws["dspark_qwen3"]), tgt, bits=16)
    rows = np.random.default_rng(2).standard_normal((10, d.spec.backbone.context_dim)).astype(np.float32)
    history = list(range(50, 60)) + [7]
    p = drafter_proposer(d, lookup_drafts=False)
    p.begin(tgt, history[:-1], mx.array(rows))
    draft = p.propose(history, 7, SamplingParams(temperature=0.8, seed=3))
    q = np.array(draft.q)
    assert q.shape == (7, tgt.vocab_size) and np.allclose(q.sum(-1), 1, atol=1e-5)
    assert all(q[j, t] > 0 for j, t in enumerate(draft.tokens))
    ref = Reference(ws["dspark_qwen3"], ws["target_qwen3"])
    U = ref.base_logits(ref.hidden(rows, 7))
    prevs = [7] + draft.tokens[:-1]
    for j, prev in enumerate(prevs):
        z = U[j] + ref.w["markov_head.markov_w2.weight"] @ ref.w["markov_head.markov_w1.weight"][prev]
        e = np.exp((z - z.max()) / 0.8)
        assert np.abs(q[j] - e / e.sum()).max() < 1e-4


def test_sampled_drafts_without_sampling_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlx_dspark.decode.sampled", None)
    ws = workspace()
    tgt, _ = target(ws["target_qwen3"])
    d = load_drafter(str(ws["dflash_zlab"]), tgt, bits=16)
    p = drafter_proposer(d, lookup_drafts=False)
    rows = np.zeros((4, d.spec.backbone.context_dim), np.float32)
    p.begin(tgt, [1, 2, 3, 4], mx.array(rows))
    with pytest.raises(UserError, match="lossless sampling"):
        p.propose([1, 2, 3, 4, 5], 4, SamplingParams(temperature=1.0))
