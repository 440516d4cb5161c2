"""`distill`: train a DSpark (or DeepSpec-DFlash) drafter for a target, in MLX, on any backend.

One step (DeepSpec's "online target" mode: config/dspark/*_online.py):
  1. a batch of S samples (prompt + the target's own answer), right-padded;
  2. the target runs them once, teacher-forced: its tapped layer outputs and its logits (no
     cache of hidden states: they are recomputed every step);
  3. up to A anchors per sample are drawn uniformly among answer positions p whose successor is
     also an answer token; block = [x_p, MASK x (B-1)] at positions p..p+B-1;
  4. the drafter runs all S*A blocks at once with the block attention mask (train/forward.py);
  5. CE + L1(TV) + BCE(confidence) with position decay exp(-j/gamma) (train/losses.py);
  6. AdamW (weight decay 0 by default), linear warmup then cosine decay to 0, grad-norm clip.

Embed / lm_head are frozen copies of the target's; everything else trains from a random init
(DeepSpec does the same) or, with `init_from`, from an existing drafter checkpoint of the same
target (a warm start: its architecture is taken from its config, its weights continue training;
a larger `layers` grows it by identity-initialised layers). A DFlash drafter may start from a DSpark
drafter's backbone (fc, hidden_norm, layers, norm: the same tensors); its heads are dropped and the
block size and packaging are the DFlash ones.
With `train_vocab`, the draft head trains over the draft vocabulary only (losses.py).
Checkpoints (DeepSpec layout) and the resumable state are written every `save_every` steps and
at the end; `--resume` continues an interrupted run exactly where its last state left off (same
data order, same anchors).
"""

from __future__ import annotations

import json
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from ..errors import UserError
from ..models.checkpoints import read_weights
from ..models.dspark import DSparkModel
from . import checkpoint as ck
from . import data as D
from .batches import Batches, make_batch
from .budget import StepBudget
from .forward import block_hidden
from .losses import LossWeights, TrainVocab, block_loss


@dataclass
class DistillConfig:
    kind: str | None = None  # dspark | dflash; None: dspark, or the init checkpoint's
    layout: str | None = None  # dflash only: zlab (default) | deepspec; None: zlab, or the init checkpoint's
    layers: int | None = None  # None: 2, or the init checkpoint's
    block_size: int | None = None  # None: 7 (z-lab DFlash: 16), or the init checkpoint's
    taps: list[int] | None = None  # None: default_taps(target layers, n_taps)
    n_taps: int = 5
    markov_rank: int | None = None  # None: 256 (DeepSpec) for targets of hidden >= 2048, else 64
    intermediate_size: int | None = None  # None: the target's
    mask_token_id: int | None = None  # None: pick_mask_token
    steps: int = 2000
    train_seconds: float | None = None  # cap the steps to what fits in this many seconds
    batch_size: int = 8  # samples per step
    anchors: int = 64  # blocks per sample (DeepSpec: 512)
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float | None = None  # position decay exp(-j/gamma); None: 4 (DeepSpec), z-lab DFlash by block (7 at 16)
    save_every: int = 500
    seed: int = 0
    log_every: int = 10
    gen: D.GenConfig = field(default_factory=D.GenConfig)
    init_from: str | None = None  # a drafter folder / repo id to start from (a warm start)
    train_vocab: int | str = "full"  # full, auto or N: train on the draft vocabulary (losses.py)
    init_layers: int | None = None  # set by resolve_arch: init_from's depth (below `layers`: grown)
    init_backbone_only: bool = False  # set by resolve_arch: a DSpark init_from for a DFlash drafter

    def arch(self) -> dict:
        """What must match for --resume."""
        out = {
            k: getattr(self, k)
            for k in (
                "kind",
                "layers",
                "block_size",
                "taps",
                "markov_rank",
                "intermediate_size",
                "mask_token_id",
                "batch_size",
                "anchors",
                "lr",
                "seed",
                "train_vocab",
            )
        }
        if self.kind == "dflash":
            out["layout"] = self.layout
        return out

    def decay(self) -> float:
        """The loss's position decay: DeepSpec's 4.0; for z-lab DFlash the DFlash paper's schedule by
        block size (7 for 16, 5 for 10, 4 for 8 and below), the nearest one at or below the block."""
        if self.gamma is not None:
            return float(self.gamma)
        if self.kind == "dflash" and self.layout == "zlab":
            return 7.0 if self.block_size >= 16 else 5.0 if self.block_size >= 10 else 4.0
        return 4.0


