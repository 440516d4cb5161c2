"""GGUF import on tiny models written to disk in the real format.

Each fixture writes a GGUF the way llama.cpp's converter does (Q/K rows permuted for its RoPE,
Gemma norms stored as 1 + w) from known original weights. The converted folder, loaded by the
product's own loader, must reproduce a float64 numpy reference of the *original* weights: a
converter that forgets or misapplies the permutation fails here (see the negative control).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from mlx_dspark.errors import UserError
from mlx_dspark.models import gguf as G
from mlx_dspark.models.gguf import quant as gq

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 256, 4, 2, 512, 2
HEAD_DIM = HIDDEN // HEADS
EPS, THETA = 1e-5, 10000.0
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "o u", "e r", "Ġ s", "r e", "o n", "Ġ w", "a t", "e n"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPT = [1, 40, 77, 258, 3, 99, 260, 150, 200, 17, 255, 64]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "cache"))


# ------------------------------------------------------------------------- writing GGUFs
def _byte_tokens() -> list[str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def _vocab() -> list[str]:
    return SPECIALS + _byte_tokens() + [m.replace(" ", "") for m in MERGES]


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py, LlamaModel.permute, verbatim in numpy."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def original_weights(
    seed: int, arch: str = "llama", vocab: int | None = None, tied: bool = True, layers: int = LAYERS
) -> dict:
    rng = np.random.default_rng(seed)
    V = vocab or len(_vocab())

    def mat(r, c, s=0.06):
        return (rng.standard_normal((r, c)) * s).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    W = {"token_embd": mat(V, HIDDEN, 0.5), "output_norm": norm(HIDDEN)}
    if not tied:
        W["output"] = mat(V, HIDDEN, 0.1)
    for i in range(layers):
        b = f"blk.{i}."
        W.update(
            {
                b + "attn_norm": norm(HIDDEN),
                b + "ffn_norm": norm(HIDDEN),
                b + "attn_q": mat(HEADS * HEAD_DIM, HIDDEN),
                b + "attn_k": mat(KV_HEADS * HEAD_DIM, HIDDEN),
                b + "attn_v": mat(KV_HEADS * HEAD_DIM, HIDDEN),
                b + "attn_output": mat(HIDDEN, HEADS * HEAD_DIM),
                b + "ffn_gate": mat(FFN, HIDDEN),
                b + "ffn_up": mat(FFN, HIDDEN),
                b + "ffn_down": mat(HIDDEN, FFN),
            }
        )
        if arch == "gemma3":
            W.update(
                {
                    b + "post_attention_norm": norm(HIDDEN),
                    b + "post_ffw_norm": norm(HIDDEN),
                    b + "attn_q_norm": norm(HEAD_DIM),
                    b + "attn_k_norm": norm(HEAD_DIM),
                }
            )
    return W


def _random_kquant(rows: int, cols: int, qtype: QT, rng) -> np.ndarray:
    """Valid random blocks of a K-quant (the gguf package can dequantize but not quantize these)."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, (rows, cols // block)) * 1e-4).astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    if qtype in (QT.Q6_K, QT.Q3_K):  # d last: Q6_K ql, qh, scales, d; Q3_K hmask, qs, scales, d
        raw[..., -2:] = d
    else:  # Q2_K..Q5_K: d, dmin first (Q2_K: after 80 bytes of scales and qs)
        at = 80 if qtype == QT.Q2_K else 0
        raw[..., at : at + 2] = d
        raw[..., at + 2 : at + 4] = d
    return raw.reshape(rows, -1)


