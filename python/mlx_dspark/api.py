"""The Python API: load a target, generate text through the one verify loop."""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from .decode import loop
from .decode.modes import DEFAULT_MAX_DRAFT, make_proposer
from .decode.sampling import SamplingParams
from .decode.text_stream import TextStream
from .errors import UserError, option
from .models.loading import load_target
from .models.target import Target


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    prompt_tokens: int
    accept_lengths: list[int]
    finish_reason: str
    prefill_s: float
    decode_s: float
    mode: str = ""
    model: str = ""
    logprobs: list[dict] | None = None
    stats: dict = field(default_factory=dict)
    stop_string: str | None = None  # the stop string that ended generation, if one did
    cached_tokens: int = 0  # prompt tokens a prefix cache supplied (not prefilled again)
    prefix_cache: dict | None = None  # what the prefix cache did: mode, hit, reused_tokens, a miss's cause

    @property
    def rounds(self) -> int:
        return len(self.accept_lengths)

    @property
    def mean_accept_len(self) -> float:
        """Tokens committed per decode forward (accepted drafts + 1), pooled over rounds."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def decode_tps(self) -> float:
        n = max(len(self.tokens) - 1, 0)  # the first token comes from prefill
        return n / self.decode_s if self.decode_s > 0 else 0.0

    tokens_per_sec = decode_tps

    @property
    def e2e_tps(self) -> float:
        total = self.prefill_s + self.decode_s
        return len(self.tokens) / total if total > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "accept_lengths": self.accept_lengths,
            "mean_accept_len": round(self.mean_accept_len, 4),
            "rounds": self.rounds,
            "finish_reason": self.finish_reason,
            "mode": self.mode,
            "model": self.model,
            "timings": {
                "prefill_s": round(self.prefill_s, 6),
                "decode_s": round(self.decode_s, 6),
                "decode_tps": round(self.decode_tps, 3),
                "e2e_tps": round(self.e2e_tps, 3),
            },
            "stats": self.stats,
            "stop_string": self.stop_string,
            "cached_tokens": self.cached_tokens,
            **({"logprobs": self.logprobs} if self.logprobs is not None else {}),
        }


def encode_prompt(
    tokenizer, prompt, *, chat_template: bool = True, enable_thinking: bool | None = None, system: str | None = None
) -> list[int]:
    """Token ids of `prompt` (a string or a list of chat messages), through the chat template
    when the tokenizer has one and `chat_template` is on."""
    if isinstance(prompt, str) and not prompt:
        raise UserError(f"the prompt is empty: pass some text with {option('prompt')}")
    if not prompt:
        raise UserError("the prompt is empty")
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if chat_template and has_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system:
            messages = [{"role": "system", "content": system}] + messages
        kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        return list(tokenizer.encode(text, add_special_tokens=False))
    if not isinstance(prompt, str):
        raise UserError("chat messages need a tokenizer with a chat template")
    return list(tokenizer.encode(prompt))


def stop_token_ids(target: Target, tokenizer) -> list[int]:
    ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        ids.add(int(eos))
    cfg = target.config.get("eos_token_id")
    if isinstance(cfg, int):
        ids.add(cfg)
    elif isinstance(cfg, list):
        ids.update(int(x) for x in cfg)
    return sorted(ids)


_registered: "weakref.WeakKeyDictionary[Target, dict]" = weakref.WeakKeyDictionary()


def drafter_for(target: Target, mode: str = "auto", drafter=None, *, bits: int | None = None, draft_vocab="auto"):
    """The drafter that `mode` runs with on `target`, resolved as the CLI resolves it.

    `drafter`: a loaded drafter (returned as is), a repo id or folder (loaded), or None: the
    registered drafter of the target, loaded once per target and settings. None is returned for
    baseline and lookup, and for auto when no drafter is registered (auto then runs lookup)."""
    if drafter is not None and not isinstance(drafter, (str, os.PathLike)):
        return drafter
    from .models.drafters import resolve_drafter

    if drafter is not None or mode not in ("auto", "dspark", "dflash"):
        return resolve_drafter(
            target, mode=mode, drafter=str(drafter) if drafter is not None else None, bits=bits, draft_vocab=draft_vocab
        )
    known = _registered.setdefault(target, {})
    key = (mode, bits, str(draft_vocab))
    if key not in known:
        defaults = bits is None and str(draft_vocab) == "auto"
        earlier = [d for (m, _, _), d in known.items() if m == mode] if defaults else []
        # Default settings take the drafter already resolved for this mode (the CLI resolved it
        # with its flags); anything else loads it as asked.
        known[key] = earlier[0] if earlier else resolve_drafter(target, mode=mode, bits=bits, draft_vocab=draft_vocab)
    return known[key]


def generate(target: Target, tokenizer, prompt, **kwargs) -> GenerationResult:
    """Generate from `prompt` (text or chat messages; or pass `prompt_ids`) with the given mode.

    `mode="auto"` runs the target's registered DSpark (else DFlash) drafter, else lookup, as the
    CLI does; `drafter` may be a loaded drafter, a repo id or a folder (`drafter_for`).
    Output tokens equal plain greedy decoding of `target` at temperature 0, and are an exact
    sample of it at temperature > 0, whatever the mode. Arguments: see `start`."""
    return start(target, tokenizer, prompt, **kwargs).run()


def stream_generate(target: Target, tokenizer, prompt, **kwargs) -> Iterator[str | GenerationResult]:
    """Yield text chunks as they are committed, then the GenerationResult as the last item.
    Runs in the caller's thread, one step per chunk; leaving the loop early ends the generation."""
    run = start(target, tokenizer, prompt, **kwargs)
    sent = 0
    try:
        for commit in run:
            if commit.text:
                sent += len(commit.text)
                yield commit.text
        tail = run.stream.finish()[sent:]
        if tail:
            yield tail
        yield run.result()
    finally:
        run.generation.cancel()


