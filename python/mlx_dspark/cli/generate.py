"""`mlx-dspark generate`: one prompt, streamed to stdout (or one JSON object with --json)."""

from __future__ import annotations

import json
import sys
import time

from .common import add_decode_args, add_model_args, drafter_options, load_from_args, positive_int, sampling_from_args


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt")
    add_model_args(p)
    add_decode_args(p)
    p.add_argument("--prompt", required=True, help="the user message (or raw text with --no-chat-template)")
    p.add_argument("--system", help="a system message (chat template only)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--no-thinking", action="store_true", help="ask the chat template for non-thinking mode")
    p.add_argument("--no-stream", action="store_true", help="print the text once, at the end")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, tokens, accept lengths, timings")
    p.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="logprobs of the committed tokens and the N most likely alternatives: in the JSON "
        "object with --json, else a table on stderr after the text",
    )


def run(args) -> int:
    from ..api import encode_prompt, generate
    from ..errors import UserError

    if not args.prompt.strip():
        raise UserError("the prompt is empty: pass some text with --prompt")
    if isinstance(args.max_draft, int) and args.max_draft < 0:
        raise UserError(f"--max-draft must be >= 0, got {args.max_draft}")
    want_lp = args.logprobs is not None
    sampling = sampling_from_args(args, logprobs=want_lp, top_logprobs=args.logprobs or 0)
    target, tokenizer, drafter = load_from_args(args)
    ids = encode_prompt(
        tokenizer,
        args.prompt,
        chat_template=not args.no_chat_template,
        enable_thinking=False if args.no_thinking else None,
        system=args.system,
    )
    stream = not (args.no_stream or args.json)

    def on_text(chunk: str) -> None:
        sys.stdout.write(chunk)
        sys.stdout.flush()

    progress = PrefillProgress(sys.stderr)
    res = generate(
        target,
        tokenizer,
        None,
        prompt_ids=ids,
        on_prefill=progress,
        mode=args.mode,
        drafter=drafter,
        max_new_tokens=args.max_new_tokens,
        max_draft=args.max_draft,
        sampling=sampling,
        stop=args.stop,
        on_text=on_text if stream else None,
        lookup_long_draft=args.lookup_long_draft,
        **drafter_options(args),
    )
    progress.close()
    if args.json:
        out = res.to_dict()
        out["model"] = target.source or target.name
        if drafter is not None:
            out["drafter"] = getattr(drafter, "source", None)
        print(json.dumps(out, ensure_ascii=False))
        return 0
    if stream:
        sys.stdout.write("\n")
    else:
        print(res.text)
    if res.logprobs is not None:
        print_logprobs(res.logprobs, tokenizer, file=sys.stderr)
    print(
        f"[{res.mode}] {len(res.tokens)} tokens, mean accept {res.mean_accept_len:.2f}, "
        f"prefill {res.prefill_s * 1000:.0f} ms, decode {res.decode_tps:.1f} tok/s, "
        f"end-to-end {res.e2e_tps:.1f} tok/s",
        file=sys.stderr,
    )
    return 0


class PrefillProgress:
    """`on_prefill(done, total)` for a terminal: once a prefill has run AFTER_S seconds, one line on
    stderr says how far it is (rewritten in place on a terminal, one line per chunk otherwise)."""

    AFTER_S = 3.0

    def __init__(self, file, clock=time.monotonic):
        self.file, self.clock = file, clock
        self.t0 = clock()  # made right before the generation starts
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        took = self.clock() - self.t0
        if took < self.AFTER_S:
            return
        rate = done / took
        last = done >= total - 1  # the prompt's last token goes in with the first step
        left = "" if last or rate <= 0 else f", about {(total - done) / rate:.0f} s left"
        line = f"prefill {done}/{total} tokens ({100 * done // max(total, 1)}%), {rate:.0f} tok/s, {took:.0f} s{left}"
        tty = getattr(self.file, "isatty", lambda: False)()
        self.file.write(("\r\x1b[K" + line) if tty else line + "\n")
        self.file.flush()
        self.shown = tty
        if last:
            self.close()

    def close(self) -> None:
        """End the line rewritten in place, so what follows starts on its own."""
        if self.shown:
            self.file.write("\n")
            self.file.flush()
            self.shown = False


def print_logprobs(entries: list[dict], tokenizer, file) -> None:
    """One line per committed token: its text, its logprob and the alternatives asked for."""

    def show(t: int) -> str:
        return json.dumps(tokenizer.decode([t]), ensure_ascii=False)

    print("logprobs (token, logprob, top alternatives):", file=file)
    for e in entries:
        alts = "  ".join(f"{show(t)} {lp:.3f}" for t, lp in e.get("top", []))
        print(f"{show(e['token'])}\t{e['logprob']:.3f}" + (f"\t{alts}" if alts else ""), file=file)
