"""Training data for `distill`: prompts in, the target's own answers out (as in the DSpark paper, §4.1).

Prompts are JSONL records in the `{"turns": [...]}` format of shared/data/prompts (only the first
turn is used, as DeepSpec's evaluator does), plus a small built-in set. Each prompt is rendered
with the target's chat template (user turn only, generation prompt on, `enable_thinking=False`):
the same ids the verify loop sees at inference (`api.encode_prompt`).

The target answers every prompt itself, in static batches of similar-length prompts
(`answer_batch`: left-padded, prefilled at once, decoded together, finished rows dropped).
An answer keeps its end-of-turn token when the target stopped, so the drafter
also learns to predict the end. A `Sample` is the whole sequence (prompt + answer) and the number
of prompt tokens; the loss only ever looks at answer tokens.

Target hidden states are not stored: the trainer recomputes them online, each step.
"""

from __future__ import annotations

import hashlib
import json
import re
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


_CODE_BLOCK = re.compile(r"```[A-Za-z0-9_+-]*\n(.*?)```", re.S)


def raw_code(text: str) -> str:
    """A prompt as raw code for a base model to continue: the first fenced code block's text (a
    signature and docstring to complete), else the request as a comment line per line."""
    m = _CODE_BLOCK.search(text)
    if m and m.group(1).strip():
        return m.group(1).rstrip() + "\n"
    return "".join(f"# {line}".rstrip() + "\n" for line in text.strip().splitlines())


def as_raw_code(prompts: Sequence[Prompt]) -> list[Prompt]:
    return [Prompt(raw_code(p.text), p.domain) for p in prompts]


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
                raise UserError(f'{p}:{n}: expected {{"turns": ["a user message", ...]}}')
            if turns[0].strip():
                out.append(Prompt(turns[0], p.stem))
    if not out:
        raise UserError(f'prompt file {p} holds no prompts (expected JSONL lines like {{"turns": ["..."]}})')
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
        raise UserError(
            f"{name} has no chat template: the drafter must learn the target's answers in the exact "
            "format it is prompted with at inference. For a base model prompted with raw text (as "
            "`generate --no-chat-template` runs it), pass --no-chat-template; otherwise use an "
            "instruct/chat model, or add a chat_template to its tokenizer_config.json"
        )


def encode(tokenizer, text: str, chat_template: bool = True) -> list[int]:
    """The prompt's ids as inference encodes them: the chat template's user turn (non-thinking),
    or with `chat_template=False` the raw text (BOS first where the tokenizer adds one)."""
    from ..api import encode_prompt

    return encode_prompt(tokenizer, text, chat_template=chat_template, enable_thinking=False)


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
    answers_per_prompt: int = 1  # more answers per prompt (other seeds): more data from few prompts
    time_limit: float | None = None  # stop generating after this many seconds (answers so far are kept)
    chat_template: bool = True  # False: prompts are raw text the target continues (a base model)
    cut_loops: int = 0  # n > 0: end an answer where one of its n-grams starts a third time (LoopCut)

    def key(self) -> dict:
        k = asdict(self)
        k.pop("time_limit")
        if k["chat_template"]:
            k.pop("chat_template")  # the key of every run made before the switch existed
        if not k["cut_loops"]:
            k.pop("cut_loops")  # likewise
        return k


class LoopCut:
    """Ends an answer where it starts to loop: at the start of the third occurrence of one of its
    n-grams, the answer so far is kept (two occurrences: the repeat a drafter should learn to
    copy) and the rest is dropped. A base model continuing raw code at a low temperature often
    repeats one line to its token limit; a drafter trained on those tails learns the loops and
    little else (bench/results/gemma-dspark.md)."""

    def __init__(self, n: int):
        if n < 2:
            raise UserError(f"--cut-loops takes an n-gram length of at least 2 (or 0: off), got {n}")
        self.n = n
        self.seen: dict[int, dict[tuple, int]] = {}

    def cut(self, key: int, answer: list[int]) -> int | None:
        """After `answer` grew by one token: None, or the length to cut it to (the row ends)."""
        if len(answer) < self.n:
            return None
        counts = self.seen.setdefault(key, {})
        g = tuple(answer[-self.n :])
        counts[g] = counts.get(g, 0) + 1
        return len(answer) - self.n if counts[g] >= 3 else None


def sliding_window(model) -> int | None:
    """The smallest sliding window of the model's attention layers (its prompt cache's rotating
    caches), or None where every layer attends to the whole sequence."""
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

    sizes = [c.max_size for c in make_prompt_cache(model) if isinstance(c, RotatingKVCache)]
    return min(sizes) if sizes else None


def cut_to_window(samples: Sequence[Sample], window: int) -> tuple[list[Sample], int]:
    """The samples cut to their first `window` tokens, those left with under 2 answer tokens
    dropped; and how many were longer."""
    out, n_cut = [], 0
    for s in samples:
        if len(s.ids) > window:
            n_cut += 1
            s = Sample(s.ids[:window], s.n_prompt, s.domain)
        if s.n_answer >= 2:
            out.append(s)
    return out, n_cut


def _batch_cache(model, left_padding: list[int]) -> list:
    """Per-layer batched caches (left-padded rows) shaped like the model's own prompt cache."""
    from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache, make_prompt_cache

    out = []
    for c in make_prompt_cache(model):
        if isinstance(c, RotatingKVCache):
            out.append(BatchRotatingKVCache(c.max_size, left_padding))
        elif isinstance(c, KVCache):
            out.append(BatchKVCache(left_padding))
        else:
            raise UserError(
                f"distill cannot batch answers for a target with a {type(c).__name__} cache "
                "(attention KV and sliding-window caches only)"
            )
    return out


