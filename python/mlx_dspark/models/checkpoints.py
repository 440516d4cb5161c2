"""Drafter checkpoints: where they come from, which packaging they are, and whether they fit.

Packagings (DeepSpec's build_draft_config and checkpoint manager; z-lab's dflash_config):
  deepspec-dspark   architectures Qwen3DSparkModel | Gemma4DSparkModel, markov_rank > 0 and/or
                    a confidence head; ships embed_tokens + lm_head copies; block slot j predicts
                    the token at anchor + j + 1 (all B slots are drafts).
  deepspec-dflash   the same classes with markov_rank 0 and no confidence head.
  zlab-dflash       architectures DFlashDraftModel, a `dflash_config` block; no embed / lm_head
                    (bound to the target's); slot 0 is the anchor only, slots 1..B-1 are drafts.

Loading is 1:1 by tensor name, strict: every tensor the module tree expects must be in the
files with the expected shape, and nothing else may be. Dimensions come from the tensor shapes
(the spec's config facts are partly third-party); the config gives what shapes cannot (RoPE,
eps, taps, mask id, block size, softcap).

Every refusal raises UserError naming the reason; nothing is loaded on a guess.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError, option
from .drafter_backbone import BackboneConfig

DEEPSPEC_ARCHS = {"Qwen3DSparkModel": "qwen3", "Gemma4DSparkModel": "gemma4"}
ZLAB_ARCHS = {"DFlashDraftModel"}
ZLAB_CODE_CLASS = "DFlashDraftModel"  # the one remote-code class whose architecture we implement
KNOWN_UNSUPPORTED = {
    "DFlash2DraftModel": "DFlash 2 (candidate-selector) drafters are not supported",
    "Qwen3Eagle3Model": "EAGLE3 drafters are not supported yet",
    "Gemma4Eagle3Model": "EAGLE3 drafters are not supported yet",
    "Eagle3DraftModel": "EAGLE3 drafters are not supported yet",
    "LlamaForCausalLMEagle3": "EAGLE3 drafters are not supported yet",
}


@dataclass
class DrafterSpec:
    packaging: str  # deepspec-dspark | deepspec-dflash | zlab-dflash
    style: str  # qwen3 | gemma4
    path: Path
    source: str
    config: dict
    backbone: BackboneConfig
    vocab_size: int
    block_size: int
    mask_token_id: int
    taps: tuple[int, ...]
    markov_rank: int = 0
    confidence: bool = False
    confidence_with_markov: bool = False
    softcap: float | None = None
    embed_scale: float = 1.0
    output_multiplier: float | None = None
    num_target_layers: int | None = None
    shapes: dict = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "dspark" if self.packaging == "deepspec-dspark" else "dflash"

    @property
    def logits_start(self) -> int:
        """First block slot whose logits are drafts: 0 for DeepSpec, 1 for z-lab."""
        return 1 if self.packaging == "zlab-dflash" else 0

    @property
    def block_drafts(self) -> int:
        return self.block_size - self.logits_start


# ------------------------------------------------------------------------------ location
def resolve_checkpoint(source: str) -> Path:
    """A local folder as is; otherwise an HF repo id, downloaded (config, weights, and any
    Python files, so that a repo shipping code can be recognised and refused)."""
    if not source or not str(source).strip():
        raise UserError(f"{option('drafter')} is empty: pass a drafter folder or an HF repo id")
    p = Path(source).expanduser()
    if p.exists():
        if not p.is_dir() or not (p / "config.json").exists():
            raise UserError(
                f"drafter {p} is not a checkpoint folder: it has no config.json (expected config.json + *.safetensors)"
            )
        return p
    if str(source).startswith((".", "/", "~")) or str(source).count("/") != 1:
        raise UserError(f"drafter {source!r} does not exist (pass a local folder or an HF repo id like org/name)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(source), allow_patterns=["*.json", "*.safetensors", "*.py"]))
    except Exception as e:  # network, auth, missing repo
        raise UserError(
            f"could not fetch drafter {source!r} from the Hugging Face hub "
            f"({type(e).__name__}: {e}); pass a local folder with {option('drafter')}"
        ) from None


def read_config(path: Path) -> dict:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"drafter {path}: config.json is unreadable ({e})") from None
    if not isinstance(cfg, dict):
        raise UserError(f"drafter {path}: config.json is not a JSON object")
    return cfg


def stored_quantization(cfg: dict, path: Path) -> tuple[int, int]:
    """(bits, group_size) of a checkpoint stored quantized: config.json's "quantization"
    block (MLX affine; e.g. `python -m mlx_dspark.train.export --bits 8`)."""
    q = cfg.get("quantization")
    if (
        not isinstance(q, dict)
        or q.get("bits") not in (2, 3, 4, 5, 6, 8)
        or q.get("group_size") not in (32, 64, 128)
        or q.get("mode", "affine") != "affine"
    ):
        raise UserError(
            f"drafter {path} stores quantized tensors (*.scales) but its config.json has no valid "
            f'"quantization" block (got {q!r}; expected {{"bits": 8, "group_size": 64}})'
        )
    return int(q["bits"]), int(q["group_size"])


def read_weights(path: Path) -> dict:
    """Every tensor of the folder's safetensors files. A checkpoint stored quantized comes back
    dequantized (X.weight + X.scales + X.biases -> X.weight, in the scales' dtype), so every
    loader sees the one plain layout and quantizes again, at load, to the bits asked for."""
    import mlx.core as mx

    weights: dict = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    scales = [n for n in weights if n.endswith(".scales")]
    if scales:
        bits, group = stored_quantization(read_config(path), path)
        for name in scales:
            base = name[: -len(".scales")]
            s, b = weights.pop(name), weights.pop(base + ".biases", None)
            weights[base + ".weight"] = mx.dequantize(
                weights[base + ".weight"], s, b, group_size=group, bits=bits
            ).astype(s.dtype)
    return weights


def safetensors_header(f: Path) -> dict:
    """The header of a safetensors file, checked against the file's size: a file that is cut
    short or is not safetensors at all is refused in one line, before anything reads its data."""

    def broken(why: str) -> UserError:
        return UserError(f"{f} is truncated or corrupt ({why}): download it again")

    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise broken(f"{size} bytes, shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise broken(f"its header claims {n} bytes but the file has {size}")
            header = json.loads(fh.read(n))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise broken(f"{type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise broken("its header is not a JSON object")
    end = max(
        (
            int(m["data_offsets"][1])
            for k, m in header.items()
            if k != "__metadata__" and isinstance(m, dict) and "data_offsets" in m
        ),
        default=0,
    )
    if 8 + n + end > size:
        raise broken(f"its tensors need {8 + n + end} bytes but the file has {size}")
    return header


def check_safetensors(folder: Path) -> None:
    """Every *.safetensors file of a model folder is whole (see safetensors_header)."""
    for f in sorted(Path(folder).glob("*.safetensors")):
        safetensors_header(f)


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the folder's safetensors files (headers only); a stored-
    quantized tensor is reported with its dequantized shape, as `read_weights` returns it."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"drafter {path} has no *.safetensors weights")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        header = safetensors_header(f)
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            if name in shapes:
                raise UserError(f"drafter tensor {name} appears in more than one weights file")
            shapes[name] = tuple(int(d) for d in meta["shape"])
    scales = [n for n in shapes if n.endswith(".scales")]
    if scales:
        _, group = stored_quantization(read_config(path), path)
        for name in scales:
            base = name[: -len(".scales")]
            if base + ".weight" not in shapes:
                raise UserError(f"drafter {path}: {name} has no {base}.weight beside it")
            shapes[base + ".weight"] = (*shapes[base + ".weight"][:-1], shapes.pop(name)[-1] * group)
            shapes.pop(base + ".biases", None)
    return shapes


# ----------------------------------------------------------------------------- packaging
def detect_packaging(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    for a in archs:
        if a in KNOWN_UNSUPPORTED:
            raise UserError(f"drafter architecture {a}: {KNOWN_UNSUPPORTED[a]}")
    if any(a in DEEPSPEC_ARCHS for a in archs):
        rank = int(cfg.get("markov_rank") or 0)
        return "deepspec-dspark" if rank > 0 or cfg.get("enable_confidence_head") else "deepspec-dflash"
    if any(a in ZLAB_ARCHS for a in archs):
        return "zlab-dflash"
    if archs == [] and isinstance(cfg.get("dflash_config"), dict):
        return "zlab-dflash"
    raise UserError(
        f"unknown drafter packaging (architectures={archs or 'none'}): mlx-dspark loads DeepSpec "
        "DSpark/DFlash checkpoints (Qwen3DSparkModel, Gemma4DSparkModel) and z-lab DFlash "
        "checkpoints (DFlashDraftModel)"
    )


def check_remote_code(path: Path, cfg: dict, packaging: str) -> None:
    """Refuse a repo whose architecture is defined by its own Python code.

    The one exception is z-lab's DFlash: its config points AutoModel at `dflash.DFlashDraftModel`,
    which is exactly the architecture implemented here; its code file is never run."""
    py = sorted(
        p.relative_to(path).as_posix()
        for p in path.rglob("*.py")
        if not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    auto_map = cfg.get("auto_map") or {}
    if not py and not auto_map:
        return
    if packaging == "zlab-dflash" and isinstance(auto_map, dict):
        refs = [v if isinstance(v, str) else (v[0] if v else "") for v in auto_map.values()]
        ok_refs = all(r.split("--")[-1].rsplit(".", 1)[-1] == ZLAB_CODE_CLASS for r in refs if r)
        modules = {r.split("--")[-1].rsplit(".", 1)[0] + ".py" for r in refs if r}
        if ok_refs and set(py) <= modules:
            return
    what = []
    if py:
        what.append("Python files " + ", ".join(py[:5]) + (" ..." if len(py) > 5 else ""))
    if auto_map:
        what.append(f"auto_map {json.dumps(auto_map)}")
    raise UserError(
        f"drafter {path} ships its own Python code ({'; '.join(what)}): its architecture is "
        "defined by that code, which mlx-dspark never runs; refusing rather than guessing"
    )


# ----------------------------------------------------------------------------------- spec
def _need(cfg: dict, key: str, where: str, value=None):
    v = cfg.get(key) if value is None else value
    if v is None:
        raise UserError(f"drafter config ({where}) has no {key!r}")
    return v


def _shape(shapes: dict, name: str, packaging: str) -> tuple[int, ...]:
    if name not in shapes:
        raise UserError(f"drafter ({packaging}) is missing tensor {name}")
    return shapes[name]


def _rope_params(cfg: dict, style: str) -> tuple[str, float, float, dict]:
    """(rope_type, theta, partial_rotary_factor, scaling block) from the drafter config."""
    params = cfg.get("rope_parameters")
    if style == "gemma4":
        full = (params or {}).get("full_attention") if isinstance(params, dict) else None
        if not isinstance(full, dict):
            raise UserError("gemma4 drafter config has no rope_parameters.full_attention block")
        rtype = full.get("rope_type", "default")
        return rtype, float(full.get("rope_theta", 1e6)), float(full.get("partial_rotary_factor", 1.0)), full
    block = params if isinstance(params, dict) and "rope_type" in params else (cfg.get("rope_scaling") or {})
    theta = cfg.get("rope_theta")
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        theta = params["rope_theta"]
    rtype = (block.get("rope_type") or block.get("type") or "default") if isinstance(block, dict) else "default"
    return (
        rtype,
        float(theta if theta is not None else 10000.0),
        float(cfg.get("partial_rotary_factor", 1.0)),
        dict(block or {}),
    )


SUPPORTED_ROPE = {"default", "proportional", "linear", "llama3", "yarn", "dynamic"}


def _check_config_fields(
    cfg: dict, style: str, *, hidden: int, inter: int, head_dim: int, heads: int, kv_heads: int
) -> None:
    """The architecture is read from the tensors; a config field that says otherwise is refused,
    naming the field (strict 1:1 loading: neither the config nor the tensors is silently wrong).
    Gemma 4 drafters use the global head size and KV heads, and ignore head_dim / num_key_value_heads."""
    fields = {"hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads}
    if style == "gemma4":
        fields.update(global_head_dim=head_dim, num_global_key_value_heads=kv_heads)
    else:
        fields.update(head_dim=head_dim, num_key_value_heads=kv_heads)
    for name, derived in fields.items():
        stated = cfg.get(name)
        if stated is not None and int(stated) != derived:
            raise UserError(
                f"drafter config says {name}={stated} but its tensors give {derived}; "
                "the checkpoint is inconsistent: download it again or fix config.json"
            )


def build_spec(path: Path, cfg: dict, shapes: dict, source: str = "") -> DrafterSpec:
    packaging = detect_packaging(cfg)
    check_remote_code(path, cfg, packaging)
    zlab = packaging == "zlab-dflash"
    style = "qwen3"
    if not zlab:
        style = next(DEEPSPEC_ARCHS[a] for a in cfg["architectures"] if a in DEEPSPEC_ARCHS)
    dcfg = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}

    def value(key):  # z-lab reads dflash_config first, then the top level
        return dcfg.get(key, cfg.get(key)) if zlab else cfg.get(key)

    fc = _shape(shapes, "fc.weight", packaging)
    if len(fc) != 2:
        raise UserError(f"drafter tensor fc.weight has shape {fc}, expected 2-D")
    H, context_dim = fc
    layer_ids = sorted({int(n.split(".")[1]) for n in shapes if n.startswith("layers.") and n.split(".")[1].isdigit()})
    if not layer_ids:
        raise UserError(f"drafter ({packaging}) has no layers.N.* tensors")
    n_layers = layer_ids[-1] + 1
    if cfg.get("num_hidden_layers") is not None and int(cfg["num_hidden_layers"]) != n_layers:
        raise UserError(
            f"drafter config says num_hidden_layers={cfg['num_hidden_layers']} but the weights hold {n_layers} layers"
        )
    hd = _shape(shapes, "layers.0.self_attn.q_norm.weight", packaging)[0]
    q_rows = _shape(shapes, "layers.0.self_attn.q_proj.weight", packaging)[0]
    k_rows = _shape(shapes, "layers.0.self_attn.k_proj.weight", packaging)[0]
    inter = _shape(shapes, "layers.0.mlp.gate_proj.weight", packaging)[0]
    if q_rows % hd or k_rows % hd:
        raise UserError(
            f"drafter attention shapes q_proj {q_rows} / k_proj {k_rows} are not multiples of "
            f"head_dim {hd} (from q_norm)"
        )
    k_eq_v = style == "gemma4" and "layers.0.self_attn.v_proj.weight" not in shapes
    if style == "gemma4" and bool(cfg.get("attention_k_eq_v", k_eq_v)) != k_eq_v:
        raise UserError(
            f"drafter config says attention_k_eq_v={cfg.get('attention_k_eq_v')} but the weights "
            f"{'lack' if k_eq_v else 'have'} v_proj"
        )
    _check_config_fields(cfg, style, hidden=H, inter=inter, head_dim=hd, heads=q_rows // hd, kv_heads=k_rows // hd)
    rtype, theta, partial, scaling = _rope_params(cfg, style)
    if rtype not in SUPPORTED_ROPE:
        raise UserError(
            f"drafter RoPE type {rtype!r} is not supported (supported: {', '.join(sorted(SUPPORTED_ROPE))})"
        )
    if zlab:
        types = cfg.get("layer_types") or []
        if any(t != "full_attention" for t in types):
            raise UserError(
                "z-lab DFlash drafters with sliding-window layers are not supported yet "
                f"(layer_types={sorted(set(types))})"
            )
        if cfg.get("is_causal") or dcfg.get("is_causal"):
            raise UserError("causal z-lab DFlash drafters (is_causal) are not supported")
    bcfg = BackboneConfig(
        style=style,
        hidden_size=H,
        num_layers=n_layers,
        num_heads=q_rows // hd,
        num_kv_heads=k_rows // hd,
        head_dim=hd,
        intermediate_size=inter,
        context_dim=context_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
        rope_theta=theta,
        rope_type=rtype,
        partial_rotary_factor=partial,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 32768),
        k_eq_v=k_eq_v,
    )

    block = value("block_size")
    if block is None and zlab:
        block = 16  # z-lab's -b16 heads; newer configs state it in dflash_config
    mask = value("mask_token_id")
    taps = value("target_layer_ids")
    n_target = value("num_target_layers")
    if zlab and taps is None and n_target is not None:
        taps = default_zlab_taps(int(n_target), n_layers)
    where = "dflash_config / top level" if zlab else "top level"
    block = int(_need(cfg, "block_size", where, block))
    mask = int(_need(cfg, "mask_token_id", where, mask))
    taps = tuple(int(t) for t in _need(cfg, "target_layer_ids", where, taps))
    if not taps or context_dim % len(taps):
        raise UserError(
            f"drafter fc takes {context_dim} features, which is not a multiple of its {len(taps)} target_layer_ids"
        )
    if block < 1 + (1 if zlab else 0):
        raise UserError(f"drafter block_size {block} is too small")

    if zlab:
        vocab = int(cfg.get("vocab_size") or 0)
        spec = DrafterSpec(
            packaging,
            style,
            path,
            source or str(path),
            cfg,
            bcfg,
            vocab,
            block,
            mask,
            taps,
            embed_scale=float(value("input_embedding_scale") or 1.0),
            output_multiplier=value("output_multiplier"),
            softcap=value("final_logit_softcapping"),
            num_target_layers=int(n_target) if n_target is not None else None,
            shapes=shapes,
        )
        return spec
    # `distill --export` checkpoints leave out the embed / lm_head copies: bound to the target's.
    bound = bool(cfg.get("embeddings_from_target"))
    vocab = int(_need(cfg, "vocab_size", where)) if bound else _shape(shapes, "lm_head.weight", packaging)[0]
    rank = int(cfg.get("markov_rank") or 0)
    if rank > 0:
        htype = cfg.get("markov_head_type", "vanilla")
        if htype != "vanilla":
            raise UserError(f"DSpark Markov head type {htype!r} is not supported (only 'vanilla')")
        w1 = _shape(shapes, "markov_head.markov_w1.weight", packaging)
        if w1[1] != rank:
            raise UserError(f"drafter config says markov_rank={rank} but markov_w1 has shape {w1}")
    conf = bool(cfg.get("enable_confidence_head", False))
    with_markov = bool(cfg.get("confidence_head_with_markov", False)) and conf and rank > 0
    softcap = cfg.get("final_logit_softcapping")
    embed_scale = 1.0
    if style == "gemma4":
        import mlx.core as mx

        # HF's scaled embedding multiplies by sqrt(H) cast to the weight dtype (bf16 in the
        # released checkpoints): bf16(sqrt(3840)) = 62.0.
        embed_scale = float(mx.array(H**0.5, dtype=mx.bfloat16).astype(mx.float32).item())
    return DrafterSpec(
        packaging,
        style,
        path,
        source or str(path),
        cfg,
        bcfg,
        vocab,
        block,
        mask,
        taps,
        markov_rank=rank,
        confidence=conf,
        confidence_with_markov=with_markov,
        softcap=float(softcap) if softcap else None,
        embed_scale=embed_scale,
        num_target_layers=int(n_target) if n_target is not None else None,
        shapes=shapes,
    )


def default_zlab_taps(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default taps when dflash_config has none: evenly from layer 1 to L-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


# ------------------------------------------------------------------------- compatibility
def check_target(spec: DrafterSpec, target) -> None:
    """Refuse a drafter that does not fit `target` (hidden size, vocab, taps, depth)."""
    name = spec.source
    H = spec.backbone.hidden_size
    if target.hidden_size and H != target.hidden_size:
        raise UserError(
            f"drafter {name} has hidden size {H} but the target's is {target.hidden_size}: "
            "it was trained for another model"
        )
    if target.hidden_size and spec.backbone.context_dim != len(spec.taps) * target.hidden_size:
        raise UserError(
            f"drafter {name} fuses {spec.backbone.context_dim} features per position, not "
            f"{len(spec.taps)} taps x the target's hidden size {target.hidden_size}"
        )
    if spec.vocab_size and target.vocab_size and spec.vocab_size != target.vocab_size:
        raise UserError(
            f"drafter {name} has a vocabulary of {spec.vocab_size} tokens but the target's has "
            f"{target.vocab_size}: it was trained for another tokenizer"
        )
    V = spec.vocab_size or target.vocab_size
    if V and not 0 <= spec.mask_token_id < V:
        raise UserError(f"drafter {name}: mask_token_id {spec.mask_token_id} is outside the vocabulary (0..{V - 1})")
    L = target.num_layers
    for t in spec.taps:
        if t == L - 1:
            raise UserError(
                f"drafter {name} taps layer {t}, the target's final layer: its output is not a "
                f"DSpark/DFlash feature (taps must be in 0..{L - 2})"
            )
        if not 0 <= t < L:
            raise UserError(
                f"drafter {name} taps layer {t}, which is out of range for a target with {L} layers "
                f"(taps must be in 0..{L - 2})"
            )
    if spec.num_target_layers is not None and spec.num_target_layers != L:
        raise UserError(
            f"drafter {name} was trained against a {spec.num_target_layers}-layer target; this target has {L} layers"
        )


def check_tensors(spec: DrafterSpec, expected: dict[str, tuple[int, ...]]) -> None:
    """Strict 1:1 check of the file's tensors against the module tree's."""
    have = spec.shapes
    missing = sorted(set(expected) - set(have))
    unexpected = sorted(set(have) - set(expected))
    bad = sorted(n for n in set(expected) & set(have) if tuple(expected[n]) != tuple(have[n]))

    def few(names):
        return ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")

    problems = []
    if missing:
        problems.append(f"missing tensors: {few(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {few(unexpected)}")
    if bad:
        problems.append("shape mismatches: " + few([f"{n} {have[n]} != {tuple(expected[n])}" for n in bad]))
    if problems:
        raise UserError(
            f"drafter {spec.source} ({spec.packaging}, {spec.style}) does not match its "
            f"architecture: {'; '.join(problems)}"
        )
