"""Tiny drafters (and a tiny Gemma 4 target) written to disk in the real checkpoint layouts.

write_gemma4_target   mlx-lm gemma4_text model in the HF layout (tokenizer from fixtures.py)
write_deepspec        DeepSpec DSpark / DFlash: config = the target's config + DeepSpec keys,
                      top-level tensor names, embed/lm_head copies of the target's
write_zlab            z-lab DFlash: dflash_config block, no embed/lm_head, optional remote code
write_perm_target / write_perm_dspark / write_perm_dflash
                      crafted pairs whose drafter provably agrees with its target (acceptance)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from fixtures import _trained_tokenizer_json, scratch_dir, write_model, write_tokenizer
from safetensors.numpy import load_file, save_file


def _rng_w(rng, std):
    def w(*shape, s=None):
        return (rng.standard_normal(shape) * (std if s is None else s) / np.sqrt(shape[-1] / 16)).astype(np.float32)

    return w


def _eos(vocab_size: int = 384) -> int:
    return json.loads(_trained_tokenizer_json(vocab_size))["model"]["vocab"]["<|im_end|>"]


def _fresh(path) -> Path:
    path = Path(path)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


# ------------------------------------------------------------------------ gemma4 target
def write_gemma4_target(
    path,
    *,
    layers: int = 4,
    hidden: int = 64,
    heads: int = 2,
    head_dim: int = 32,
    intermediate: int = 128,
    seed: int = 0,
    softcap: float = 30.0,
) -> Path:
    path = _fresh(path)
    vocab = write_tokenizer(path)
    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    cfg = {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "head_dim": head_dim,
        "global_head_dim": head_dim,
        "num_key_value_heads": 1,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": False,
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0,
        "vocab_size": vocab,
        "vocab_size_per_layer_input": vocab,
        "sliding_window": 512,
        "layer_types": types,
        "use_double_wide_mlp": False,
        "enable_moe_block": False,
        "final_logit_softcapping": softcap,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "eos_token_id": _eos(),
        "torch_dtype": "float32",
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
    }
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    rng = np.random.default_rng(seed)
    w = _rng_w(rng, 0.2)
    t = {"model.embed_tokens.weight": w(vocab, hidden, s=0.1), "model.norm.weight": np.ones(hidden, np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = w(heads * head_dim, hidden)
        t[p + "self_attn.k_proj.weight"] = w(head_dim, hidden)
        t[p + "self_attn.v_proj.weight"] = w(head_dim, hidden)
        t[p + "self_attn.o_proj.weight"] = w(hidden, heads * head_dim)
        t[p + "self_attn.q_norm.weight"] = np.ones(head_dim, np.float32)
        t[p + "self_attn.k_norm.weight"] = np.ones(head_dim, np.float32)
        t[p + "mlp.gate_proj.weight"] = w(intermediate, hidden)
        t[p + "mlp.up_proj.weight"] = w(intermediate, hidden)
        t[p + "mlp.down_proj.weight"] = w(hidden, intermediate)
        for n in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            t[p + n + ".weight"] = (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
        t[p + "layer_scalar"] = np.array([1.0], np.float32)
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


# ------------------------------------------------------------------------------ drafters
def _target(target_dir: Path) -> tuple[dict, dict]:
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    return cfg, load_file(str(Path(target_dir) / "model.safetensors"))


def _layer_tensors(
    t: dict,
    rng,
    *,
    i: int,
    hidden: int,
    heads: int,
    kv: int,
    hd: int,
    inter: int,
    gemma: bool,
    k_eq_v: bool,
    std: float,
) -> None:
    w = _rng_w(rng, std)
    p = f"layers.{i}."
    t[p + "self_attn.q_proj.weight"] = w(heads * hd, hidden)
    t[p + "self_attn.k_proj.weight"] = w(kv * hd, hidden)
    if not k_eq_v:
        t[p + "self_attn.v_proj.weight"] = w(kv * hd, hidden)
    t[p + "self_attn.o_proj.weight"] = w(hidden, heads * hd)
    t[p + "self_attn.q_norm.weight"] = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32)
    t[p + "self_attn.k_norm.weight"] = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32)
    t[p + "mlp.gate_proj.weight"] = w(inter, hidden)
    t[p + "mlp.up_proj.weight"] = w(inter, hidden)
    t[p + "mlp.down_proj.weight"] = w(hidden, inter)
    norms = ["input_layernorm", "post_attention_layernorm"]
    if gemma:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        t[p + "layer_scalar"] = np.array([0.5 + rng.random()], np.float32)
    for n in norms:
        t[p + n + ".weight"] = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)


def write_deepspec(
    path,
    target_dir,
    *,
    style: str = "qwen3",
    markov_rank: int = 32,
    confidence: bool = True,
    with_markov: bool = True,
    layers: int = 2,
    block: int = 7,
    taps=None,
    seed: int = 1,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    intermediate: int = 96,
    mask_token_id: int | None = None,
    std: float = 0.3,
    softcap: float | None = None,
    partial: float = 0.25,
    config_overrides: dict | None = None,
    drop: tuple[str, ...] = (),
    tensors: dict | None = None,
) -> Path:
    """A DeepSpec DSpark (markov_rank > 0) or DFlash (markov_rank 0, confidence False) checkpoint."""
    path = _fresh(path)
    tcfg, tw = _target(target_dir)
    gemma = style == "gemma4"
    H, L_t, V = tcfg["hidden_size"], tcfg["num_hidden_layers"], tcfg["vocab_size"]
    taps = list(taps) if taps is not None else sorted({1, max(1, L_t // 2), L_t - 2})
    heads = heads or (2 if gemma else 4)
    kv = kv_heads or (1 if gemma else 2)
    hd = head_dim or (32 if gemma else 16)
    mask = mask_token_id if mask_token_id is not None else V - 1
    rng = np.random.default_rng(seed)
    cfg = dict(tcfg)
    cfg.update(
        {
            "architectures": ["Gemma4DSparkModel" if gemma else "Qwen3DSparkModel"],
            "num_target_layers": L_t,
            "num_hidden_layers": layers,
            "layer_types": ["full_attention"] * layers,
            "block_size": block,
            "mask_token_id": mask,
            "target_layer_ids": taps,
            "num_anchors": 512,
            "tie_word_embeddings": False,
            "enable_confidence_head": bool(confidence),
            "intermediate_size": intermediate,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "head_dim": hd,
        }
    )
    if confidence:
        cfg["confidence_head_with_markov"] = bool(with_markov)
    cfg["markov_rank"] = markov_rank
    if markov_rank > 0:
        cfg["markov_head_type"] = "vanilla"
    if gemma:
        cfg.update(
            {
                "model_type": "gemma4_text",
                "target_model_type": "gemma4",
                "target_text_model_type": "gemma4_text",
                "global_head_dim": hd,
                "num_global_key_value_heads": kv,
                "attention_k_eq_v": True,
                "final_logit_softcapping": softcap if softcap is not None else 30.0,
                "rope_parameters": {
                    "full_attention": {
                        "partial_rotary_factor": partial,
                        "rope_type": "proportional",
                        "rope_theta": 1e6,
                    },
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000},
                    "rope_theta": None,
                    "rope_type": "default",
                },
            }
        )
    else:
        cfg["model_type"] = "qwen3"
        cfg["rope_parameters"] = {"rope_theta": 1e6, "rope_type": "default"}
        cfg.pop("rope_theta", None)
    cfg.update(config_overrides or {})
    (path / "config.json").write_text(json.dumps(cfg, indent=1))

    w = _rng_w(rng, std)
    emb = tw.get("model.embed_tokens.weight")
    head = tw.get("lm_head.weight", emb)
    t = {
        "embed_tokens.weight": emb.copy(),
        "lm_head.weight": head.copy(),
        "fc.weight": w(H, len(taps) * H),
        "hidden_norm.weight": (1 + 0.1 * rng.standard_normal(H)).astype(np.float32),
        "norm.weight": (1 + 0.1 * rng.standard_normal(H)).astype(np.float32),
    }
    for i in range(layers):
        _layer_tensors(
            t, rng, i=i, hidden=H, heads=heads, kv=kv, hd=hd, inter=intermediate, gemma=gemma, k_eq_v=gemma, std=std
        )
    if markov_rank > 0:
        t["markov_head.markov_w1.weight"] = (rng.standard_normal((V, markov_rank))).astype(np.float32)
        t["markov_head.markov_w2.weight"] = (rng.standard_normal((V, markov_rank)) * 0.5 / np.sqrt(markov_rank)).astype(
            np.float32
        )
    if confidence:
        dim = H + (markov_rank if with_markov and markov_rank else 0)
        t["confidence_head.proj.weight"] = (rng.standard_normal((1, dim)) / np.sqrt(dim)).astype(np.float32)
        t["confidence_head.proj.bias"] = np.array([0.5], np.float32)
    t.update(tensors or {})
    for name in drop:
        t.pop(name)
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def write_zlab(
    path,
    target_dir,
    *,
    layers: int = 2,
    block: int | None = 16,
    taps=None,
    seed: int = 2,
    mask_token_id: int | None = None,
    std: float = 0.3,
    with_code: bool = True,
    nested: bool = True,
    config_overrides: dict | None = None,
    tensors: dict | None = None,
    extra_files: dict | None = None,
) -> Path:
    """A z-lab DFlash checkpoint (DFlashDraftModel, dflash_config, no embed/lm_head)."""
    path = _fresh(path)
    tcfg, _ = _target(target_dir)
    H, L_t, V = tcfg["hidden_size"], tcfg["num_hidden_layers"], tcfg["vocab_size"]
    taps = list(taps) if taps is not None else sorted({1, max(1, L_t // 2), L_t - 2})
    heads, kv, hd, inter = 4, 2, 16, 96
    mask = mask_token_id if mask_token_id is not None else V - 1
    cfg = dict(tcfg)
    cfg.update(
        {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "num_hidden_layers": layers,
            "num_target_layers": L_t,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "head_dim": hd,
            "intermediate_size": inter,
            "rope_theta": 1e6,
            "layer_types": ["full_attention"] * layers,
        }
    )
    dcfg = {"mask_token_id": mask, "target_layer_ids": taps}
    cfg.pop("block_size", None)
    if block is None:
        pass  # older heads: block 16 implied
    elif nested:
        dcfg["block_size"] = block
    else:
        cfg["block_size"] = block
    cfg["dflash_config"] = dcfg
    if with_code:
        cfg["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
    cfg.update(config_overrides or {})
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    if with_code:
        (path / "dflash.py").write_text("# z-lab's modeling code; never run by mlx-dspark\n")
    for name, text in (extra_files or {}).items():
        (path / name).write_text(text)
    rng = np.random.default_rng(seed)
    w = _rng_w(rng, std)
    t = {
        "fc.weight": w(H, len(taps) * H),
        "hidden_norm.weight": np.ones(H, np.float32),
        "norm.weight": np.ones(H, np.float32),
    }
    for i in range(layers):
        _layer_tensors(
            t, rng, i=i, hidden=H, heads=heads, kv=kv, hd=hd, inter=inter, gemma=False, k_eq_v=False, std=std
        )
    t.update(tensors or {})
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


# ------------------------------------------------------------- agreeing (crafted) pairs
# Hidden space of the crafted pairs (H = 64): dims [0, ID) carry a token's identity, dim TOK
# is 1 for every real token and 0 for the mask token, dim Q is 1 for every token (the mask too).
ID, TOK, Q = 32, 32, 33


def _perm(V: int, special: set[int], seed: int) -> np.ndarray:
    """next = f(token): one cycle over the non-special tokens (f = -1 on specials, which the
    crafted pairs never see)."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(np.array([t for t in range(V) if t not in special]))
    f = np.full(V, -1, np.int64)
    f[order] = np.roll(order, -1)
    return f


