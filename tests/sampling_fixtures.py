"""A target with a 16-token vocabulary, in the real HF layout, for the sampling tests.

config.json + model.safetensors + a WordLevel tokenizer.json ("t0" .. "t15", whitespace
separated), loaded through `models.loading.load_target` like any user model. The output head is
untied and scaled so next-token distributions are neither flat nor one-hot, and depend on the
context (so a wrong row or a wrong penalty context changes the joint distribution).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
from fixtures import add_layer_tensors

from mlx_dspark.decode.sampled import sample_from

VOCAB = 16
RESIDUAL_EPS = 1e-8  # residual mass below this: the bonus comes from p_a


def write_tokenizer16(path: Path) -> None:
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"},
    }
    (path / "tokenizer.json").write_text(json.dumps(tok))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "t15",
        "unk_token": "t0",
        "bos_token": None,
        "pad_token": None,
        "add_bos_token": False,
        "model_max_length": 512,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))


def write_model16(
    path: Path,
    family: str = "llama",
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 32,
    heads: int = 2,
    kv_heads: int = 1,
    intermediate: int = 64,
    logit_std: float = 1.6,
) -> Path:
    """A random `family` (llama | qwen3) model with vocab 16; returns its folder."""
    from safetensors.numpy import save_file

    path = Path(path)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    write_tokenizer16(path)
    hd = hidden // heads
    cfg = {
        "architectures": ["Qwen3ForCausalLM" if family == "qwen3" else "LlamaForCausalLM"],
        "model_type": family,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hd,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": VOCAB - 1,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    rng = np.random.default_rng(seed)

    def w(*shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    t = {
        "model.embed_tokens.weight": w(VOCAB, hidden, std=1.0),
        "model.norm.weight": np.ones(hidden, np.float32),
        "lm_head.weight": w(VOCAB, hidden, std=logit_std / np.sqrt(hidden)),
    }
    s = 1.0 / np.sqrt(hidden)
    std = {
        "q": 3 * s,
        "k": 3 * s,
        "v": 2 * s,
        "o": 2 * s,
        "gate": 2 * s,
        "up": 2 * s,
        "down": 2 / np.sqrt(intermediate),
    }
    for i in range(layers):
        add_layer_tensors(
            t, i, family, w, hidden=hidden, heads=heads, kv_heads=kv_heads, intermediate=intermediate, std=std
        )
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


# ---------------------------------------------------------------------------------------------
# An independent (numpy, float64) statement of plain sampling, used to compute the distributions
# the speculative runs must reproduce. It follows the definition in decode/sampled.py's
# docstring, written from scratch (loops, no shared code).
def np_process(logits, sp, generated=()) -> np.ndarray:
    """Processed next-token distribution of one row of raw logits [V] under SamplingParams `sp`."""
    x = np.asarray(logits, dtype=np.float64).copy()
    V = x.shape[0]
    counts = np.zeros(V)
    for t in generated:
        counts[int(t)] += 1
    x -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0)
    if sp.temperature <= 0:
        out = np.zeros(V)
        out[int(np.argmax(x))] = 1.0
        return out
    x /= sp.temperature
    keep = np.ones(V, bool)

    def dist():
        z = np.where(keep, x, -np.inf)
        e = np.exp(z - z.max())
        return e / e.sum()

    if 0 < sp.top_k < V:
        kth = sorted(x, reverse=True)[sp.top_k - 1]
        keep &= x >= kth
    if sp.top_p < 1.0:
        p = dist()
        mass, last = 0.0, None
        for i in sorted(range(V), key=lambda i: -p[i]):
            mass += p[i]
            last = p[i]
            if mass >= sp.top_p:
                break
        keep &= p >= last
    if sp.min_p > 0.0:
        p = dist()
        keep &= p >= sp.min_p * p.max()
    return dist()


def contexts(depth: int, vocab: int = VOCAB):
    """All token tuples of length 0..depth, in the order of `ctx_index`."""
    out = [()]
    for L in range(1, depth + 1):
        out += [tuple(int(d) for d in np.unravel_index(i, (vocab,) * L)) for i in range(vocab**L)]
    return out


def ctx_offsets(depth: int, vocab: int = VOCAB) -> list[int]:
    off = [0]
    for L in range(depth):
        off.append(off[-1] + vocab**L)
    return off


def exact_logits(target, prompt, depth: int = 3) -> np.ndarray:
    """Raw next-token logits after prompt + c for every context c of length 0..depth,
    [n_contexts, V] in `contexts(depth)` order, by full (cache-free) forwards."""
    import mlx.core as mx

    V = target.vocab_size
    seqs = np.array([list(prompt) + list(c) for c in contexts(depth) if len(c) == depth], dtype=np.int32)
    logits = np.array(target.model(mx.array(seqs)).astype(mx.float32))[:, len(prompt) - 1 :, :]  # [V^d, d+1, V]
    rows = []
    for L in range(depth + 1):
        step = V ** (depth - L)  # sequences sharing the first L tokens are contiguous
        rows.append(logits[::step, L, :])
    return np.concatenate(rows, axis=0)


def processed_table(raw: np.ndarray, sp, depth: int = 3) -> np.ndarray:
    """np_process of every context row (penalties count the context itself: it is generated)."""
    return np.stack([np_process(raw[i], sp, c) for i, c in enumerate(contexts(depth))])


# ---------------------------------------------------------------------------------------------
# Chi-square without scipy (CI installs only the package's test extras).
def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df): the regularized upper incomplete gamma Q(df/2, x/2)
    (series below a+1, Lentz's continued fraction above; Numerical Recipes 6.2)."""
    import math

    a, x = df / 2.0, x / 2.0
    if x <= 0:
        return 1.0
    log_pre = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = 1
        while abs(term) > abs(total) * 1e-15 and n < 100000:
            term *= x / (a + n)
            total += term
            n += 1
        return max(0.0, 1.0 - total * math.exp(log_pre))
    tiny = 1e-300
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 100000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return min(1.0, math.exp(log_pre) * h)


