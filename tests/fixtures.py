"""Tiny models written to disk in the real Hugging Face layout.

Every test loads them the way a user's repo is loaded: `--model <dir>` -> config.json +
model.safetensors + tokenizer.json / tokenizer_config.json (with a chat template).
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np


def scratch_dir(prefix: str) -> Path:
    """A temporary folder that lives as long as the test process (module-level fixtures are written
    once per process) and is removed when it exits: test runs leave nothing in /tmp."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, True)
    return path


CORPUS = """
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
def add(a, b):
    return a + b
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)
for i in range(10):
    print(i, add(i, i))
Speculative decoding drafts several tokens and the target verifies them in one forward pass.
Please repeat the following passage exactly. Rewrite this function with a renamed variable.
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
Hello, world! How are you today? I am fine, thank you. What is the weather like in Paris?
1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 + - * / = ( ) [ ] { } < > : ; , . ! ?
Unicode: café, naïve, 日本語, emoji 🙂 and more.
"""

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]

# ChatML with tools and thinking, in the style of Qwen's template.
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{%- endif %}"
    "# Tools\n<tools>\n{%- for tool in tools %}{{ tool | tojson }}\n{%- endfor %}</tools>\n"
    'Call a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n'
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"  # noqa: E501
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    '{%- for tc in message.tool_calls or [] %}<tool_call>\n{"name": "{{ tc.function.name }}", "arguments": '
    "{{ tc.function.arguments | tojson if tc.function.arguments is not string else tc.function.arguments }}}\n</tool_call>"  # noqa: E501
    "{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
)


@lru_cache(maxsize=None)
def _trained_tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    return tok.to_str()


def write_tokenizer(path: Path, vocab_size: int = 384) -> int:
    """Write tokenizer.json + tokenizer_config.json; return the real vocab size."""
    path.mkdir(parents=True, exist_ok=True)
    text = _trained_tokenizer_json(vocab_size)
    (path / "tokenizer.json").write_text(text)
    n = len(json.loads(text)["model"]["vocab"])
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    return n


def _config(
    family: str, vocab: int, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, tie: bool, eos: int
) -> dict:
    head_dim = hidden // heads
    cfg = {
        "architectures": ["Qwen3ForCausalLM" if family == "qwen3" else "LlamaForCausalLM"],
        "model_type": family,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    return cfg


def write_model(
    path: Path,
    family: str = "qwen3",
    *,
    layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    tie: bool = True,
    seed: int = 0,
    vocab_size: int = 384,
    scale: float = 1.0,
    model_vocab: int = 0,
) -> Path:
    """A random model of `family` (qwen3 | llama; the hybrid and sliding-window families of
    family_fixtures.py by name) in the HF layout, tokenizer included.

    `model_vocab` pads the embedding/head past the tokenizer's vocabulary (to mimic a real
    model's 49152 or 151936 rows in benchmarks)."""
    from safetensors.numpy import save_file

    if family not in ("qwen3", "llama"):
        from family_fixtures import FAMILIES, write_family  # qwen3_5(_moe), qwen3_next, gemma3_text, qwen3_moe

        if family not in FAMILIES:
            raise ValueError(family)
        return write_family(path, family, layers=layers, hidden=hidden, seed=seed, vocab_size=vocab_size)
    path = Path(path)
    if path.exists():
        shutil.rmtree(path)
    vocab = max(write_tokenizer(path, vocab_size), model_vocab)
    eos = json.loads(_trained_tokenizer_json(vocab_size))["model"]["vocab"]["<|im_end|>"]
    cfg = _config(family, vocab, layers, hidden, heads, kv_heads, intermediate, tie, eos)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    rng = np.random.default_rng(seed)

    def w(*shape, std=0.02 * scale * 10):
        return (rng.standard_normal(shape) * std / np.sqrt(shape[-1] / 8)).astype(np.float32)

    t = {"model.embed_tokens.weight": w(vocab, hidden, std=1.0), "model.norm.weight": np.ones(hidden, np.float32)}
    if not tie:
        t["lm_head.weight"] = w(vocab, hidden)
    for i in range(layers):
        add_layer_tensors(t, i, family, w, hidden=hidden, heads=heads, kv_heads=kv_heads, intermediate=intermediate)
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def add_layer_tensors(
    t: dict,
    i: int,
    family: str,
    w,
    *,
    hidden: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    std: dict | None = None,
) -> None:
    """HF llama / qwen3 decoder layer i into t; w(*shape) draws a matrix (w(*shape, std=...) for
    the projections named in `std`: q k v o gate up down), always in the same order."""
    hd = hidden // heads
    std = std or {}

    def m(name, *shape):
        return w(*shape, std=std[name]) if name in std else w(*shape)

    p = f"model.layers.{i}."
    t[p + "self_attn.q_proj.weight"] = m("q", heads * hd, hidden)
    t[p + "self_attn.k_proj.weight"] = m("k", kv_heads * hd, hidden)
    t[p + "self_attn.v_proj.weight"] = m("v", kv_heads * hd, hidden)
    t[p + "self_attn.o_proj.weight"] = m("o", hidden, heads * hd)
    t[p + "mlp.gate_proj.weight"] = m("gate", intermediate, hidden)
    t[p + "mlp.up_proj.weight"] = m("up", intermediate, hidden)
    t[p + "mlp.down_proj.weight"] = m("down", hidden, intermediate)
    t[p + "input_layernorm.weight"] = np.ones(hidden, np.float32)
    t[p + "post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
    if family == "qwen3":
        t[p + "self_attn.q_norm.weight"] = np.ones(hd, np.float32)
        t[p + "self_attn.k_norm.weight"] = np.ones(hd, np.float32)