def write_perm_target(path, *, layers: int = 3, seed: int = 5) -> tuple[Path, np.ndarray]:
    """A qwen3 target whose greedy next token is f(current token) exactly, for every token
    outside {eos, mask}: attention and MLP outputs are zero (o_proj = down_proj = 0), so the
    final hidden is the normed embedding, and lm_head row f(t) is token t's identity vector."""
    path = write_model(
        path, "qwen3", layers=layers, hidden=64, heads=4, kv_heads=2, intermediate=128, tie=False, seed=seed
    )
    cfg = json.loads((path / "config.json").read_text())
    V = cfg["vocab_size"]
    t = load_file(str(path / "model.safetensors"))
    rng = np.random.default_rng(seed)
    ident = rng.standard_normal((V, ID)).astype(np.float32)
    ident /= np.linalg.norm(ident, axis=1, keepdims=True)
    mask = V - 1
    f = _perm(V, {cfg["eos_token_id"], mask}, seed)
    normal = np.flatnonzero(f >= 0)
    emb = np.zeros((V, 64), np.float32)
    emb[:, :ID] = ident * 4.0
    emb[:, TOK] = 1.0
    emb[:, Q] = 1.0
    emb[mask, :ID] = 0.0
    emb[mask, TOK] = 0.0
    head = np.zeros((V, 64), np.float32)
    head[f[normal], :ID] = ident[normal] * 8.0  # row f(t) = identity of t
    t["model.embed_tokens.weight"] = emb
    t["lm_head.weight"] = head
    for i in range(layers):
        t[f"model.layers.{i}.self_attn.o_proj.weight"][:] = 0.0
        t[f"model.layers.{i}.mlp.down_proj.weight"][:] = 0.0
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path, f