def encode(W: dict, types: dict, seed: int = 0) -> tuple[dict, dict]:
    """GGUF payloads for the original weights `W`, and the values the file really holds (in the
    original row order): what a correct import must reproduce."""
    rng = np.random.default_rng(seed + 1)
    stored, exact = {}, {}
    for name, w in W.items():
        qtype = types.get(name, QT.F32) if w.ndim == 2 else QT.F32
        if qtype in (QT.F32, QT.F16):
            data = w.astype(np.float16 if qtype == QT.F16 else np.float32)
            value = data.astype(np.float32)
        elif qtype in (QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K):
            data = _random_kquant(*w.shape, qtype, rng)
            value = dequantize(data, qtype)
        else:
            data = quantize(w, qtype)
            value = dequantize(data, qtype)
        stored[name], exact[name] = (data, qtype), value.astype(np.float32)
    return stored, exact


def write_gguf(
    path: Path,
    W: dict,
    types: dict | None = None,
    arch: str = "llama",
    seed: int = 0,
    extra_tensor: tuple | None = None,
    arch_name: str | None = None,
    theta: float = THETA,
) -> dict:
    """Write a GGUF as llama.cpp's converter would; return the exact original-order values."""
    types = types or {}
    stored, exact = encode(W, types, seed)
    w = GGUFWriter(str(path), arch_name or arch)
    p = (arch_name or arch) + "."
    w.add_uint32(p + "block_count", sum(1 for n in W if n.endswith(".attn_norm")))
    w.add_uint32(p + "context_length", 512)
    w.add_uint32(p + "embedding_length", HIDDEN)
    w.add_uint32(p + "feed_forward_length", FFN)
    w.add_uint32(p + "attention.head_count", HEADS)
    w.add_uint32(p + "attention.head_count_kv", KV_HEADS)
    w.add_float32(p + "rope.freq_base", theta if arch == "llama" else 1_000_000.0)
    w.add_float32(p + "attention.layer_norm_rms_epsilon", EPS)
    if arch == "llama":
        w.add_uint32(p + "rope.dimension_count", HEAD_DIM)
    else:
        w.add_uint32(p + "attention.key_length", HEAD_DIM)
        w.add_uint32(p + "attention.value_length", HEAD_DIM)
        w.add_uint32(p + "attention.sliding_window", 4)
    vocab = _vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    for name, (data, qtype) in stored.items():
        if arch == "llama" and name.endswith(("attn_q", "attn_k")):
            data = llamacpp_permute(data, HEADS if name.endswith("attn_q") else KV_HEADS)
        if arch == "gemma3" and name.endswith("norm"):
            data = data + np.float32(1.0)  # llama.cpp stores Gemma's (1 + w)
        raw = qtype not in (QT.F32, QT.F16)
        w.add_tensor(name + ".weight", data, raw_dtype=qtype if raw else None)
    if extra_tensor:
        w.add_tensor(*extra_tensor[:2], raw_dtype=extra_tensor[2])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return exact


# ------------------------------------------------------------------------- the reference
def _rms(x, w):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w


def _rope(x, pos, base):  # HF rotate-half RoPE on [heads, T, D]
    d = x.shape[-1]
    inv = 1.0 / base ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + np.concatenate([-x2, x1], -1) * sin