def gof_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit of `counts` to `probs` (same cells). Cells with expected count
    < 5 are pooled into one; an outcome of probability 0 gives p = 0."""
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    n = counts.sum()
    if counts[probs <= 0].sum() > 0:
        return 0.0  # an impossible outcome happened
    exp = probs / probs.sum() * n
    big = exp >= 5
    obs = np.concatenate([counts[big], [counts[~big].sum()]])
    e = np.concatenate([exp[big], [exp[~big].sum()]])
    if e[-1] <= 0:
        obs, e = obs[:-1], e[:-1]
    if len(e) < 2:
        return 1.0
    stat = float(((obs - e) ** 2 / e).sum())
    return chi2_sf(stat, len(e) - 1)


def float_cdf_accept(
    p: mx.array, q: mx.array | None, draft: mx.array, u: mx.array, u_bonus: mx.array
) -> tuple[mx.array, mx.array]:
    """Speculative-sampling accept, batched, the rule stated with a float CDF (a second statement
    of what kernels.sampling_accept does with an integer one). p [B, w, V], q [B, w-1, V] or None
    (one-hot drafts), draft [B, w-1] int32, u [B, w-1], u_bonus [B] -> (accepted [B], bonus [B])."""
    B, w, V = p.shape
    k = w - 1
    p = p.astype(mx.float32)
    draft = draft.astype(mx.int32).reshape(B, k)
    if k > 0:
        pd = mx.take_along_axis(p[:, :k], draft[..., None], axis=-1)[..., 0]
        qd = (
            mx.ones_like(pd)
            if q is None
            else mx.take_along_axis(q.astype(mx.float32), draft[..., None], axis=-1)[..., 0]
        )
        ok = (u.astype(mx.float32).reshape(B, k) * qd < pd).astype(mx.int32)
        accepted = mx.sum(mx.cumprod(ok, axis=1), axis=1).astype(mx.int32)
    else:
        accepted = mx.zeros((B,), dtype=mx.int32)
    return accepted, float_cdf_residual(p, q, draft, accepted, u_bonus)


def float_cdf_residual(
    p: mx.array, q: mx.array | None, draft: mx.array, accepted: mx.array, u_bonus: mx.array
) -> mx.array:
    """The token after `accepted` drafts: from normalize(max(p_a - q_a, 0)) (p_a when that mass
    is <= 1e-8), or from p_k when all k were accepted. Shapes as in float_cdf_accept."""
    B, w, V = p.shape
    p = p.astype(mx.float32)
    draft = draft.astype(mx.int32).reshape(B, w - 1)
    pa = mx.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]  # [B, V]
    if q is None:  # one-hot of the rejected draft; nothing after the last draft
        pad = mx.concatenate([draft, mx.full((B, 1), -1, dtype=mx.int32)], axis=1)
        da = mx.take_along_axis(pad, accepted[:, None], axis=1)  # [B, 1]
        qa = (mx.arange(V)[None] == da).astype(mx.float32)
    else:
        qpad = mx.concatenate([q.astype(mx.float32), mx.zeros((B, 1, V), mx.float32)], axis=1)
        qa = mx.take_along_axis(qpad, accepted[:, None, None], axis=1)[:, 0]
    resid = mx.maximum(pa - qa, 0.0)
    mass = mx.sum(resid, axis=-1, keepdims=True)
    dist = mx.where(mass > RESIDUAL_EPS, resid, pa)
    return sample_from(dist, u_bonus.astype(mx.float32).reshape(B))
