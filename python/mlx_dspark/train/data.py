"""Training data for `distill`: prompts in, the target's own answers out (drafters-spec.md §5.1).

Prompts are JSONL records in the `{"turns": [...]}` format of shared/data/prompts (only the first
turn is used, as DeepSpec's evaluator does), plus a small built-in set. Each prompt is rendered
with the target's chat template (user turn only, generation prompt on, `enable_thinking=False`):
the same ids the verify loop sees at inference (`api.encode_prompt`).

The target answers every prompt itself, in batches (mlx-lm's continuous-batching
`BatchGenerator`). An answer keeps its end-of-turn token when the target stopped, so the drafter
also learns to predict the end. A `Sample` is the whole sequence (prompt + answer) and the number
of prompt tokens; the loss only ever looks at answer tokens.

Target hidden states are not stored: the trainer recomputes them online, each step.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from ..errors import UserError

# A small built-in set, so that `distill` works without a prompt file. Mixed domains, like the
# open-perfectblend mix DeepSpec trains on (chat, code, math, instructions).
BUILTIN_PROMPTS: dict[str, list[str]] = {
    "chat": [
        "Explain in a few sentences why the sky is blue.",
        "What are three tips for getting better sleep?",
        "Write a short, friendly email inviting a colleague to lunch on Friday.",
        "Summarize the plot of Romeo and Juliet in one paragraph.",
        "What is the difference between weather and climate?",
        "Give me a packing list for a weekend camping trip.",
        "Explain how a bicycle stays upright while moving.",
        "Describe the water cycle to a ten-year-old.",
        "What are the pros and cons of working from home?",
        "Write a haiku about autumn leaves.",
        "How do vaccines train the immune system?",
        "Suggest five names for a small coffee shop and explain each one.",
        "What should I consider when adopting a dog?",
        "Explain what inflation is and why central banks care about it.",
        "Write a short story opening about a lighthouse keeper who finds a message in a bottle.",
        "Compare trains and planes for a 500 km trip.",
    ],
    "code": [
        "Write a Python function that checks whether a string is a palindrome, with a short docstring.",
        "Write a Python function that returns the n-th Fibonacci number iteratively.",
        "Implement binary search in Python and explain its complexity.",
        "Write a Python class for a stack with push, pop, peek and is_empty methods.",
        "Write a function that merges two sorted lists into one sorted list.",
        "Write a Python script that counts the words in a text file and prints the ten most common.",
        "Explain the difference between a list and a tuple in Python, with examples.",
        "Write a JavaScript function that debounces another function.",
        "Write a SQL query that returns the five customers with the highest total order value.",
        "Write a Python function that removes duplicates from a list while keeping the order.",
        "Implement quicksort in Python.",
        "Write a Python function that validates an email address with a regular expression.",
        "Write a C function that reverses a string in place.",
        "Write a Python generator that yields prime numbers.",
        "Explain what a Python decorator is and write one that times a function call.",
        "Write a bash script that renames every .txt file in a folder to .md.",
    ],
    "math": [
        "A train travels 120 km in 1.5 hours. What is its average speed in km/h?",
        "Solve for x: 3x + 7 = 22. Explain each step.",
        "What is the sum of the integers from 1 to 100? Show how to compute it.",
        "A rectangle has a perimeter of 30 cm and a length of 9 cm. What is its area?",
        "If a shirt costs $40 after a 20% discount, what was the original price?",
        "Explain how to compute the area of a circle with radius 5.",
        "Tom has 3 times as many apples as Sara. Together they have 48. How many does each have?",
        "What is 15% of 240? Explain the method.",
        "Find the greatest common divisor of 84 and 126.",
        "A recipe needs 2.5 cups of flour for 10 cookies. How much flour for 36 cookies?",
        "What is the probability of rolling a sum of 7 with two fair dice?",
        "Convert 0.375 to a fraction in lowest terms.",
    ],
}


@dataclass
class Prompt:
    text: str
    domain: str


@dataclass
class Sample:
    ids: list[int]  # prompt + answer token ids
    n_prompt: int  # the first n_prompt ids are the (templated) prompt
    domain: str

    @property
    def n_answer(self) -> int:
        return len(self.ids) - self.n_prompt


# ---------------------------------------------------------------------------------- prompts
def builtin_prompts() -> list[Prompt]:
    return [Prompt(t, d) for d, texts in BUILTIN_PROMPTS.items() for t in texts]


def read_prompt_file(path: str | Path) -> list[Prompt]:
    """The first turn of every record of a `{"turns": [...]}` JSONL file; domain = file stem."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"prompt file {p} does not exist")
    out: list[Prompt] = []
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{p}:{n}: not valid JSON ({e.msg})") from None
            turns = rec.get("turns") if isinstance(rec, dict) else None
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
                raise UserError(f"{p}:{n}: expected {{\"turns\": [\"a user message\", ...]}}")
            if turns[0].strip():
                out.append(Prompt(turns[0], p.stem))
    if not out:
        raise UserError(f"prompt file {p} holds no prompts (expected JSONL lines like {{\"turns\": [\"...\"]}})")
    return out


