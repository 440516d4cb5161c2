"""The tokenizer a GGUF file describes, as Hugging Face tokenizer files (tokenizer.json,
tokenizer_config.json with the chat template), which mlx-lm loads like any other.

The vocabulary-to-tokenizer rules (byte-level BPE, sentencepiece, Gemma's quirks, pre-tokenizer
regexes per `tokenizer.ggml.pre`) are transformers' GGUF converters. We feed them the metadata
our own reader parsed, instead of calling `from_pretrained(gguf_file=...)`: that path imports
torch (transformers 5.x) and re-reads the file with a slow reader (4.x).
"""

from __future__ import annotations

from pathlib import Path

from ...errors import UserError


def _converter():
    """(GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer) from whichever transformers is installed."""
    try:  # transformers 5.x
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:  # transformers 4.x
        from transformers.integrations.ggml import convert_gguf_tokenizer
        from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING as M

        GGUF_TOKENIZER_MAPPING = {
            "tokenizer": M["tokenizer"]["tokenizer"],
            "tokenizer_config": M["tokenizer_config"]["tokenizer"],
        }
    return GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer


# The names under which transformers releases file an architecture's GGUF tokenizer rules. The
# file says "gemma3"; releases of transformers 5.x before its tokenizer-builder rewrite (5.17 on
# the H200 image) look the converter up in a table keyed "gemma3_text" and "gemma2" (KeyError on
# "gemma3"); all of them build Gemma's sentencepiece tokenizer.
TOKENIZER_ALIASES = {
    "gemma3": ("gemma3_text", "gemma2"),
    "gemma4": ("gemma4_text", "gemma2"),
}


def convert_for(convert, arch: str, tok_dict: dict):
    """convert(arch, tok_dict), else under the first alias the installed transformers knows."""
    names = (arch, *TOKENIZER_ALIASES.get(arch, ()))
    for name in names:
        try:
            return convert(name, tok_dict)
        except KeyError as e:  # only "no converter under this name" moves on to the next
            if e.args[:1] != (name,) or name == names[-1]:
                raise


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def _plain(v):
    return v.tolist() if hasattr(v, "tolist") else v


def tokenizer_parts(meta: dict, mapping: dict) -> tuple[str, dict, dict]:
    """(architecture, tokenizer_dict, tokenizer_config) as transformers' GGUF path builds them."""
    groups = {
        group: {name: _plain(meta[f"tokenizer.{key}"]) for key, name in renames.items() if f"tokenizer.{key}" in meta}
        for group, renames in mapping.items()
    }
    tok, cfg = groups["tokenizer"], groups["tokenizer_config"]
    if tok.get("tokenizer_type") == "llama":
        cfg.setdefault("add_bos_token", True)  # llama.cpp's default for sentencepiece vocabularies
    tokens = tok.get("tokens") or []
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        idx = meta.get(f"tokenizer.ggml.{key}")
        cfg[name] = tokens[int(idx)] if idx is not None and int(idx) < len(tokens) else None
    return str(meta.get("general.architecture")), tok, cfg


def write_tokenizer(meta: dict, out: Path, source: str) -> None:
    """Write tokenizer.json, tokenizer_config.json (and chat_template.jinja) into `out`."""
    import logging

    from transformers import PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    if not meta.get("tokenizer.ggml.tokens"):
        raise UserError(f"{source}: the GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)
    try:
        mapping, convert = _converter()
        arch, tok_dict, tok_cfg = tokenizer_parts(meta, mapping)
        backend, extra = convert_for(convert, arch, tok_dict)
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, **{**tok_cfg, **extra})
        tok.save_pretrained(str(out))
    except UserError:
        raise
    except Exception as e:  # an unknown tokenizer model, or a transformers without GGUF converters
        raise UserError(
            f"{source}: could not build a tokenizer from its GGUF metadata "
            f"(tokenizer.ggml.model={meta.get('tokenizer.ggml.model')!r}; "
            f"{type(e).__name__}: {str(e)[:200]})"
        ) from None
    finally:
        hf_logging.set_verbosity(level)