def answer_batch(
    model,
    prompts: Sequence[list[int]],
    max_new: int,
    sampler,
    stops: set[int],
    deadline: float | None = None,
    prefill_step: int = 512,
    cut_loops: int = 0,
) -> list[list[int]]:
    """The answers to one static batch of prompts (left-padded, prefilled together, decoded
    together). A row stops at its first stop token (kept), after `max_new` tokens, or (with
    `cut_loops`) where it starts to loop (LoopCut); finished rows are dropped from the batch as it
    thins out. Decoding is pipelined: step k+1 is queued before step k's tokens are read back."""
    import mlx.core as mx

    n = len(prompts)
    width = max(len(p) for p in prompts)
    pad = [width - len(p) for p in prompts]
    x = mx.array([[0] * k + list(p) for k, p in zip(pad, prompts)], dtype=mx.int32)
    cache = _batch_cache(model, pad)
    for i in range(0, width - 1, prefill_step):  # the prompt but its last token; logits never built
        model(x[:, i : min(i + prefill_step, width - 1)], cache=cache)
        mx.eval([c.state for c in cache])
    y = sampler(model(x[:, -1:], cache=cache)[:, -1, :])
    mx.async_eval(y)
    rows = list(range(n))  # batch row -> prompt index
    alive = [True] * n  # a finished row stays in the batch until the next filter, ignored
    answers: list[list[int]] = [[] for _ in range(n)]
    loops = LoopCut(cut_loops) if cut_loops else None
    for step in range(max_new):
        last = step == max_new - 1 or (deadline is not None and time.perf_counter() > deadline)
        if not last:
            y_next = sampler(model(y[:, None], cache=cache)[:, -1, :])
            mx.async_eval(y_next)
        for r, t in enumerate(y.tolist()):
            if alive[r]:
                ans = answers[rows[r]]
                ans.append(t)
                alive[r] = t not in stops
                if loops is not None and alive[r] and (cut_at := loops.cut(rows[r], ans)) is not None:
                    del ans[cut_at:]
                    alive[r] = False
        keep = [r for r in range(len(rows)) if alive[r]]
        if last or not keep:
            break
        if len(keep) <= 0.75 * len(rows) or len(rows) - len(keep) >= 64:
            ki = mx.array(keep)
            for c in cache:
                c.filter(ki)
            y_next = y_next[ki]
            rows = [rows[r] for r in keep]
            alive = [True] * len(rows)
        y = y_next
    return answers


def generate_samples(
    target, tokenizer, prompts: Sequence[Prompt], cfg: GenConfig, progress: Callable[[str], None] | None = None
) -> list[Sample]:
    """The target's answers to `prompts`, `cfg.answers_per_prompt` each, as training samples.

    Static batches of prompts of similar length (little padding), domains interleaved so that a
    time-limited run covers every domain; with several answers per prompt, every prompt gets
    its first answer before any gets a second (a different seed, same sampling settings)."""
    import random

    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from ..api import stop_token_ids

    if cfg.chat_template:
        require_chat_template(tokenizer)
    say = progress or (lambda s: print(s, file=sys.stderr, flush=True))
    encoded, dropped = [], 0
    for p in prompts:
        ids = encode(tokenizer, p.text, cfg.chat_template)
        if len(ids) > cfg.max_prompt_tokens:
            dropped += 1
            continue
        encoded.append((ids, p.domain))
    if dropped:
        say(f"distill: skipped {dropped} prompts longer than {cfg.max_prompt_tokens} tokens")
    if not encoded:
        raise UserError(f"every prompt is longer than --max-prompt-tokens {cfg.max_prompt_tokens}")
    sampler = make_sampler(temp=cfg.temperature, top_p=cfg.top_p if 0 < cfg.top_p < 1 else 0.0, top_k=cfg.top_k)
    stops = set(stop_token_ids(target, tokenizer))
    bs = max(1, cfg.batch_size)
    # Batches: a seeded shuffle cut into windows of 8 batches, each window sorted by length.
    order = list(range(len(encoded)))
    random.Random(cfg.seed).shuffle(order)
    win = bs * 8
    order = [i for k in range(0, len(order), win) for i in sorted(order[k : k + win], key=lambda i: len(encoded[i][0]))]
    batches = [order[k : k + bs] for k in range(0, len(order), bs)]
    t0 = time.perf_counter()
    deadline = t0 + cfg.time_limit if cfg.time_limit else None
    samples: list[Sample] = []
    n_tok, last, total = 0, 0.0, len(batches) * max(1, cfg.answers_per_prompt)
    done = 0
    for rep, b in ((r, b) for r in range(max(1, cfg.answers_per_prompt)) for b in batches):
        if deadline is not None and time.perf_counter() > deadline:
            say(f"distill: answer generation stopped at its time limit ({cfg.time_limit:.0f}s)")
            break
        if b is batches[0]:
            mx.random.seed(cfg.seed + rep)
        answers = answer_batch(
            target.model,
            [encoded[i][0] for i in b],
            cfg.max_new_tokens,
            sampler,
            stops,
            deadline,
            cut_loops=cfg.cut_loops,
        )
        for i, ans in zip(b, answers):
            n_tok += len(ans)
            if len(ans) >= 2:
                ids, dom = encoded[i]
                samples.append(Sample(list(ids) + ans, len(ids), dom))
        done += 1
        now = time.perf_counter()
        if now - last > 5.0 or done == total:
            last = now
            say(
                f"distill: answer batches {done}/{total}, {len(samples)} answers, {n_tok} tokens, "
                f"{n_tok / max(now - t0, 1e-9):.0f} tok/s, {now - t0:.0f}s"
            )
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