def write_perm_dspark(
    path, target_dir, f: np.ndarray, *, rank: int = 48, block: int = 7, seed: int = 6, conf_bias: float = 6.0
) -> Path:
    """A DSpark drafter whose Markov head encodes f: U = 0 (zero lm_head) and W2 . W1[t] peaks
    at f(t), so sequential Markov sampling drafts f(a), f(f(a)), ... exactly (a parallel,
    non-sequential use of the head would draft f(a) in every slot)."""
    V = len(f)
    rng = np.random.default_rng(seed)
    u = rng.standard_normal((V, rank)).astype(np.float32)
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    normal = np.flatnonzero(f >= 0)
    w2 = np.zeros((V, rank), np.float32)
    w2[f[normal]] = u[normal] * 10.0  # row f(t) = u_t
    tensors = {
        "markov_head.markov_w1.weight": u,
        "markov_head.markov_w2.weight": w2,
        "lm_head.weight": np.zeros((V, 64), np.float32),
        "confidence_head.proj.weight": np.zeros((1, 64 + rank), np.float32),
        "confidence_head.proj.bias": np.array([conf_bias], np.float32),
    }
    return write_deepspec(path, target_dir, markov_rank=rank, block=block, seed=seed, tensors=tensors)


def _anchor_copy_layer(t: dict, i: int, *, flip_anchor: bool, heads: int = 4, kv: int = 2, hd: int = 16) -> None:
    """Layer i of a crafted DFlash drafter (H = 64, qwen3 style):
    attention: every slot attends (almost) only to the anchor, the one key with a TOK
      component (queries and keys live in the slowest RoPE pair, so relative position barely
      matters), and adds ~45x the anchor's identity to its residual;
    MLP: negates the identity of either the anchor slot (flip_anchor) or the mask slots."""
    H = 64
    p = f"layers.{i}.self_attn."
    q = np.zeros((heads * hd, H), np.float32)
    k = np.zeros((kv * hd, H), np.float32)
    v = np.zeros((kv * hd, H), np.float32)
    o = np.zeros((H, heads * hd), np.float32)
    slow = hd // 2 - 1
    rep = heads // kv
    for h in range(heads):
        q[h * hd + slow, Q] = 1.0
    for g in range(kv):
        k[g * hd + slow, TOK] = 1.0
        for d in range(hd):
            v[g * hd + d, g * hd + d] = 1.0  # identity dims 0..kv*hd-1 (= ID)
    for h in range(heads):
        g = h // rep
        for d in range(hd):
            o[g * hd + d, h * hd + d] = 6.0 / rep
    t[p + "q_proj.weight"], t[p + "k_proj.weight"], t[p + "v_proj.weight"], t[p + "o_proj.weight"] = q, k, v, o
    t[p + "q_norm.weight"] = np.full(hd, 8.0, np.float32)
    t[p + "k_norm.weight"] = np.full(hd, 8.0, np.float32)
    m = f"layers.{i}.mlp."
    inter = t[m + "gate_proj.weight"].shape[0]
    gate = np.zeros((inter, H), np.float32)
    up = np.zeros((inter, H), np.float32)
    down = np.zeros((H, inter), np.float32)
    G = 100.0
    for d in range(ID):
        if flip_anchor:
            gate[d, TOK] = G
        else:
            gate[d, Q], gate[d, TOK] = G, -2 * G
        up[d, d] = 1.0
        down[d, d] = -1.0
    t[m + "gate_proj.weight"], t[m + "up_proj.weight"], t[m + "down_proj.weight"] = gate, up, down
    for n in ("input_layernorm", "post_attention_layernorm"):
        t[f"layers.{i}.{n}.weight"] = np.ones(H, np.float32)