def llama_reference(W: dict, tokens: list[int]) -> np.ndarray:
    """Float64 logits of a Llama model in HF's layout (unpermuted Q/K, rotate-half RoPE)."""
    W = {k: v.astype(np.float64) for k, v in W.items()}
    T = len(tokens)
    pos = np.arange(T, dtype=np.float64)
    h = W["token_embd"][tokens]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(LAYERS):
        b = f"blk.{i}."
        x = _rms(h, W[b + "attn_norm"])
        q = (x @ W[b + "attn_q"].T).reshape(T, HEADS, HEAD_DIM).transpose(1, 0, 2)
        k = (x @ W[b + "attn_k"].T).reshape(T, KV_HEADS, HEAD_DIM).transpose(1, 0, 2)
        v = (x @ W[b + "attn_v"].T).reshape(T, KV_HEADS, HEAD_DIM).transpose(1, 0, 2)
        q, k = _rope(q, pos, THETA), _rope(k, pos, THETA)
        k, v = np.repeat(k, HEADS // KV_HEADS, 0), np.repeat(v, HEADS // KV_HEADS, 0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(HEAD_DIM) + mask
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        h = h + (p @ v).transpose(1, 0, 2).reshape(T, -1) @ W[b + "attn_output"].T
        x = _rms(h, W[b + "ffn_norm"])
        g = x @ W[b + "ffn_gate"].T
        h = h + ((g / (1 + np.exp(-g))) * (x @ W[b + "ffn_up"].T)) @ W[b + "ffn_down"].T
    h = _rms(h, W["output_norm"])
    return h @ W.get("output", W["token_embd"]).T


def our_logits(folder: Path, tokens: list[int]) -> np.ndarray:
    from mlx_lm.utils import load

    model, _ = load(str(folder))
    return np.array(model(mx.array([tokens]))[0].astype(mx.float32)).astype(np.float64)


def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


# ------------------------------------------------------------------------------- tests
ALL = ["token_embd", "output"] + [
    f"blk.{i}.{n}"
    for i in range(LAYERS)
    for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
]


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.Q8_0, QT.Q4_0, QT.Q4_1])
def test_llama_matches_float64_reference(tmp_path, qtype):
    W = original_weights(seed=int(qtype), tied=False)
    exact = write_gguf(tmp_path / "m.gguf", W, {n: qtype for n in ALL})
    out = G.convert_gguf(tmp_path / "m.gguf", tmp_path / "out", dtype="float32")
    err = rel_err(our_logits(out, PROMPT), llama_reference(exact, PROMPT))
    assert err < 1e-5, f"{qtype.name}: logits differ from the reference by {err:.2e} of their scale"


def test_permutation_is_what_makes_it_match(tmp_path, monkeypatch):
    """Negative control: the same file imported without undoing the permutation is far off."""
    W = original_weights(seed=3)
    exact = write_gguf(tmp_path / "m.gguf", W, {n: QT.Q8_0 for n in ALL})
    ref = llama_reference(exact, PROMPT)
    monkeypatch.setattr(gq, "permute_rows", lambda a, n: a)
    wrong = G.convert_gguf(tmp_path / "m.gguf", tmp_path / "wrong", dtype="float32")
    assert rel_err(our_logits(wrong, PROMPT), ref) > 1e-2
    monkeypatch.undo()
    right = G.convert_gguf(tmp_path / "m.gguf", tmp_path / "right", dtype="float32")
    assert rel_err(our_logits(right, PROMPT), ref) < 1e-5


def test_permute_rows_inverts_llamacpp():
    a = np.arange(12 * 5).reshape(12, 5)
    for n in (1, 2, 3, 6):
        assert np.array_equal(gq.permute_rows(llamacpp_permute(a, n), n), a)


def test_kquants_and_mixed_types(tmp_path):
    W = original_weights(seed=5)
    types = {
        n: t
        for n, t in zip(
            ALL,
            [
                QT.Q8_0,
                QT.F32,
                QT.Q4_K,
                QT.Q6_K,
                QT.Q5_K,
                QT.Q3_K,
                QT.Q2_K,
                QT.Q5_0,
                QT.Q5_1,
                QT.Q4_K,
                QT.Q6_K,
                QT.Q4_1,
                QT.F16,
                QT.Q4_0,
                QT.Q8_0,
                QT.Q4_K,
            ],
        )
    }
    exact = write_gguf(tmp_path / "m.gguf", W, types)
    out = G.convert_gguf(tmp_path / "m.gguf", tmp_path / "out", dtype="float32")
    assert rel_err(our_logits(out, PROMPT), llama_reference(exact, PROMPT)) < 1e-5


