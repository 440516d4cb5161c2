"""Flags shared by generate, serve and benchmark, and the one place that turns them into objects."""

from __future__ import annotations

import argparse

from ..decode.modes import MODES
from ..decode.sampling import SamplingParams


def int_at_least(low: int):
    """An argparse type: an integer >= `low`, with a one-line message otherwise."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {v}")
        return v

    return parse


positive_int = int_at_least(1)


def max_draft_arg(text: str):
    """--max-draft: "auto" or an integer >= 0."""
    if text.strip().lower() == "auto":
        return "auto"
    return int_at_least(0)(text)


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", help="target: local folder, .gguf file or HF repo id (default: the demo model)")
    g.add_argument("--drafter", help="drafter checkpoint (HF repo id or folder); overrides the registry")
    g.add_argument(
        "--mode", default="auto", choices=MODES, help="auto picks DSpark, else DFlash, else lookup (default: auto)"
    )
    g.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        help="target precision (default: the checkpoint's; float32 for GGUF on CPU)",
    )
    g.add_argument("--quantize", type=int, choices=[4, 8], help="re-quantize the target to MLX affine 4/8-bit")
    g.add_argument("--kv-bits", type=int, choices=[2, 3, 4, 6, 8], help="quantize the KV cache")
    g.add_argument(
        "--drafter-bits",
        type=int,
        choices=[4, 8, 16],
        default=None,
        help="drafter precision: 4/8-bit quantized at load, or 16 = unquantized "
        "(default: 4 on a GPU; 16 on CPU, where MLX's quantized matmul does not batch)",
    )
    g.add_argument(
        "--draft-vocab",
        default="auto",
        metavar="{auto,full,N}",
        help="draft only from the N tokens the target emits most often (the drafter's "
        "draft_vocab.json, written by distill); auto: those covering 99.5%% of its answers "
        "(default); full: the whole vocabulary. Output is unchanged either way",
    )


def add_decode_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("decoding")
    g.add_argument(
        "--max-draft",
        type=max_draft_arg,
        default="auto",
        metavar="{auto,N}",
        help="draft tokens per round: auto (default) picks them each round from this machine's "
        "measured verify cost and the live acceptance, and runs plain steps where drafting "
        "would lose; N = at most N every round (0 = the drafter's full block)",
    )
    g.add_argument(
        "--confidence-threshold",
        type=float,
        default=0.0,
        help="DSpark: truncate the block at the first slot whose confidence is below this",
    )
    g.add_argument(
        "--no-lookup-drafts",
        action="store_true",
        help="DSpark/DFlash: never substitute free n-gram drafts for the drafter",
    )
    g.add_argument(
        "--lookup-long-draft",
        type=int,
        default=32,
        help="lookup: the longest draft a deep (>= 8 token) match earns (default 32)",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)


def sampling_from_args(args, *, logprobs: bool = False, top_logprobs: int = 0) -> SamplingParams:
    sp = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    sp.validate()
    return sp


def load_from_args(args, *, probe: bool = True):
    """(target, tokenizer, drafter or None) for the model flags."""
    from ..models.demo import model_or_demo
    from ..models.loading import load_target

    model = model_or_demo(args.model)
    target, tokenizer = load_target(
        model,
        dtype=args.dtype,
        quantize=args.quantize,
        kv_bits=args.kv_bits,
        probe=probe,
        context_window=getattr(args, "context_window", None),
        rope_scaling=getattr(args, "rope_scaling", "none"),
    )
    from ..api import drafter_for

    drafter = drafter_for(
        target, args.mode, args.drafter, bits=args.drafter_bits, draft_vocab=getattr(args, "draft_vocab", "auto")
    )
    return target, tokenizer, drafter


def drafter_options(args) -> dict:
    return {"confidence_threshold": args.confidence_threshold, "lookup_drafts": not args.no_lookup_drafts}