class TextGeneration:
    """A Generation with its text stream and the mode that runs it: what generate(),
    stream_generate() and the server step. Iterating steps it; `result()` reads the outcome."""

    def __init__(
        self,
        generation: loop.Generation,
        stream: TextStream,
        target: Target,
        mode: str,
        cancel: Callable[[], bool] | None = None,
        prefix_cache=None,
        cached_tokens: int = 0,
    ):
        self.generation, self.stream, self.target, self.mode = generation, stream, target, mode
        self.cancel_check = cancel
        self.prefix_cache, self.cached_tokens = prefix_cache, cached_tokens
        self.prefix_report: dict | None = None  # set by start(): the prefix cache's lookup report
        self._stored = False

    def __iter__(self):
        g = self.generation
        while not g.done:
            commit = g.step()
            if self.cancel_check is not None and not g.done and self.cancel_check():
                g.cancel()
            yield commit

    def run(self) -> GenerationResult:
        for _ in self:
            pass
        return self.result()

    def result(self) -> GenerationResult:
        g = self.generation
        if self.prefix_cache is not None and g.done and not self._stored and g.res.finish_reason != "cancelled":
            self._stored = True  # a cancelled generation leaves nothing in the cache
            self.prefix_cache.store(g.snapshot())
        out = _result(g, self.target, self.stream, self.mode)
        out.cached_tokens = self.cached_tokens
        out.prefix_cache = self.prefix_report
        return out


