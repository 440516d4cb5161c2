"""Loading a drafter for a target: the registry, the checkpoint, the precision.

`resolve_drafter(target, mode, drafter, bits)` is what the CLI and `load_pair` call:
  * `drafter` given: load it (any packaging that fits the target); with --mode dspark|dflash
    the checkpoint must be of that kind.
  * otherwise the registry: --mode dspark / dflash take that kind; --mode auto takes DSpark,
    else DFlash, else None (the caller falls back to lookup).

Precision (`bits`): 4 (default) or 8 quantizes the drafter's matrices at load (MLX affine,
group 64); 16 keeps them unquantized. Either way floating weights are cast to the target's
compute dtype first (float32 on the CPU backend, where bf16 matmuls never use BLAS). What stays
exact: norms, the confidence head (it decides truncation), and the target's bound matrices
(z-lab's embed / head; DeepSpec copies identical to the target's unquantized ones are bound
to them instead of being stored twice). A checkpoint stored quantized (`export --bits 8`, like
the shipped SmolLM2 drafter) is dequantized as it is read (checkpoints.read_weights) and then
treated the same way.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn

from ..errors import UserError, option
from . import registry
from .checkpoints import (
    DrafterSpec,
    build_spec,
    check_target,
    check_tensors,
    read_config,
    read_weights,
    resolve_checkpoint,
    tensor_shapes,
)
from .dflash import BlockDrafter, ZLabDFlashDrafter, ZLabDFlashModel, _raw_head
from .dspark import DSparkDrafter, DSparkModel
from .precision import cast_model

GROUP_SIZE = 64


def module_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    from mlx.utils import tree_flatten

    return {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}


def target_dtype(target) -> mx.Dtype:
    """The dtype the target computes in (its embedding's, or its quantization scales')."""
    try:
        emb = target.embed_tokens
        scales = getattr(emb, "scales", None)
        return scales.dtype if scales is not None else emb.weight.dtype
    except AttributeError:
        from mlx.utils import tree_flatten

        for _, v in tree_flatten(target.model.parameters()):
            if mx.issubdtype(v.dtype, mx.floating):
                return v.dtype
        return mx.float32


def _same_matrix(a: mx.array, b: mx.array, rows: int = 8192) -> bool:
    if a.shape != b.shape:
        return False
    for i in range(0, a.shape[0], rows):
        x = a[i : i + rows].astype(mx.float32)
        y = b[i : i + rows].astype(mx.float32)
        if not bool(mx.array_equal(x, y).item()):
            return False
    return True


def _bind_identical_copies(model: DSparkModel, drafter: DSparkDrafter, target) -> list[str]:
    """Bind DeepSpec's embed / lm_head copies to the target's when they are the same matrices."""
    bound = []
    try:
        temb = target.embed_tokens
    except AttributeError:
        return bound
    if not isinstance(temb, nn.Embedding) or hasattr(temb, "scales"):
        return bound  # a quantized target: keep the drafter's exact copies
    if _same_matrix(model.embed_tokens.weight, temb.weight):
        drafter.bind(embed=temb)
        model.pop("embed_tokens")
        bound.append("embed_tokens")
    m = target.model
    tied = getattr(getattr(m, "args", None), "tie_word_embeddings", False)
    head = getattr(m, "lm_head", None)
    if head is not None and not tied and isinstance(head, nn.Linear) and not hasattr(head, "scales"):
        if _same_matrix(model.lm_head.weight, head.weight):
            drafter.bind(head=head)
            model.pop("lm_head")
            bound.append("lm_head")
    elif (head is None or tied) and _same_matrix(model.lm_head.weight, temb.weight):
        drafter.bind(head=temb.as_linear)
        model.pop("lm_head")
        bound.append("lm_head")
    return bound


def _quantize(model: nn.Module, bits: int) -> None:
    def predicate(path: str, m: nn.Module):
        if path.startswith("confidence_head"):
            return False
        if not isinstance(m, (nn.Linear, nn.Embedding)) or not hasattr(m, "to_quantized"):
            return False
        cols = m.weight.shape[-1]
        if cols % GROUP_SIZE == 0:
            return True
        return {"group_size": 32, "bits": bits, "mode": "affine"} if cols % 32 == 0 else False

    nn.quantize(model, group_size=GROUP_SIZE, bits=bits, class_predicate=predicate)
    if mx.default_device() == mx.cpu:
        from .precision import cast_scales_f32

        cast_scales_f32(model)


SMALL_DRAFTER_PARAMS = 150_000_000


def auto_bits(params: int | None = None) -> int:
    """16 (unquantized) on the CPU backend, where MLX's quantized matmul does not batch over the
    block's rows and a 4-bit drafter round measures ~1.5x slower than float32 (bench_rounds.py),
    and on a GPU for a drafter of at most SMALL_DRAFTER_PARAMS parameters (`params`): there 4 bits
    save little memory traffic and cost acceptance (H200, the shipped SmolLM2 drafter: humaneval
    4.15 -> 2.86 tokens per round, DSpark 1.25x -> 1.11x mlx_lm.generate overall:
    bench/results/dspark-h200.md). 4 on a GPU for larger drafters."""
    if mx.default_device() == mx.cpu or (params is not None and params <= SMALL_DRAFTER_PARAMS):
        return 16
    return 4


def load_drafter(source: str, target, *, bits: int | None = None, draft_vocab="auto") -> BlockDrafter:
    """Load a drafter checkpoint for `target`: strict 1:1, refused with the reason if it does not fit.
    `bits` 4 / 8 quantize at load, 16 keeps the weights unquantized, None picks auto_bits() by
    the device and the checkpoint's size.
    `draft_vocab`: auto / full / N, the draft vocabulary (models/draft_vocab.py)."""
    from . import draft_vocab as dv

    dv.parse_choice(draft_vocab)  # a bad value fails before the weights are read
    if bits is not None and bits not in (4, 8, 16):
        raise UserError(f"{option('drafter-bits')} must be 4, 8 or 16, got {bits}")
    path = resolve_checkpoint(source)
    spec: DrafterSpec = build_spec(path, read_config(path), tensor_shapes(path), source=str(source))
    check_target(spec, target)
    zlab = spec.packaging == "zlab-dflash"
    model = ZLabDFlashModel(spec.backbone) if zlab else DSparkModel(spec)
    check_tensors(spec, module_shapes(model))
    weights = read_weights(path)
    model.load_weights(list(weights.items()), strict=True)
    if bits is None:
        bits = auto_bits(sum(v.size for v in weights.values()))
    del weights
    cast_model(model, target_dtype(target))
    if zlab:
        drafter: BlockDrafter = ZLabDFlashDrafter(model, spec, target, bits=bits)
    else:
        drafter = DSparkDrafter(model, spec, bits=bits)
        if spec.config.get("embeddings_from_target"):  # a compact `distill --export` checkpoint
            drafter.bind(embed=target.embed_tokens, head=_raw_head(target))
            drafter.bound = ["embed_tokens", "lm_head"]
        else:
            drafter.bound = _bind_identical_copies(model, drafter, target)
    if bits in (4, 8):
        _quantize(model, bits)
        if isinstance(drafter, DSparkDrafter):
            drafter.refresh()
    model.eval()
    mx.eval(model.parameters())
    ids = dv.select(path, draft_vocab, spec.vocab_size)
    if ids is not None:
        drafter.restrict_vocab(ids)
    from ..kernels import native_products

    native_products.prepack(drafter.product_weights())  # the CPU's float16 panels (kernels/draft_linear.py)
    return drafter


def _warn(msg: str) -> None:
    print(f"mlx-dspark: warning: {msg}", file=sys.stderr)


def resolve_drafter(
    target, mode: str = "auto", drafter: str | None = None, bits: int | None = None, draft_vocab="auto"
) -> BlockDrafter | None:
    """The drafter for `target` in `mode` (see the module docstring); None only for mode auto
    (or baseline / lookup) without a usable registered drafter."""
    if mode in ("baseline", "lookup"):
        if drafter:
            _warn(f"{option('drafter')} is not used with {option('mode', mode)}")
        return None
    if mode not in ("auto", "dspark", "dflash"):
        raise UserError(f"unknown mode {mode!r}")
    # Bad settings are errors here, before the registry: auto must not swallow them as a
    # "registered drafter could not be loaded" and fall back to lookup.
    from . import draft_vocab as dv

    dv.parse_choice(draft_vocab)
    if bits not in (None, 4, 8, 16):
        raise UserError(f"{option('drafter-bits')} must be 4, 8 or 16, got {bits}")
    if drafter:
        d = load_drafter(drafter, target, bits=bits, draft_vocab=draft_vocab)
        if mode != "auto" and d.kind != mode:
            raise UserError(
                f"{option('mode', mode)} needs a {mode} checkpoint, but {drafter} is a {d.kind} drafter "
                f"({d.packaging}); use {option('mode', d.kind)} or {option('mode', 'auto')}"
            )
        return d
    kinds = registry.AUTO_KINDS if mode == "auto" else (mode,)
    failures = []
    for kind in kinds:
        for pair in registry.pairs_for(target, kind):
            try:
                return load_drafter(pair.drafter, target, bits=bits, draft_vocab=draft_vocab)
            except UserError as e:
                if mode != "auto":
                    raise
                failures.append(f"{pair.drafter}: {e}")
    if failures:
        _warn("no registered drafter could be loaded (" + "; ".join(failures) + "); falling back to lookup")
    if mode == "auto":
        return None
    name = getattr(target, "source", "") or getattr(target, "name", "") or "this target"
    raise UserError(
        f"{option('mode', mode)}: no {mode} drafter is registered for {name}; pass one with {option('drafter')} "
        "REPO_OR_DIR (`mlx-dspark models` lists the registered pairs)"
    )


__all__ = ["auto_bits", "load_drafter", "resolve_drafter", "module_shapes", "target_dtype"]