def load_prompts(files: Sequence[str] = (), *, builtin: bool = True) -> list[Prompt]:
    prompts: list[Prompt] = []
    for f in files:
        prompts.extend(read_prompt_file(f))
    if builtin:
        prompts.extend(builtin_prompts())
    if not prompts:
        raise UserError("no training prompts: pass --prompts FILE.jsonl (or keep the built-in set)")
    return prompts


def by_domain(prompts: Sequence[Prompt]) -> dict[str, list[Prompt]]:
    out: dict[str, list[Prompt]] = {}
    for p in prompts:
        out.setdefault(p.domain, []).append(p)
    return out


def split_holdout(prompts: Sequence[Prompt], per_domain: int, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held-out): `per_domain` prompts of every domain are held out (never trained on)."""
    import random

    rng = random.Random(seed)
    train, held = [], []
    for dom, ps in by_domain(prompts).items():
        idx = list(range(len(ps)))
        rng.shuffle(idx)
        k = min(per_domain, max(len(ps) - 1, 0))
        held += [ps[i] for i in idx[:k]]
        train += [ps[i] for i in idx[k:]]
    return train, held


def subsample(prompts: Sequence[Prompt], per_domain: int, seed: int) -> list[Prompt]:
    """Up to `per_domain` prompts of each domain, a fixed shuffle (DeepSpec shuffles with a seed)."""
    import random

    out = []
    for dom, ps in by_domain(prompts).items():
        idx = list(range(len(ps)))
        random.Random(seed).shuffle(idx)
        out += [ps[i] for i in idx[:per_domain]]
    return out


# --------------------------------------------------------------------------------- templates
def require_chat_template(tokenizer, name: str = "the target") -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError(f"{name} has no chat template: distill needs one, because the drafter must learn the "
                        "target's answers in the exact format it is prompted with at inference "
                        "(use an instruct/chat model, or add a chat_template to its tokenizer_config.json)")


def encode(tokenizer, text: str) -> list[int]:
    from ..api import encode_prompt

    return encode_prompt(tokenizer, text, chat_template=True, enable_thinking=False)


# -------------------------------------------------------------------------------- generation
@dataclass
class GenConfig:
    max_new_tokens: int = 512
    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 0
    batch_size: int = 128
    max_prompt_tokens: int = 1024
    seed: int = 0
    time_limit: float | None = None  # stop generating after this many seconds (answers so far are kept)

    def key(self) -> dict:
        k = asdict(self)
        k.pop("time_limit")
        return k


def generate_samples(target, tokenizer, prompts: Sequence[Prompt], cfg: GenConfig,
                     progress: Callable[[str], None] | None = None) -> list[Sample]:
    """The target's answers to `prompts` (batched), as training samples."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    from ..api import stop_token_ids

    require_chat_template(tokenizer)
    say = progress or (lambda s: print(s, file=sys.stderr, flush=True))
    encoded, dropped = [], 0
    for p in prompts:
        ids = encode(tokenizer, p.text)
        if len(ids) > cfg.max_prompt_tokens:
            dropped += 1
            continue
        encoded.append((ids, p.domain))
    if dropped:
        say(f"distill: skipped {dropped} prompts longer than {cfg.max_prompt_tokens} tokens")
    if not encoded:
        raise UserError(f"every prompt is longer than --max-prompt-tokens {cfg.max_prompt_tokens}")
    mx.random.seed(cfg.seed)
    sampler = make_sampler(temp=cfg.temperature, top_p=cfg.top_p if 0 < cfg.top_p < 1 else 0.0, top_k=cfg.top_k)
    stops = stop_token_ids(target, tokenizer)
    gen = BatchGenerator(target.model, stop_tokens=[[t] for t in stops], sampler=sampler,
                         completion_batch_size=cfg.batch_size, prefill_batch_size=min(cfg.batch_size, 32),
                         max_tokens=cfg.max_new_tokens)
    # Domains interleaved (a seeded shuffle), so that a time-limited run still covers every
    # domain; within windows of a few batches, longest first, so that prefill batches pad little.
    import random

    order = list(range(len(encoded)))
    random.Random(cfg.seed).shuffle(order)
    win = max(cfg.batch_size, 1) * 2
    order = [i for k in range(0, len(order), win)
             for i in sorted(order[k : k + win], key=lambda i: -len(encoded[i][0]))]
    uids = gen.insert([encoded[i][0] for i in order], [cfg.max_new_tokens] * len(order))
    uid_to_idx = {u: order[k] for k, u in enumerate(uids)}
    answers: dict[int, list[int]] = {u: [] for u in uids}
    done, n_tok, t0, last = 0, 0, time.perf_counter(), 0.0
    try:
        while responses := gen.next_generated():
            if cfg.time_limit and time.perf_counter() - t0 > cfg.time_limit:
                say(f"distill: answer generation stopped at its time limit ({cfg.time_limit:.0f}s); "
                    f"unfinished answers are kept as they are")
                break
            for r in responses:
                answers[r.uid].append(int(r.token))
                n_tok += 1
                if r.finish_reason is not None:
                    done += 1
            now = time.perf_counter()
            if now - last > 5.0 or done == len(uids):
                last = now
                el = now - t0
                say(f"distill: answers {done}/{len(uids)}, {n_tok} tokens, {n_tok / max(el, 1e-9):.0f} tok/s, "
                    f"{el:.0f}s")
    finally:
        gen.close()
    samples = []
    for u, ans in answers.items():
        ids, dom = encoded[uid_to_idx[u]]
        if len(ans) >= 2:
            samples.append(Sample(list(ids) + ans, len(ids), dom))
    samples.sort(key=lambda s: (s.domain, s.ids))
    return samples