def write_perm_dflash(path, target_dir, *, packaging: str, block: int = 7, seed: int = 7) -> Path:
    """A DFlash drafter whose FIRST draft is always the target's next token f(anchor), and whose
    other drafts are wrong; under the wrong slot convention the first draft is wrong too.
      z-lab:    slots 1..B-1 copy the anchor's identity -> f(anchor); slot 0 is negated.
      DeepSpec: slot 0 (the anchor) -> f(anchor); the mask slots are negated."""
    if packaging == "zlab":
        p = write_zlab(path, target_dir, block=block, seed=seed, layers=1, with_code=False)
    else:
        p = write_deepspec(path, target_dir, markov_rank=0, confidence=False, layers=1, block=block, seed=seed)
    t = load_file(str(p / "model.safetensors"))
    _anchor_copy_layer(t, 0, flip_anchor=packaging == "zlab")
    t["fc.weight"] = np.zeros_like(t["fc.weight"])  # context rows: zero keys and values
    t["hidden_norm.weight"] = np.ones_like(t["hidden_norm.weight"])
    t["norm.weight"] = np.ones_like(t["norm.weight"])
    save_file(t, str(p / "model.safetensors"), metadata={"format": "pt"})
    return p


# ------------------------------------------------------------------- shared workspace
_WORKSPACE: dict = {}


