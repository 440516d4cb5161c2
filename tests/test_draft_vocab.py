"""The frequency-ranked draft vocabulary (models/draft_vocab.py): the restricted projections equal
the full ones' columns, drafts stay inside the subset, output stays exact, bad input is refused."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from drafter_fixtures import perm_chain, target, workspace

from mlx_dspark.api import generate
from mlx_dspark.decode.drafting import DrafterProposer
from mlx_dspark.errors import UserError
from mlx_dspark.models import draft_vocab as dv
from mlx_dspark.models.drafters import load_drafter


def _ids(rng, V, n):
    return mx.array(np.sort(rng.choice(V, size=n, replace=False)).astype(np.int32))


@pytest.mark.parametrize("kind", ["linear", "linear-bias", "quantized", "embedding", "quantized-embedding"])
def test_row_subset_equals_the_full_projections_columns(kind):
    rng = np.random.default_rng(abs(hash(kind)) % 2**32)
    V, H = 300, 64
    if kind.startswith("linear"):
        proj = nn.Linear(H, V, bias=kind == "linear-bias")
        if kind == "linear-bias":
            proj.bias = mx.array(rng.standard_normal(V).astype(np.float32))
    elif kind == "quantized":
        proj = nn.QuantizedLinear.from_linear(nn.Linear(H, V, bias=False), group_size=32, bits=4)
    else:
        emb = nn.Embedding(V, H)
        emb.weight = mx.array(rng.standard_normal((V, H)).astype(np.float32))
        if kind == "quantized-embedding":
            emb = nn.QuantizedEmbedding.from_embedding(emb, group_size=32, bits=8)
        proj = emb.as_linear
    x = mx.array(rng.standard_normal((5, H)).astype(np.float32))
    ids = _ids(rng, V, 37)
    full = proj(x)
    sub = dv.row_subset(proj, ids)(x)
    assert sub.shape == (5, 37)
    assert np.allclose(np.array(sub), np.array(full[:, ids]), atol=1e-4, rtol=1e-4)
    z = dv.expand(sub[0], ids, V)
    zn = np.array(z)
    assert zn.shape == (V,) and np.isneginf(np.delete(zn, np.array(ids))).all()
    assert np.allclose(zn[np.array(ids)], np.array(sub[0]))


def _folder_with_ranking(tmp_path, key, ranked_ids):
    src = workspace()[key]
    dst = tmp_path / key
    shutil.copytree(src, dst)
    counts = [1] * len(ranked_ids)  # equal counts: `auto` (99.5% coverage) keeps up to 199 of them
    (dst / dv.FILE).write_text(
        json.dumps({"ids": [int(t) for t in ranked_ids], "counts": counts, "tokens": sum(counts)})
    )
    return dst


def _recording(monkeypatch):
    drafted = []
    orig = DrafterProposer.propose

    def propose(self, history, max_draft, sampling):
        d = orig(self, history, max_draft, sampling)
        drafted.extend(d.tokens)
        return d

    monkeypatch.setattr(DrafterProposer, "propose", propose)
    return drafted


@pytest.mark.parametrize("key", ["perm_dspark", "perm_dflash_zlab"])
def test_drafts_stay_inside_the_subset_and_output_is_exact(key, tmp_path, monkeypatch):
    """The crafted perm pairs (DSpark: every draft right; z-lab DFlash, the target's own head
    restricted: the first draft right): with the chain's tokens in the subset, rounds accept
    exactly what the unrestricted drafter's do; with some of them left out, rounds break there,
    every drafted token is still a subset token, and the output is the same."""
    ws = workspace()
    tgt, tok = target(ws["target_perm"])
    f = ws["perm"]
    normal = [int(t) for t in np.flatnonzero(f >= 0)]
    prompt = normal[:3]
    n = 120
    chain = perm_chain(prompt[-1], n)
    want = generate(tgt, tok, None, prompt_ids=prompt, mode="baseline", max_new_tokens=n).tokens
    assert want == chain
    kind = "dspark" if "dspark" in key else "dflash"

    def run(d):
        return generate(tgt, tok, None, prompt_ids=prompt, mode=kind, drafter=d, max_new_tokens=n, lookup_drafts=False)

    full = run(load_drafter(str(ws[key]), tgt, bits=16, draft_vocab="full"))
    assert full.tokens == want and np.mean(full.accept_lengths) > 1.9

    covered = _folder_with_ranking(tmp_path, key, chain + [t for t in normal if t not in chain][:5])
    d = load_drafter(str(covered), tgt, bits=16, draft_vocab="auto")
    assert d.describe()["draft_vocab"] < tgt.vocab_size
    res = run(d)
    assert res.tokens == want and res.accept_lengths == full.accept_lengths

    cut = set(chain[5::6])  # every sixth chain token is missing from the draft vocabulary
    sub = [t for t in dict.fromkeys(chain) if t not in cut]
    d = load_drafter(str(_folder_with_ranking(tmp_path / "b", key, sub)), tgt, bits=16, draft_vocab=len(sub))
    drafted = _recording(monkeypatch)
    res = run(d)
    assert res.tokens == want
    assert drafted and set(drafted) <= set(sub)
    assert min(res.accept_lengths[:-1]) < min(full.accept_lengths[:-1])  # rounds break at the cut tokens


def test_choices_and_bad_input(tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    assert dv.select(folder, "auto", 100) is None  # no ranking: the full vocabulary
    with pytest.raises(UserError, match="needs a token ranking"):
        dv.select(folder, 20, 100)
    dv.write_ranking(folder, [[5] * 60 + [7] * 30 + [9] * 9 + [11]])
    assert dv.select(folder, "auto", 100) == [5, 7, 9, 11]  # 99 of 100 counted tokens < 99.5%
    assert dv.select(folder, "2", 100) == [5, 7]
    assert dv.select(folder, "full", 100) is None and dv.select(folder, 0, 100) is None
    with pytest.raises(UserError, match="outside the target's vocabulary"):
        dv.select(folder, "auto", 10)
    for bad in ("most", "-3", "1.5"):
        with pytest.raises(UserError, match="draft_vocab="):  # Python names no CLI flag
            dv.parse_choice(bad)
    (folder / dv.FILE).write_text('{"ids": [1, 1], "counts": [2, 1]}')
    with pytest.raises(UserError, match="repeat"):
        dv.select(folder, "auto", 100)
    (folder / dv.FILE).write_text("not json")
    with pytest.raises(UserError, match="not a draft vocabulary"):
        dv.select(folder, "auto", 100)


def test_cli_flag(tmp_path, capsys):
    from mlx_dspark.cli.main import main

    ws = workspace()
    d = _folder_with_ranking(tmp_path, "perm_dspark", [int(t) for t in np.flatnonzero(ws["perm"] >= 0)][:40])
    args = [
        "generate",
        "--model",
        str(ws["target_perm"]),
        "--drafter",
        str(d),
        "--mode",
        "dspark",
        "--prompt",
        "a b c",
        "--no-chat-template",
        "--max-new-tokens",
        "8",
    ]
    assert main(args + ["--draft-vocab", "lots"]) == 2
    err = capsys.readouterr().err
    assert "--draft-vocab must be auto, full or a token count" in err and "Traceback" not in err
    # auto with a registry-less target must refuse a bad value too, not fall back to lookup
    auto = ["generate", "--model", str(ws["target_perm"]), "--prompt", "a b c", "--max-new-tokens", "8"]
    assert main(auto + ["--draft-vocab", "foo"]) == 2
    err = capsys.readouterr().err
    assert "--draft-vocab must be auto, full or a token count, got 'foo'" in err and "Traceback" not in err
    assert main(args + ["--draft-vocab", "40"]) == 0
    assert main(args + ["--draft-vocab", "full"]) == 0
