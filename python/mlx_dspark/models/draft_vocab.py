"""A frequency-ranked draft vocabulary (as in FR-Spec): the drafter proposes only the N tokens a
target emits most often, so its lm_head (and DSpark's Markov W2) run over N rows instead of V.

Lossless either way: the target verifies every drafted token, and a draft distribution q that is
0 outside the subset is still an exact proposal (speculative sampling puts the mass q misses back
through the residual max(p - q, 0)). What it costs is the rounds where the target's next token
falls outside the subset; what it saves is the V-row matmul per slot, which on a CPU is a large
part of a drafter pass (the lm_head of a 49k-vocab target reads 113 MB of float32 per block).

The ranking is a file beside the drafter's config.json, written by `mlx-dspark distill` from the
target's own answers (never from evaluation prompts):

  draft_vocab.json  {"ids": [token ids, most frequent first], "counts": [...], "tokens": total}

`--draft-vocab auto` (the default) keeps the smallest prefix of the ranking that covers
AUTO_COVERAGE of the counted tokens; an integer keeps that many; `full` (or 0) turns it off.
Checkpoints without the file draft from the full vocabulary.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable

import mlx.core as mx

from ..errors import UserError, option
from ..kernels import native_products

FILE = "draft_vocab.json"
AUTO_COVERAGE = 0.995


def parse_choice(value, flag: str | None = None) -> int | str:
    """--draft-vocab (or distill's --train-vocab): 'auto', 'full' (= 0) or a positive count."""
    flag = flag or option("draft-vocab")
    if value is None:
        return "auto"
    if isinstance(value, int):
        return value
    v = str(value).strip().lower()
    if v in ("auto", "full"):
        return v
    try:
        n = int(v)
    except ValueError:
        raise UserError(f"{flag} must be auto, full or a token count, got {value!r}") from None
    if n < 0:
        raise UserError(f"{flag} must be auto, full or a positive token count, got {n}")
    return n


def ranking(token_lists: Iterable[Iterable[int]]) -> tuple[list[int], list[int]]:
    """(token ids, their counts), most frequent first."""
    counts: Counter = Counter()
    for toks in token_lists:
        counts.update(int(t) for t in toks)
    ranked = counts.most_common()
    return [t for t, _ in ranked], [c for _, c in ranked]


def write_ranking(folder: Path, token_lists: Iterable[Iterable[int]]) -> Path:
    """Count the tokens and write the ranking into `folder`."""
    ids, counts = ranking(token_lists)
    path = Path(folder) / FILE
    path.write_text(json.dumps({"ids": ids, "counts": counts, "tokens": sum(counts)}))
    return path


def read_ranking(folder: Path) -> tuple[list[int], list[int]] | None:
    path = Path(folder) / FILE
    if not path.is_file():
        return None
    try:
        rec = json.loads(path.read_text())
        ids, counts = [int(t) for t in rec["ids"]], [int(c) for c in rec["counts"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path} is not a draft vocabulary ranking ({e}); delete it, or rerun distill") from None
    if len(ids) != len(counts) or len(set(ids)) != len(ids):
        raise UserError(f"{path}: ids and counts differ in length or repeat a token; delete it, or rerun distill")
    return ids, counts


def select(folder: Path, choice, vocab_size: int) -> list[int] | None:
    """The sorted token ids to draft from, or None for the full vocabulary."""
    choice = parse_choice(choice)
    if choice in ("full", 0):
        return None
    ranked = read_ranking(folder)
    if ranked is None:
        if choice == "auto":
            return None
        raise UserError(
            f"{option('draft-vocab', choice)} needs a token ranking ({FILE}) beside the drafter's config.json; "
            f"{folder} has none (`mlx-dspark distill` writes one). Use {option('draft-vocab', 'full')}"
        )
    ids, counts = ranked
    if any(not 0 <= t < vocab_size for t in ids):
        raise UserError(f"{Path(folder) / FILE} holds token ids outside the target's vocabulary ({vocab_size})")
    return prefix(ids, counts, choice, vocab_size)


def prefix(ids: list[int], counts: list[int], choice, vocab_size: int) -> list[int] | None:
    """The sorted ids of the ranking's prefix that `choice` keeps (auto: AUTO_COVERAGE of the
    counted tokens; N: the N most frequent), or None when that is the whole vocabulary."""
    choice = parse_choice(choice)
    if choice in ("full", 0):
        return None
    if choice == "auto":
        total, acc, n = sum(counts), 0, 0
        for n, c in enumerate(counts, 1):
            acc += c
            if acc >= AUTO_COVERAGE * total:
                break
    else:
        n = min(int(choice), len(ids))
    if n >= vocab_size:
        return None
    return sorted(ids[:n])


def row_subset(proj, ids: mx.array) -> Callable[[mx.array], mx.array]:
    """x -> proj(x)[..., ids] without computing the other rows. `proj` is a Linear, a
    QuantizedLinear, or an (Quantized)Embedding's as_linear (tied heads): its weight rows (and
    their quantization groups, which run along the input dimension) are gathered once."""
    mod = getattr(proj, "__self__", proj)  # Embedding.as_linear -> the embedding
    w = mod.weight[ids]
    scales = getattr(mod, "scales", None)
    if scales is not None:
        s = scales[ids]
        b = mod.biases[ids] if getattr(mod, "biases", None) is not None else None
        mode = getattr(mod, "mode", "affine")
        gs, bits = mod.group_size, mod.bits
        mx.eval(w, s, *([b] if b is not None else []))

        def fq(x):
            return mx.quantized_matmul(x, w, s, b, transpose=True, group_size=gs, bits=bits, mode=mode)

        return fq
    bias = mod.bias[ids] if "bias" in mod else None
    mx.eval(w, *([bias] if bias is not None else []))

    def f(x):
        y = native_products.dense(x, w, bias)  # a drafter pass on the CPU
        if y is not None:
            return y
        # w.T here, not once at load: a lazy array (a transpose view too) built in the loading
        # thread cannot be evaluated in another (MLX keeps a stream per thread; serve decodes in
        # its engine thread)
        return x @ w.T if bias is None else mx.addmm(bias, x, w.T)

    f.dense_weight = w  # the gathered rows, for a kernel that takes the weight itself
    return f


def greedy_choice(z: mx.array, drafted: list):
    """The chooser of a greedy draft (a plain argmax, so BlockDrafter.choose_in_vocab takes it
    within the draft vocabulary): the argmax of each logits row ([..., V] -> [...] int32)."""
    return mx.argmax(z, axis=-1).astype(mx.int32), None


greedy_choice.argmax = True


def expand(z: mx.array, ids: mx.array, vocab_size: int) -> mx.array:
    """Logits over the subset [..., N] -> over the vocabulary [..., V], -inf outside it."""
    full = mx.full((*z.shape[:-1], vocab_size), -mx.inf, dtype=z.dtype)
    full[..., ids] = z
    return full


__all__ = [
    "AUTO_COVERAGE",
    "FILE",
    "expand",
    "greedy_choice",
    "parse_choice",
    "prefix",
    "ranking",
    "read_ranking",
    "row_subset",
    "select",
    "write_ranking",
]