def start(
    target: Target,
    tokenizer,
    prompt,
    *,
    mode: str = "auto",
    drafter=None,
    proposer=None,
    max_new_tokens: int = 256,
    max_draft: int | None = None,
    sampling: SamplingParams | None = None,
    stop: Sequence[str] = (),
    chat_template: bool = True,
    enable_thinking: bool | None = None,
    on_text: Callable[[str], None] | None = None,
    cancel: Callable[[], bool] | None = None,
    lookup_long_draft: int = 32,
    prompt_ids: Sequence[int] | None = None,
    keep_leading_space: bool = False,
    drafter_bits: int | None = None,
    draft_vocab="auto",
    prefix_cache=None,
    on_prefill: Callable[[int, int], None] | None = None,
    **drafter_options,
) -> TextGeneration:
    """A TextGeneration, not stepped yet. `on_text` receives text as it is committed; `cancel()`
    is asked between steps (and between prefill chunks). `prefix_cache` (serve/prefix_cache.py)
    supplies the longest cached prefix of the prompt and keeps this generation's cache after.
    `on_prefill(done, total)` hears how many prompt tokens are in the cache after each chunk."""
    if max_new_tokens is None or int(max_new_tokens) < 1:
        raise UserError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    sampling = sampling or SamplingParams()
    sampling.validate()
    ids = (
        list(prompt_ids)
        if prompt_ids is not None
        else encode_prompt(tokenizer, prompt, chat_template=chat_template, enable_thinking=enable_thinking)
    )
    if not ids:
        raise UserError("the prompt encodes to no tokens")
    if proposer is None:
        drafter = drafter_for(target, mode, drafter, bits=drafter_bits, draft_vocab=draft_vocab)
        proposer = make_proposer(mode, drafter=drafter, lookup_long_draft=lookup_long_draft, **drafter_options)
    resolved_mode = proposer.name
    if max_draft == "auto":  # the measured cost model picks draft lengths (decode/policy.py)
        from .decode.modes import apply_auto

        proposer, max_draft = apply_auto(target, proposer, mode, lookup_long_draft)
        resolved_mode = proposer.name
    if max_draft is None or max_draft == 0:
        block = getattr(proposer, "block_drafts", None)  # drafters: the full block
        max_draft = block if block else DEFAULT_MAX_DRAFT.get(resolved_mode, 16)
        if resolved_mode == "lookup" or getattr(proposer, "lookup_drafts", False):
            # Free n-gram drafts may run long (inside drafter rounds too; drafter drafts stay
            # capped at the block by the proposer itself). An explicit --max-draft is a cap.
            max_draft = max(max_draft, lookup_long_draft)
    if max_draft < 0:
        raise UserError(f"{option('max-draft')} must be >= 0, got {max_draft}")
    stream = TextStream(tokenizer, stop, on_text, keep_leading_space=keep_leading_space)
    from .decode.warmup import warm_rounds

    warm_s = warm_rounds(target, proposer, ids, int(max_draft), sampling)  # once per process: decode/warmup.py
    report: dict = {}
    hit = prefix_cache.lookup(ids, tuple(proposer.taps), report=report) if prefix_cache is not None else None
    g = loop.Generation(
        target,
        ids,
        proposer,
        max_new_tokens=int(max_new_tokens),
        max_draft=int(max_draft),
        sampling=sampling,
        stop_token_ids=stop_token_ids(target, tokenizer),
        should_cancel=cancel,
        text=stream,
        cache=hit.cache if hit else None,
        reuse=(hit.reused, hit.hidden) if hit else None,
        keep_state=prefix_cache is not None,
        on_prefill=on_prefill,
        checkpoint_prompt=getattr(prefix_cache, "mode", None) == "checkpoint",
    )
    g.res.warm_up_s = warm_s
    tg = TextGeneration(g, stream, target, resolved_mode, cancel, prefix_cache, hit.reused if hit else 0)
    tg.prefix_report = report if prefix_cache is not None else None
    return tg


def _result(g: loop.Generation, target: Target, stream: TextStream, mode: str) -> GenerationResult:
    res = g.res
    text = stream.finish()
    stats = dict(res.proposer_stats)
    if res.warm_up_s:
        stats["warm_up_s"] = round(res.warm_up_s, 3)  # decode/warmup.py: before the prefill, in neither timing
    if res.speculation_off:
        stats.update(speculation_off=res.speculation_off, speculation_off_at_token=res.speculation_off_at)
        if not any(res.drafted):
            mode = "baseline"  # what actually ran
    tokens, logprobs, accept_lengths = res.tokens, res.logprobs, res.accept_lengths
    if stream.stop_token_index is not None:
        res.finish_reason = "stop"
        tokens = tokens[: stream.stop_token_index + 1]
        logprobs = logprobs[: len(tokens)] if logprobs is not None else None
        accept_lengths = _rounds_within(accept_lengths, len(tokens))
    return GenerationResult(
        text=text,
        tokens=tokens,
        prompt_tokens=res.prompt_tokens,
        accept_lengths=accept_lengths,
        finish_reason=res.finish_reason,
        prefill_s=res.prefill_s,
        decode_s=res.decode_s,
        mode=mode,
        model=target.name,
        logprobs=logprobs,
        stats=stats,
        stop_string=stream.stop_string,
    )


def _rounds_within(accept_lengths: list[int], n_tokens: int) -> list[int]:
    """The per-round commit counts of the first `n_tokens` tokens (a stop string cut the rest;
    the first token comes from prefill and belongs to no round)."""
    out, have = [], 1
    for n in accept_lengths:
        if have >= n_tokens:
            break
        out.append(min(n, n_tokens - have))
        have += out[-1]
    return out


__all__ = [
    "GenerationResult",
    "TextGeneration",
    "TextStream",
    "drafter_for",
    "generate",
    "start",
    "stream_generate",
    "load_target",
    "encode_prompt",
    "SamplingParams",
]