@pytest.mark.parametrize("qtype,bits", [(QT.Q4_0, 4), (QT.Q4_1, 4), (QT.Q8_0, 8), (QT.Q4_1, 8)])
def test_exact_affine_requantization(tmp_path, qtype, bits):
    """--quantize keeps Q4_0/Q4_1/Q8_0 blocks bit-exact (group 32), rows un-permuted, scales float32."""
    W = original_weights(seed=7)
    exact = write_gguf(tmp_path / "m.gguf", W, {n: qtype for n in ALL})
    out = G.convert_gguf(tmp_path / "m.gguf", tmp_path / "out", dtype="float32", quantize=bits)
    saved = mx.load(str(out / "model.safetensors"))
    hf = {
        "blk.0.attn_q": "model.layers.0.self_attn.q_proj",
        "blk.1.attn_k": "model.layers.1.self_attn.k_proj",
        "blk.0.ffn_down": "model.layers.0.mlp.down_proj",
        "token_embd": "model.embed_tokens",
    }
    for g, name in hf.items():
        assert saved[f"{name}.scales"].dtype == mx.float32
        deq = mx.dequantize(
            saved[f"{name}.weight"], saved[f"{name}.scales"], saved[f"{name}.biases"], group_size=32, bits=bits
        )
        assert np.array_equal(np.array(deq), exact[g]), g
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"]["model.layers.0.self_attn.q_proj"] == {"group_size": 32, "bits": bits, "mode": "affine"}
    assert rel_err(our_logits(out, PROMPT), llama_reference(exact, PROMPT)) < 1e-4


def test_requantize_float_and_dtypes(tmp_path):
    W = original_weights(seed=9)
    exact = write_gguf(tmp_path / "m.gguf", W, {n: QT.F16 for n in ALL})
    ref = llama_reference(exact, PROMPT)
    q8 = G.convert_gguf(tmp_path / "m.gguf", tmp_path / "q8", dtype="float32", quantize=8)
    cfg = json.loads((q8 / "config.json").read_text())
    assert cfg["quantization"]["model.layers.0.mlp.up_proj"]["group_size"] == 64
    assert rel_err(our_logits(q8, PROMPT), ref) < 2e-2
    q4 = G.convert_gguf(tmp_path / "m.gguf", tmp_path / "q4", dtype="float32", quantize=4)
    assert rel_err(our_logits(q4, PROMPT), ref) < 0.3
    for dt, tol in (("bfloat16", 5e-2), ("float16", 1e-2)):
        out = G.convert_gguf(tmp_path / "m.gguf", tmp_path / dt, dtype=dt)
        assert mx.load(str(out / "model.safetensors"))["model.norm.weight"].dtype == getattr(mx, dt)
        assert rel_err(our_logits(out, PROMPT), ref) < tol