def workspace() -> dict:
    """All fixture checkpoints, written once per test process into a temp folder."""
    if _WORKSPACE:
        return _WORKSPACE
    root = scratch_dir("mlx-dspark-drafters-")
    tq = write_model(root / "target-qwen3", "qwen3", layers=4, hidden=64, seed=3)
    tg = write_gemma4_target(root / "target-gemma4", seed=4)
    tp, f = write_perm_target(root / "target-perm")
    _WORKSPACE.update(
        root=root,
        target_qwen3=tq,
        target_gemma4=tg,
        target_perm=tp,
        perm=f,
        dspark_qwen3=write_deepspec(root / "dspark-qwen3", tq),
        dspark_gemma4=write_deepspec(root / "dspark-gemma4", tg, style="gemma4", softcap=1.0),
        dflash_deepspec=write_deepspec(root / "dflash-deepspec", tq, markov_rank=0, confidence=False),
        dflash_zlab=write_zlab(root / "dflash-zlab", tq),
        dflash_zlab_gemma4=write_zlab(root / "dflash-zlab-gemma4", tg, block=8),
        perm_dspark=write_perm_dspark(root / "perm-dspark", tp, f),
        perm_dspark_noisy=write_perm_dspark_noisy(root / "perm-dspark-noisy", tp, f),
        perm_dflash_zlab=write_perm_dflash(root / "perm-dflash-zlab", tp, packaging="zlab", block=16),
        perm_dflash_deepspec=write_perm_dflash(root / "perm-dflash-deepspec", tp, packaging="deepspec"),
    )
    return _WORKSPACE


def perm_chain(start: int, n: int) -> list[int]:
    """The perm target's greedy continuation of `start`: f(start), f(f(start)), ... (n tokens)."""
    f = workspace()["perm"]
    out, t = [], start
    for _ in range(n):
        t = int(f[t])
        out.append(t)
    return out


def write_perm_dspark_noisy(path, target_dir, f: np.ndarray, *, noise: float = 8.0, seed: int = 8) -> Path:
    """The agreeing DSpark drafter with noise on W2: it agrees with the target only some of the
    time, so rounds accept varied, partial prefixes (a stress test for commits and crops)."""
    p = write_perm_dspark(path, target_dir, f, seed=seed)
    t = load_file(str(p / "model.safetensors"))
    rng = np.random.default_rng(seed)
    w2 = t["markov_head.markov_w2.weight"]
    t["markov_head.markov_w2.weight"] = (w2 + noise * rng.standard_normal(w2.shape) / np.sqrt(w2.shape[1])).astype(
        np.float32
    )
    save_file(t, str(p / "model.safetensors"), metadata={"format": "pt"})
    return p


_TARGETS: dict = {}


def target(path):
    """(Target, tokenizer) loaded once per process."""
    key = str(path)
    if key not in _TARGETS:
        from mlx_dspark.models.loading import load_target

        _TARGETS[key] = load_target(key)
    return _TARGETS[key]


def perm_noisy_pair(root, prompt_seed: int) -> tuple:
    """(target, tokenizer, its noisy 16-bit DSpark drafter, a 6-token prompt of ordinary tokens),
    written below `root` and loaded as a user loads them."""
    from mlx_dspark.models.drafters import load_drafter

    root = Path(root)
    tp, f = write_perm_target(root / "target")
    dp = write_perm_dspark_noisy(root / "dspark", tp, f)
    tgt, tok = target(tp)
    normal = np.flatnonzero(f >= 0)
    prompt = [int(t) for t in np.random.default_rng(prompt_seed).choice(normal, size=6, replace=False)]
    return tgt, tok, load_drafter(str(dp), tgt, bits=16), prompt
