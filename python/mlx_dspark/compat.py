"""The one place where behaviour of other packages is adjusted. Each item names the versions it is for."""

from __future__ import annotations

import copy


def fresh_detokenizer(tokenizer, keep_leading_space: bool = False):
    """A private streaming detokenizer for one generation.

    mlx-lm (0.32.x) keeps one detokenizer instance per TokenizerWrapper, shared by every caller,
    so concurrent or interleaved generations would mix their text: a shallow copy shares only
    the read-only token map. mlx-lm's detokenizers also drop the output's leading space, right
    for a chat answer but wrong for a raw completion (" world" after "Hello"); the BPE one has no
    switch for it (0.32.x), so `keep_leading_space` turns the trim off on this copy only.
    """
    d = copy.copy(tokenizer.detokenizer)
    d.reset()
    if keep_leading_space:
        if hasattr(d, "trim_space"):
            d.trim_space = False
        if hasattr(d, "_maybe_trim_space"):
            d._maybe_trim_space = lambda text: text
    return d