def data_key(model: str, prompts: Sequence[Prompt], cfg: GenConfig) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"model": model, "gen": cfg.key()}, sort_keys=True).encode())
    for p in prompts:
        h.update(p.domain.encode() + b"\0" + p.text.encode() + b"\0")
    return h.hexdigest()[:16]


def save_samples(path: Path, samples: Sequence[Sample], key: str) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps({"key": key, "n": len(samples)}) + "\n")
        for s in samples:
            f.write(json.dumps({"ids": s.ids, "n_prompt": s.n_prompt, "domain": s.domain}) + "\n")
    tmp.replace(path)


def load_samples(path: Path, key: str | None = None) -> list[Sample] | None:
    """The cached samples at `path`, or None when absent or made from other prompts/settings."""
    if not path.is_file():
        return None
    with open(path) as f:
        head = json.loads(f.readline() or "{}")
        if key is not None and head.get("key") != key:
            return None
        out = [Sample(r["ids"], r["n_prompt"], r["domain"]) for r in map(json.loads, f)]
    return out if len(out) == head.get("n") else None


def describe(samples: Sequence[Sample]) -> str:
    doms: dict[str, list[int]] = {}
    for s in samples:
        doms.setdefault(s.domain, []).append(s.n_answer)
    parts = [f"{d} {len(v)} ({sum(v)} tok)" for d, v in sorted(doms.items())]
    return f"{len(samples)} samples, {sum(s.n_answer for s in samples)} answer tokens: " + ", ".join(parts)