# --------------------------------------------------------------------------------- progress
class Progress:
    """One status line: step, loss, tok/s (supervised draft tokens), lr, ETA. Redrawn in place on
    a terminal; a plain line every `every` seconds otherwise (logs)."""

    def __init__(self, total: int, stream=None, every: float = 10.0):
        self.total = total
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every = 0.25 if self.tty else every
        self.t0 = time.perf_counter()
        self.last = 0.0

    def update(self, step: int, metrics: dict, tokens: int, start_step: int, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.last < self.every:
            return
        self.last = now
        el = now - self.t0
        done = max(step - start_step, 1)
        rate = tokens / max(el, 1e-9)
        eta = el / done * (self.total - step)
        width = 24
        fill = int(width * step / max(self.total, 1))
        bar = "#" * fill + "." * (width - fill)
        parts = [f"[{bar}] {step}/{self.total}", f"loss {metrics.get('loss', float('nan')):.3f}"]
        for k in ("ce", "tv", "conf"):
            if k in metrics:
                parts.append(f"{k} {metrics[k]:.3f}")
        if "tau" in metrics:
            parts.append(f"tau~{metrics['tau']:.2f}")
        parts += [f"{rate:,.0f} tok/s", f"lr {metrics.get('lr', 0):.1e}", f"ETA {_fmt(eta)}"]
        line = " | ".join(parts)
        if self.tty:
            self.stream.write("\r" + line[:200].ljust(120))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _fmt(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def lr_at(step: int, total: int, peak: float, warmup_ratio: float) -> float:
    """Linear warmup over warmup_ratio * total steps, then cosine decay to 0 (DeepSpec's
    CosineAnnealingWarmupLR). `step` is 0-based: the lr used by the (step+1)-th update."""
    warm = max(1, int(round(warmup_ratio * total)))
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(total - warm, 1)
    return 0.5 * peak * (1.0 + math.cos(math.pi * min(t, 1.0)))


# ------------------------------------------------------------------------------------- model
# DistillConfig field -> how an existing checkpoint (its DrafterSpec, read by our loader) says it.
_INIT_ARCH = {
    "layers": lambda s: s.backbone.num_layers,
    "block_size": lambda s: s.block_size,
    "taps": lambda s: [int(t) for t in s.taps],
    "markov_rank": lambda s: s.markov_rank,
    "intermediate_size": lambda s: s.backbone.intermediate_size,
    "mask_token_id": lambda s: s.mask_token_id,
    "kind": lambda s: s.kind,
    "layout": lambda s: {"zlab-dflash": "zlab", "deepspec-dflash": "deepspec"}.get(s.packaging),
}
_FLAG = {
    "layers": "--layers",
    "block_size": "--block-size",
    "taps": "--taps",
    "markov_rank": "--markov-rank",
    "intermediate_size": "--intermediate-size",
    "mask_token_id": "--mask-token-id",
    "kind": "--kind",
    "layout": "--layout",
}


def resolve_arch(cfg: DistillConfig, target) -> Path | None:
    """Fill the architecture fields left None: from `cfg.init_from` (which must fit `target`; an
    architecture flag given as well must agree), else the defaults. Returns the init checkpoint's
    folder, or None. Idempotent."""
    path = _init_arch(cfg, target) if cfg.init_from else None
    cfg.kind = cfg.kind or "dspark"
    if cfg.layout not in (None, "zlab", "deepspec"):
        raise UserError(f"--layout must be zlab or deepspec, got {cfg.layout!r}")
    if cfg.kind == "dspark":
        if cfg.layout not in (None, "deepspec"):
            raise UserError("--layout zlab is a DFlash packaging: use it with --kind dflash")
        cfg.layout = None
    else:
        cfg.layout = cfg.layout or "zlab"
    cfg.layers = 2 if cfg.layers is None else cfg.layers
    if cfg.block_size is None:
        cfg.block_size = 16 if cfg.layout == "zlab" else 7
    return path


def _init_arch(cfg: DistillConfig, target) -> Path:
    from ..models import checkpoints as mc

    try:
        path = mc.resolve_checkpoint(cfg.init_from)
        hcfg = mc.read_config(path)
        spec = mc.build_spec(path, hcfg, mc.tensor_shapes(path), source=str(cfg.init_from))
        mc.check_target(spec, target)
    except UserError as e:
        raise UserError(f"--init-from: {e}") from None
    if spec.packaging not in ("deepspec-dspark", "deepspec-dflash", "zlab-dflash"):
        raise UserError(f"--init-from {cfg.init_from}: a {spec.packaging} checkpoint cannot be trained further here")
    keys = _INIT_ARCH
    if cfg.kind == "dflash" and spec.kind == "dspark":
        # A DFlash drafter grown from a DSpark drafter's backbone: the same fc / layers / norm
        # tensors; the Markov and confidence heads are dropped, block and packaging are DFlash's.
        cfg.init_backbone_only = True
        keys = {k: v for k, v in _INIT_ARCH.items() if k not in ("block_size", "markov_rank", "kind", "layout")}
    for key, read in keys.items():
        have = read(spec)
        if key == "layout" and have is None:
            continue  # a DSpark checkpoint: no DFlash layout
        mine = getattr(cfg, key)
        if key == "layers":
            cfg.init_layers = have
        if key == "layers" and mine is not None and mine > have:
            continue  # a deeper drafter: the checkpoint's layers, then new ones that start as identity
        if mine is not None and mine != have:
            more = " or make it deeper" if key == "layers" else ""
            raise UserError(
                f"{_FLAG[key]} {mine} disagrees with --init-from {cfg.init_from}, whose {key} is {have}: "
                f"drop {_FLAG[key]} (a warm start keeps the checkpoint's architecture{more})"
            )
        setattr(cfg, key, have)
    return path


_BACKBONE = ("fc.", "hidden_norm.", "layers.", "norm.")


def load_init_weights(model: DSparkModel, path: Path, backbone_only: bool = False) -> None:
    """The trainable weights of the checkpoint at `path` into `model` (float32), strictly by name
    and shape; its embed_tokens / lm_head copies, if any, are ignored (the target's are used).
    `backbone_only` reads only the backbone's tensors (a DSpark checkpoint's heads are dropped).

    A `model` deeper than the checkpoint grows it: layers past the checkpoint's keep their fresh
    init but with zero output projections (o_proj, down_proj), so each starts as the identity on
    the residual stream and the grown drafter drafts exactly what the checkpoint did."""
    want = {k: v.shape for k, v in tree_flatten(model.parameters()) if not k.startswith(("embed_tokens.", "lm_head."))}
    got = {k: v for k, v in read_weights(Path(path)).items() if not k.startswith(("embed_tokens.", "lm_head."))}
    if backbone_only:
        got = {k: v for k, v in got.items() if k.startswith(_BACKBONE)}
    have = 1 + max((int(k.split(".")[1]) for k in got if k.startswith("layers.")), default=-1)
    new_layers = range(have, len(model.layers))
    for i in new_layers:
        want = {k: v for k, v in want.items() if not k.startswith(f"layers.{i}.")}
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    bad = sorted(k for k in set(want) & set(got) if tuple(got[k].shape) != tuple(want[k]))
    if missing or extra or bad:
        raise UserError(
            f"--init-from {path}: its tensors do not match the drafter it describes "
            f"(missing {missing[:3]}, unexpected {extra[:3]}, other shapes {bad[:3]})"
        )
    model.load_weights([(k, v.astype(mx.float32)) for k, v in got.items()], strict=False)
    for i in new_layers:
        layer = model.layers[i]
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)


def build_model(target, tokenizer, cfg: DistillConfig, out: Path) -> tuple[DSparkModel, dict, object]:
    init = resolve_arch(cfg, target)
    taps = ck.check_taps(cfg.taps, target.num_layers) if cfg.taps else ck.default_taps(target.num_layers, cfg.n_taps)
    cfg.taps = taps
    if cfg.block_size < 2:
        raise UserError(f"--block-size must be at least 2, got {cfg.block_size}")
    if cfg.layers < 1:
        raise UserError(f"--layers must be at least 1, got {cfg.layers}")
    if cfg.mask_token_id is None:
        cfg.mask_token_id = ck.pick_mask_token(tokenizer, target.vocab_size)
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise UserError(f"--mask-token-id {cfg.mask_token_id} is outside the vocabulary (0..{target.vocab_size - 1})")
    if cfg.markov_rank is None:
        cfg.markov_rank = 256 if target.hidden_size >= 2048 else 64
    hcfg = ck.drafter_config(
        target,
        kind=cfg.kind,
        layers=cfg.layers,
        block_size=cfg.block_size,
        taps=taps,
        mask_token_id=cfg.mask_token_id,
        markov_rank=cfg.markov_rank,
        intermediate_size=cfg.intermediate_size,
        num_anchors=cfg.anchors,
        layout=cfg.layout or "deepspec",
    )
    spec = ck.spec_from_config(hcfg, out)
    model = DSparkModel(spec)
    ck.init_weights(model, cfg.seed)
    if init is not None:
        load_init_weights(model, init, backbone_only=cfg.init_backbone_only)
    from ..models.drafters import target_dtype

    # Frozen copies in the target's compute dtype (bf16 on a GPU); trained weights in float32.
    emb, head = ck.target_matrices(target, target_dtype(target))
    model.embed_tokens.weight = emb
    model.lm_head.weight = head
    model.embed_tokens.freeze()
    model.lm_head.freeze()
    mx.eval(model.parameters())
    return model, hcfg, spec


class StopRequest:
    """SIGINT / SIGTERM during training: finish the step, save the resumable state, stop.
    A second signal stops at once (the state of the last checkpoint stays)."""

    def __init__(self):
        self.requested = False
        self._old: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            signal.signal(signum, self._old.get(signum, signal.SIG_DFL))
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False


# ------------------------------------------------------------------------------------ train
def target_inputs(
    target,
    tok: mx.array,
    lens: list[int],
    anc: np.ndarray,
    msk: np.ndarray,
    B: int,
    taps,
    vocab: TrainVocab | None = None,
):
    """One teacher-forced target forward: its tapped rows [S, T, C] and its logits at the block
    slots' predecessor positions anchor + j [S, A*B, V] (DeepSpec deepspec/modeling/dspark/common.py); with `vocab`,
    their subset columns [S, A*B, K] and log-normalisers [S, A*B] (no [S, A*B, V] gather).

    Padding rows and unsupervised slots are never attended to or counted, but their values
    still meet the masks as 0 * x; they are zeroed, so that a non-finite value there cannot turn
    the loss or its gradient into NaN."""
    S, A = anc.shape
    T = tok.shape[1]
    fwd = target.forward(tok, None, taps=taps)
    real = mx.array(np.arange(T)[None, :] < np.asarray(lens)[:, None])
    hid = mx.where(real[..., None], fwd.hidden, mx.zeros((), fwd.hidden.dtype))
    pos = mx.array(np.minimum(anc[:, :, None] + np.arange(B)[None, None, :], T - 1).reshape(S, A * B))
    ok = mx.array(msk.reshape(S, A * B) > 0)
    if vocab is None:
        tlog = mx.take_along_axis(fwd.logits, pos[..., None], axis=1)
        return hid, mx.where(ok[..., None], tlog, mx.zeros((), tlog.dtype))
    sub, lse = vocab.target_terms(fwd.logits)
    sub = mx.take_along_axis(sub, pos[..., None], axis=1)
    lse = mx.take_along_axis(lse, pos, axis=1)
    return hid, (mx.where(ok[..., None], sub, mx.zeros((), sub.dtype)), mx.where(ok, lse, mx.zeros((), lse.dtype)))


def train_vocab(samples: list[D.Sample], choice, vocab_size: int) -> TrainVocab | None:
    """The training vocabulary: the draft vocabulary `choice` would keep of these answers' tokens."""
    from ..models import draft_vocab as dv

    ids, counts = dv.ranking(s.ids[s.n_prompt :] for s in samples)
    keep = dv.prefix(ids, counts, choice, vocab_size)
    return None if keep is None else TrainVocab.of(keep, vocab_size)


def train(
    target,
    tokenizer,
    samples: list[D.Sample],
    cfg: DistillConfig,
    out: Path,
    *,
    resume: bool = False,
    meta: dict | None = None,
    on_step: Callable[[int], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Train and write the drafter into `out`. Returns a summary (steps, final metrics, timings)."""
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    out = Path(out)
    if not samples:
        raise UserError("no training samples (every answer was empty)")
    model, hcfg, spec = build_model(target, tokenizer, cfg, out)
    B = cfg.block_size
    # z-lab DFlash: slot 0 is the anchor only; draft slot k (block slot k + 1) predicts anchor + k + 1,
    # so the targets of its B - 1 drafts are DeepSpec's for a block of B - 1.
    first = spec.logits_start
    Dn = B - first
    embed = None
    if spec.packaging == "zlab-dflash":  # z-lab embeds with the target's own embedding (its scaling too)
        scale = float(spec.embed_scale or 1.0)
        embed = target.embed if scale == 1.0 else (lambda ids: target.embed(ids) * scale)
    weights = LossWeights.for_kind(cfg.kind, cfg.decay())
    softcap = spec.softcap
    vocab = train_vocab(samples, cfg.train_vocab, spec.vocab_size)
    if vocab is not None:
        say(
            f"distill: training on the {vocab.ids.size} answer tokens of the draft vocabulary "
            f"(--train-vocab {cfg.train_vocab}) of {spec.vocab_size}"
        )
    opt = optim.AdamW(learning_rate=cfg.lr, betas=[0.9, 0.999], eps=1e-8, weight_decay=cfg.weight_decay)
    batches = Batches(samples, cfg.batch_size, cfg.seed)
    rng = np.random.default_rng(cfg.seed + 17)
    step, total, elapsed_before = 0, cfg.steps, 0.0
    history: list[dict] = []
    if resume:
        st = ck.load_state(model, opt, out)
        if st.get("arch") != json.loads(json.dumps(cfg.arch())):
            raise UserError(
                f"--resume: {out} was trained with other settings ({st.get('arch')}); "
                "use the same flags, or another --out"
            )
        step, total = int(st["step"]), int(st["total"])
        batches.restore(st["batches"])
        rng.bit_generator.state = st["rng"]
        elapsed_before = float(st.get("elapsed", 0.0))
        history = st.get("history", [])
        say(f"distill: resuming at step {step}/{total}")
    taps = tuple(spec.taps)

    def loss_fn(m, taps_a, tok, anc, lab, prv, msk, tlog):
        S, A = anc.shape
        h = block_hidden(m, taps_a, tok, anc, B, spec.mask_token_id, embed=embed)[:, :, first:]
        tl = (
            tlog.reshape(S * A, Dn, -1)
            if vocab is None
            else (tlog[0].reshape(S * A, Dn, -1), tlog[1].reshape(S * A, Dn))
        )
        return block_loss(
            m,
            h.reshape(S * A, Dn, -1),
            prv.reshape(S * A, Dn),
            lab.reshape(S * A, Dn),
            msk.reshape(S * A, Dn),
            tl,
            weights,
            softcap,
            vocab,
        )

    value_grad = nn.value_and_grad(model, loss_fn)

    def state_dict() -> dict:
        return {
            "step": step,
            "total": total,
            "arch": cfg.arch(),
            "batches": batches.state(),
            "rng": rng.bit_generator.state,
            "elapsed": elapsed_before + (time.perf_counter() - t_start),
            "history": history,
        }

    def checkpoint() -> None:
        mx.eval(model.parameters(), opt.state)
        ck.save_state(model, opt, out, state_dict())
        ck.save_drafter(model, hcfg, out, meta=dict(meta or {}, steps=step, total_steps=total))

    t_start = time.perf_counter()
    prog = Progress(total)
    tokens_seen, start_step, skipped = 0, step, 0
    # The step count fitted to a time budget (train/budget.py); a resumed run keeps its schedule.
    fit = StepBudget(cfg.train_seconds, step, total, t_start) if cfg.train_seconds and not resume else None
    metrics: dict = {}
    with StopRequest() as stop:
        while step < total and not stop.requested:
            idx = batches.next()
            tok, anc, lab, prv, msk = make_batch(samples, idx, cfg.anchors, Dn, rng)
            tok_a = mx.array(tok)
            hid, tlog = target_inputs(target, tok_a, [len(samples[i].ids) for i in idx], anc, msk, Dn, taps, vocab)
            lr = lr_at(step, total, cfg.lr, cfg.warmup_ratio)
            opt.learning_rate = lr
            (loss, mets), grads = value_grad(
                model, hid, tok_a, mx.array(anc), mx.array(lab), mx.array(prv), mx.array(msk), tlog
            )
            if cfg.grad_clip and cfg.grad_clip > 0:
                grads, gnorm = optim.clip_grad_norm(grads, cfg.grad_clip)
            else:
                gnorm = mx.array(0.0)
            mx.eval(loss, gnorm)
            if not (math.isfinite(float(loss)) and math.isfinite(float(gnorm))):
                skipped += 1  # a non-finite batch: no update (the step still counts), logged for diagnosis
                if skipped <= 20:
                    history.append({"step": step + 1, "nonfinite_batch": [int(i) for i in idx]})
            else:
                opt.update(model, grads)
            mx.eval(model.parameters(), opt.state, mets)
            step += 1
            tokens_seen += int(msk.sum())
            if on_step is not None:
                on_step(step)
            if step % cfg.log_every == 0 or step == total or step == start_step + 1:
                metrics = {
                    "loss": float(loss),
                    "lr": lr,
                    "gnorm": float(gnorm),
                    "skipped": skipped,
                    **{k: (v.tolist() if v.ndim else float(v)) for k, v in mets.items()},
                }
                history.append(
                    {
                        "step": step,
                        **{
                            k: (
                                round(v, 5)
                                if isinstance(v, float)
                                else [round(x, 4) for x in v]
                                if isinstance(v, list)
                                else v
                            )
                            for k, v in metrics.items()
                        },
                    }
                )
            prog.update(step, metrics, tokens_seen, start_step, force=step == total)
            new_total = fit.after(step, time.perf_counter()) if fit is not None else None
            if new_total is not None and new_total != total:
                say(
                    f"\ndistill: {fit.ms_per_step:.0f} ms/step: {new_total} steps fit in --train-seconds "
                    f"{cfg.train_seconds:.0f}"
                )
                total = new_total
                prog.total = total
            if cfg.save_every and step % cfg.save_every == 0 and step < total:
                checkpoint()
        prog.close()
        checkpoint()  # still under StopRequest: a SIGTERM now (a job's time limit) waits for the drafter
    if stop.requested and step < total:
        raise UserError(
            f"stopped at step {step}/{total}; the state is saved in {out}: run the same "
            "command with --resume to continue"
        )
    wall = time.perf_counter() - t_start
    summary = {
        "steps": step,
        "train_s": round(wall + elapsed_before, 1),
        "tokens": tokens_seen,
        "final": metrics,
        "history_tail": history[-5:],
    }
    with open(out / "train_log.jsonl", "w") as f:
        for h in history:
            f.write(json.dumps(h) + "\n")
    return summary


__all__ = ["DistillConfig", "train", "build_model", "resolve_arch", "lr_at", "Progress", "make_batch", "Batches"]