def test_gemma3_matches_mlx_lm_on_original_weights(tmp_path):
    """Gemma norms are stored as 1 + w; the import must give mlx-lm's Gemma 3 the original w."""
    from mlx_lm.models import gemma3_text

    W = original_weights(seed=11, arch="gemma3", layers=6)  # mlx-lm's Gemma 3 wants a full 5:1 pattern
    types = {n: QT.Q8_0 for n, w in W.items() if w.ndim == 2}
    exact = write_gguf(tmp_path / "g.gguf", W, types, arch="gemma3")
    out = G.convert_gguf(tmp_path / "g.gguf", tmp_path / "out", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["tie_word_embeddings"] is True
    ref_model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(cfg))
    names = {"token_embd": "model.embed_tokens.weight", "output_norm": "model.norm.weight"}
    per_block = {
        "attn_norm": "input_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    for i in range(6):
        for g, h in per_block.items():
            names[f"blk.{i}.{g}"] = f"model.layers.{i}.{h}.weight"
    ref_model.load_weights(list(ref_model.sanitize({names[k]: mx.array(v) for k, v in exact.items()}).items()))
    tokens = PROMPT * 2  # 24 tokens: past the sliding window of 4
    ref = np.array(ref_model(mx.array([tokens]))[0]).astype(np.float64)
    assert rel_err(our_logits(out, tokens), ref) < 1e-5


def test_tokenizer_chat_template_and_load_target(tmp_path):
    from mlx_dspark.models.loading import load_target

    write_gguf(tmp_path / "m.gguf", original_weights(seed=13), {n: QT.Q8_0 for n in ALL})
    target, tok = load_target(str(tmp_path / "m.gguf"), dtype="float32")  # runs the Target probe
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi the sun"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhi the sun<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(2) == 1 and _vocab().index("Ġthe") in ids
    assert tok.decode(ids) == text
    assert tok.eos_token_id == 2
    assert target.vocab_size == len(_vocab()) and target.model_type == "llama"


def test_cache_reuses_conversion_and_tracks_the_file(tmp_path, monkeypatch):
    src = tmp_path / "m.gguf"
    write_gguf(src, original_weights(seed=15), {n: QT.Q4_0 for n in ALL})
    a = G.convert_gguf_cached(src, dtype="float32", quantize=None)
    assert a.parent == tmp_path / "cache" / "gguf"
    calls = []
    with monkeypatch.context() as patched:  # only the converter is stubbed; the cache stays in tmp_path
        patched.setattr(G, "convert_gguf", lambda *a, **k: calls.append(1))
        t = time.perf_counter()
        assert G.convert_gguf_cached(src, dtype="float32", quantize=None) == a
        assert time.perf_counter() - t < 1.0 and not calls
    q = G.cache_dir_for(src, "float32", 4)
    assert q != a and "q4" in q.name
    index = json.loads((tmp_path / "cache" / "gguf" / "hashes.json").read_text())
    assert index[str(src.resolve())]["sha256"] == json.loads((a / G.SOURCE_FILE).read_text())["sha256"]
    write_gguf(src, original_weights(seed=16), {n: QT.Q4_0 for n in ALL})  # new content, same path
    os.utime(src, ns=(time.time_ns(), time.time_ns() + 10**9))
    b = G.convert_gguf_cached(src, dtype="float32", quantize=None)
    assert b != a and b.exists() and b.parent == tmp_path / "cache" / "gguf"


# ---------------------------------------------------------------------------- bad input
def _small(tmp_path, **kw) -> Path:
    path = tmp_path / "small.gguf"
    write_gguf(path, original_weights(seed=17), {n: QT.Q8_0 for n in ALL}, **kw)
    return path


@pytest.mark.parametrize("keep", [3, 100, 2000, 0.5, -1])
def test_truncated_file_is_refused(tmp_path, keep):
    src = _small(tmp_path)
    data = src.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else (len(data) + keep if keep < 0 else keep)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:n])
    with pytest.raises(UserError, match="truncated|not a readable GGUF"):
        G.convert_gguf(cut, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_not_a_gguf_is_refused(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(UserError, match="not a readable GGUF.*bad magic"):
        G.convert_gguf(bad, tmp_path / "out")


def test_unsupported_architecture_is_named(tmp_path):
    src = _small(tmp_path, arch_name="qwen2")
    with pytest.raises(UserError, match="architecture 'qwen2' is not supported.*llama and gemma3"):
        G.convert_gguf_cached(src, dtype="float32", quantize=None)


def test_unsupported_quant_type_is_named(tmp_path):
    block, size = GGML_QUANT_SIZES[QT.IQ4_NL]
    raw = np.zeros((HIDDEN, HIDDEN // block * size), dtype=np.uint8)
    src = _small(tmp_path, extra_tensor=("blk.0.attn_sub_norm.weight", raw, QT.IQ4_NL))
    with pytest.raises(UserError, match=r"blk\.0\.attn_sub_norm\.weight uses GGML type IQ4_NL.*supported: .*Q4_K"):
        G.convert_gguf(src, tmp_path / "out")


def test_bad_options(tmp_path):
    src = _small(tmp_path)
    with pytest.raises(UserError, match="dtype="):
        G.convert_gguf(src, tmp_path / "o1", dtype="float64")
    with pytest.raises(UserError, match="quantize="):
        G.convert_gguf(src, tmp_path / "o2", quantize=3)
    with pytest.raises(UserError, match="does not exist"):
        G.convert_gguf_cached(tmp_path / "missing.gguf")


# ------------------------------------------------------------------- RoPE scaling, CLI
def _llama3_factors(factor=8.0, low=1.0, high=4.0, old=8192, base=500000.0) -> np.ndarray:
    """convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors (rope_freqs), in numpy."""
    freqs = 1.0 / base ** (np.arange(0, HEAD_DIM, 2, dtype=np.float64) / HEAD_DIM)
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path):
    src = _small(tmp_path, extra_tensor=("rope_freqs.weight", _llama3_factors(factor=32.0), None), theta=500000.0)
    out = G.convert_gguf(src, tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    bad = tmp_path / "bad"
    bad.mkdir()
    src = _small(
        bad,
        extra_tensor=("rope_freqs.weight", np.linspace(1, 3, HEAD_DIM // 2, dtype=np.float32), None),
        theta=500000.0,
    )
    with pytest.raises(UserError, match="rope_freqs"):
        G.convert_gguf(src, tmp_path / "out2")


def test_convert_subcommand(tmp_path, capsys):
    from mlx_dspark.cli.main import main

    src = _small(tmp_path)
    assert main(["convert", str(src), "--out", str(tmp_path / "mlx"), "--quantize", "8", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["quantize"] == 8 and info["architecture"] == "llama" and info["tensor_types"]["Q8_0"] > 0
    assert (tmp_path / "mlx" / "tokenizer.json").exists() and (tmp_path / "mlx" / "model.safetensors").exists()
    assert main(["convert", str(src), "--out", str(tmp_path / "mlx")]) == 2  # not empty
    assert "not empty" in capsys.readouterr().err
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(src.read_bytes()[:500])
    assert main(["convert", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "truncated" in err and "Traceback" not in err and err.count("\n") == 1


def test_gemma3_tokenizer_on_a_transformers_without_its_key(tmp_path, monkeypatch):
    """Releases of transformers whose converter table lacks "gemma3" (5.17, the H200 image: it has
    "gemma3_text" and "gemma2") build Gemma 3's tokenizer under the first alias they know; the files
    are the same as where the key exists."""
    from mlx_dspark.models.gguf import tokenizer as T

    W = original_weights(seed=11, arch="gemma3", layers=6)
    write_gguf(tmp_path / "g.gguf", W, {n: QT.Q8_0 for n, w in W.items() if w.ndim == 2}, arch="gemma3")
    G.convert_gguf(tmp_path / "g.gguf", tmp_path / "with-key", dtype="float32")
    import transformers  # the release that built the tokenizer: without it, 5.0-5.17 take the folder for Mistral's

    cfg = json.loads((tmp_path / "with-key" / "config.json").read_text())
    assert cfg["transformers_version"] == transformers.__version__
    mapping, convert = T._converter()
    asked = []

    def old_convert(arch, tok_dict):
        asked.append(arch)
        if arch in ("gemma3", "gemma3_text"):
            raise KeyError(arch)
        return convert("gemma3", tok_dict)  # what the key's converter builds

    monkeypatch.setattr(T, "_converter", lambda: (mapping, old_convert))
    G.convert_gguf(tmp_path / "g.gguf", tmp_path / "without-key", dtype="float32")
    assert asked == ["gemma3", "gemma3_text", "gemma2"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "without-key" / name).read_bytes() == (tmp_path / "with-key" / name).read_bytes()

    def no_converter(arch, tok_dict):
        raise KeyError(arch)

    monkeypatch.setattr(T, "_converter", lambda: (mapping, no_converter))
    with pytest.raises(UserError, match="could not build a tokenizer"):
        G.convert_gguf(tmp_path / "g.gguf", tmp_path / "none", dtype="float32")
