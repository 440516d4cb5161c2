"""A target that reads its whole context, for the prefix-cache tests.

The shared fixture target (drafter_fixtures.workspace()["target_qwen3"]: tied embeddings, small
layer weights) mostly repeats its last token whatever its cache holds, so a warm run from a
wrong cache would still equal the cold run. This one (untied head, larger weights) changes its
output when an early prompt token changes (tests check that premise), with a DSpark drafter."""

from __future__ import annotations

from drafter_fixtures import target, write_deepspec
from fixtures import scratch_dir, write_model

_PAIR: dict = {}


def context_pair():
    """(target, tokenizer, DSpark drafter), written and loaded once per test process."""
    if not _PAIR:
        from mlx_dspark.models.drafters import load_drafter

        root = scratch_dir("mlx-dspark-prefix-models-")
        tdir = write_model(root / "target", "qwen3", layers=3, hidden=64, seed=11, scale=3.0, tie=False)
        t, tok = target(tdir)
        _PAIR.update(t=t, tok=tok, d=load_drafter(str(write_deepspec(root / "dspark", tdir)), t, bits=16))
    return _PAIR["t"], _PAIR["tok"], _PAIR["d"]
