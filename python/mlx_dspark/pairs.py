"""Python API for target + drafter pairs.

    from mlx_dspark.pairs import load_pair, speculative_generate
    target, tok, drafter, cfg = load_pair("mlx-community/Qwen3-8B-8bit")   # drafter from the registry
    res = speculative_generate(target, tok, drafter, "Explain how rainbows form.")

    from mlx_dspark.pairs import load_dflash_pair, dflash_generate
    target, tok, drafter, cfg = load_dflash_pair("Qwen/Qwen3-4B", drafter="z-lab/Qwen3-4B-DFlash-b16")
    res = dflash_generate(target, tok, drafter, "Write a binary search in Python.")  # full block

Every call runs through the one verify loop; output equals plain decoding of the target.
"""

from __future__ import annotations

from typing import Sequence

from .api import GenerationResult, generate
from .decode.sampling import SamplingParams
from .errors import UserError
from .models.loading import load_target


def load_pair(
    model: str,
    drafter: str | None = None,
    *,
    mode: str = "auto",
    bits: int | None = None,
    dtype: str | None = None,
    quantize: int | None = None,
    kv_bits: int | None = None,
    probe: bool = True,
    draft_vocab="auto",
):
    """(target, tokenizer, drafter, config) for `model`. The drafter comes from `drafter`
    (repo id or folder) or the registry; it is None only for mode auto without a registered
    drafter (generation then falls back to lookup). `bits`: 4 / 8 / 16, or None = 4 on a GPU and
    16 on the CPU backend. `draft_vocab`: auto / full / N (models/draft_vocab.py). `config`
    describes the pair."""
    if mode not in ("auto", "dspark", "dflash"):
        raise UserError(f"load_pair mode must be auto, dspark or dflash, got {mode!r}")
    from .models.drafters import resolve_drafter

    target, tokenizer = load_target(model, dtype=dtype, quantize=quantize, kv_bits=kv_bits, probe=probe)
    d = resolve_drafter(target, mode=mode, drafter=drafter, bits=bits, draft_vocab=draft_vocab)
    config = {"model": str(model), "mode": d.kind if d is not None else "lookup", "drafter": None}
    if d is not None:
        config.update(drafter=d.source, **{k: v for k, v in d.describe().items() if k != "source"})
    return target, tokenizer, d, config


def load_dflash_pair(model: str, drafter: str | None = None, **kwargs):
    """load_pair restricted to DFlash drafters (z-lab's or DeepSpec's packaging)."""
    return load_pair(model, drafter, mode="dflash", **kwargs)


def _sampling(temperature, top_p, top_k, min_p, presence_penalty, frequency_penalty, seed, logprobs):
    return SamplingParams(
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        min_p=float(min_p),
        presence_penalty=float(presence_penalty),
        frequency_penalty=float(frequency_penalty),
        seed=seed,
        logprobs=bool(logprobs),
        top_logprobs=int(logprobs) if logprobs else 0,
    )


def speculative_generate(
    target,
    tokenizer,
    drafter,
    prompt="",
    *,
    prompt_ids: Sequence[int] | None = None,
    max_new_tokens: int = 256,
    max_draft_tokens: int | None = None,
    confidence_threshold: float = 0.0,
    lookup_drafts: bool = True,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    seed: int | None = None,
    logprobs: int = 0,
    stop: Sequence[str] = (),
    apply_chat_template: bool = True,
    enable_thinking: bool | None = None,
    on_text=None,
) -> GenerationResult:
    """Generate with `drafter` (DSpark or DFlash; None = lookup). `max_draft_tokens` None or 0
    drafts the full block each round."""
    mode = drafter.kind if drafter is not None else "auto"
    return generate(
        target,
        tokenizer,
        prompt if prompt_ids is None else None,
        prompt_ids=prompt_ids,
        mode=mode,
        drafter=drafter,
        max_new_tokens=max_new_tokens,
        max_draft=max_draft_tokens,
        sampling=_sampling(temperature, top_p, top_k, min_p, presence_penalty, frequency_penalty, seed, logprobs),
        stop=stop,
        chat_template=apply_chat_template,
        enable_thinking=enable_thinking,
        on_text=on_text,
        confidence_threshold=confidence_threshold,
        lookup_drafts=lookup_drafts,
    )


def dflash_generate(
    target, tokenizer, drafter, prompt="", *, max_draft_tokens: int | None = None, lookup_drafts: bool = False, **kwargs
) -> GenerationResult:
    """speculative_generate for a DFlash drafter; `max_draft_tokens=None` = the full block.
    Hybrid lookup drafts are off by default here, as in upstream's dflash_generate."""
    if drafter is not None and drafter.kind != "dflash":
        raise UserError(f"dflash_generate needs a DFlash drafter; {drafter.source} is a {drafter.kind} drafter")
    return speculative_generate(
        target, tokenizer, drafter, prompt, max_draft_tokens=max_draft_tokens, lookup_drafts=lookup_drafts, **kwargs
    )


__all__ = ["load_pair", "load_dflash_pair", "speculative_generate", "dflash_generate"]
