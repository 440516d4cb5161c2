"""`mlx-dspark distill`: train a DSpark (or DFlash) drafter for a target."""

from __future__ import annotations

import argparse
import json

from .common import int_at_least, positive_int


def _taps(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers, got {text!r}") from None


_nonneg_int = int_at_least(0)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "distill",
        help="train a DSpark/DFlash drafter for a target (in MLX)",
        description="The target answers the prompts itself (its chat template, non-thinking); "
        "a drafter learns from its answers and hidden states (computed online).",
    )
    p.add_argument("--model", help="target: local folder, .gguf file or HF repo id (default: the demo model)")
    p.add_argument(
        "--out",
        required=True,
        help="output folder: the drafter checkpoint (DeepSpec layout), its training state and data",
    )
    p.add_argument("--kind", choices=["dspark", "dflash"], help="default: dspark (or --init-from's)")
    p.add_argument(
        "--layout",
        choices=["zlab", "deepspec"],
        help="--kind dflash's packaging: zlab (default: z-lab's DFlashDraftModel, block 16, slot 0 the "
        "anchor only, no embed/lm_head) or deepspec (DeepSpec's DFlash, block 7)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        help="target precision (default: float32 on CPU, bfloat16 on a GPU)",
    )
    d = p.add_argument_group("data")
    d.add_argument(
        "--prompts",
        nargs="+",
        action="extend",
        default=[],
        metavar="FILE.jsonl",
        help='prompt files, JSONL {"turns": [...]} (the first turn is used); repeatable',
    )
    d.add_argument("--no-builtin-prompts", action="store_true", help="do not add the small built-in prompt set")
    d.add_argument("--max-train-prompts", type=positive_int, help="use at most this many prompts per domain")
    d.add_argument("--answer-tokens", type=positive_int, default=512, help="longest answer generated (default 512)")
    d.add_argument("--max-prompt-tokens", type=positive_int, default=1024, help="skip longer prompts (default 1024)")
    d.add_argument("--gen-batch-size", type=positive_int, default=128, help="answers generated at once (default 128)")
    d.add_argument(
        "--answers-per-prompt",
        type=positive_int,
        default=1,
        help="answers per prompt, each from another seed (default 1): more data from few prompts",
    )
    d.add_argument("--gen-seconds", type=float, help="stop generating answers after this many seconds")
    d.add_argument(
        "--cut-loops",
        type=int,
        default=0,
        metavar="N",
        help="end an answer where one of its N-grams starts a third time (e.g. 8): a base model's raw-code "
        "answers often loop to their token limit, and a drafter trained on loops learns little else (default 0: off)",
    )
    d.add_argument(
        "--no-chat-template",
        action="store_true",
        help="prompts are raw text the target continues (a base model without a chat template), "
        "as `generate --no-chat-template` feeds them",
    )
    d.add_argument(
        "--raw-code",
        action="store_true",
        help="each prompt as raw code (its first fenced code block, else the request as comment lines), "
        "with no chat template: a code drafter for a base model",
    )
    d.add_argument(
        "--temperature", type=float, help="answer sampling (default: the target's generation_config, else 0.7)"
    )
    d.add_argument("--top-p", type=float, help="(default: generation_config, else 0.8)")
    d.add_argument("--top-k", type=int, help="(default: generation_config, else 20)")
    a = p.add_argument_group("drafter")
    a.add_argument(
        "--init-from",
        metavar="DRAFTER",
        help="start from this drafter of the same target (a folder "
        "or repo id in the DeepSpec layout, e.g. an earlier "
        "distill): its architecture, its weights trained further; "
        "with --kind dflash, a DSpark drafter lends its backbone (its heads are dropped)",
    )
    a.add_argument(
        "--layers",
        type=positive_int,
        help="drafter depth (default 2; with --init-from, the checkpoint's, or more: new layers start as identity)",
    )
    a.add_argument(
        "--block-size", type=positive_int, help="block slots (default 7; z-lab DFlash: 16, i.e. 15 drafts per round)"
    )
    a.add_argument(
        "--taps",
        type=_taps,
        help="target layers to tap, e.g. 1,8,14,20,27 (default: 5 spread over "
        "the target's depth, never its last layer)",
    )
    a.add_argument(
        "--markov-rank",
        type=_nonneg_int,
        help="DSpark Markov head rank (default: 256 for targets of hidden size >= 2048, else 64)",
    )
    a.add_argument("--intermediate-size", type=positive_int, help="drafter MLP width (default: the target's)")
    a.add_argument(
        "--mask-token-id", type=_nonneg_int, help="filler token of the block (default: an unused special token)"
    )
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=_nonneg_int, default=2000)
    t.add_argument(
        "--train-vocab",
        default="full",
        metavar="{full,auto,N}",
        help="train the draft head over the draft vocabulary only (the answer tokens covering 99.5%% "
        "of them, or the N most frequent), as --draft-vocab drafts: every vocabulary-wide "
        "tensor of the loss shrinks to it (default: full)",
    )
    t.add_argument("--train-seconds", type=float, help="fewer steps if they would not fit in this time")
    t.add_argument("--batch-size", type=positive_int, default=8, help="sequences per step (default 8)")
    t.add_argument("--anchors", type=positive_int, default=64, help="blocks per sequence per step (default 64)")
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--warmup-ratio", type=float, default=0.04)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--grad-clip", type=float, default=1.0)
    t.add_argument("--save-every", type=_nonneg_int, default=500, help="checkpoint every N steps (0: at the end only)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--resume", action="store_true", help="continue the interrupted run in --out")
    e = p.add_argument_group("evaluation and output")
    e.add_argument(
        "--eval-prompts",
        nargs="+",
        action="extend",
        default=[],
        metavar="FILE.jsonl",
        help="held-out prompt files (default: prompts held out of the training files)",
    )
    e.add_argument("--eval-samples", type=_nonneg_int, default=8, help="held-out prompts per domain (default 8)")
    e.add_argument("--eval-max-tokens", type=positive_int, default=128)
    e.add_argument("--no-eval", action="store_true")
    e.add_argument(
        "--export",
        metavar="DIR",
        help="also write a compact copy without the embed/lm_head copies (bound to the target's at load), for shipping",
    )
    e.add_argument(
        "--export-bits",
        type=int,
        choices=(4, 8, 16),
        default=16,
        help="--export's matrices stored quantized (MLX affine, group 64); default 16: bf16",
    )
    e.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def options_from_args(args):
    from ..errors import UserError
    from ..train.data import GenConfig
    from ..train.pipeline import DistillOptions
    from ..train.trainer import DistillConfig

    if args.lr <= 0:
        raise UserError(f"--lr must be positive, got {args.lr}")
    if not 0 <= args.warmup_ratio < 1:
        raise UserError(f"--warmup-ratio must be in [0, 1), got {args.warmup_ratio}")
    if args.block_size is not None and args.block_size < 2:
        raise UserError(f"--block-size must be at least 2, got {args.block_size}")
    if args.cut_loops and args.cut_loops < 2:
        raise UserError(
            f"--cut-loops takes an n-gram length of at least 2 (e.g. 8), or 0 for off; got {args.cut_loops}"
        )
    from ..models.draft_vocab import parse_choice

    train_vocab = parse_choice(args.train_vocab, "--train-vocab")
    gen = GenConfig(
        max_new_tokens=args.answer_tokens,
        batch_size=args.gen_batch_size,
        max_prompt_tokens=args.max_prompt_tokens,
        time_limit=args.gen_seconds,
        answers_per_prompt=args.answers_per_prompt,
        chat_template=not args.no_chat_template,
        cut_loops=args.cut_loops,
    )
    cfg = DistillConfig(
        kind=args.kind,
        layout=args.layout,
        layers=args.layers,
        block_size=args.block_size,
        taps=args.taps,
        markov_rank=args.markov_rank,
        intermediate_size=args.intermediate_size,
        mask_token_id=args.mask_token_id,
        steps=args.steps,
        train_seconds=args.train_seconds,
        batch_size=args.batch_size,
        anchors=args.anchors,
        lr=args.lr,
        warmup_ratio=args.warmup_ratio,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        save_every=args.save_every,
        seed=args.seed,
        gen=gen,
        init_from=args.init_from,
        train_vocab=train_vocab,
    )
    return DistillOptions(
        model=args.model,
        out=args.out,
        prompts=list(args.prompts),
        builtin_prompts=not args.no_builtin_prompts,
        eval_prompts=list(args.eval_prompts),
        eval_samples=args.eval_samples,
        eval_max_tokens=args.eval_max_tokens,
        evaluate=not args.no_eval,
        max_train_prompts=args.max_train_prompts,
        dtype=args.dtype,
        export=args.export,
        export_bits=args.export_bits,
        resume=args.resume,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        raw_code=args.raw_code,
        train=cfg,
    )


def run(args) -> int:
    from ..train.pipeline import run_distill

    summary = run_distill(options_from_args(args))
    if args.json:
        print(json.dumps(summary))
    else:
        ev = summary.get("eval", {}).get("_all")
        tail = f", held-out mean acceptance {ev['mean_accept']:.2f}" if ev else ""
        print(f"distill: {summary['steps']} steps in {summary['train_s']:.0f}s{tail}; drafter in {args.out}")
    return 0
