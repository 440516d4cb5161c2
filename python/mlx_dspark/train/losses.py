"""DSpark / DFlash training losses (DeepSpec `deepspec/modeling/dspark/loss.py`; DSpark paper Eq. 9-12).

For block slot j (0-based; slot j predicts the token at anchor + j + 1) with validity mask m_j
(label inside the answer, cumulative along j) and position weight w_j = exp(-j / gamma):

  z_j    draft logits: lm_head(h_j) (+ softcap), plus the Markov bias W2 . W1[prev_j] with
         teacher forcing, prev = [anchor, y_0, .., y_{B-2}]
  p_d    softmax(z_j), p_t = softmax(target logits at anchor + j)   (T = 1, float32)
  L_ce   = sum m w (-log p_d(y_j)) / W
  L_tv   = sum m w ||p_d - p_t||_1 / W                 (the full L1, = 2 TV)
  c*_j   = clamp(1 - ||p_d - p_t||_1 / 2, 0, 1), no gradient
  L_conf = sum m w BCEWithLogits(s_j, c*_j) / W,  s_j = proj([h_j ; W1[prev_j]]) + b
  L      = a_ce L_ce + a_tv L_tv + a_conf L_conf,   W = sum m w

DSpark: (a_ce, a_tv, a_conf) = (0.1, 0.9, 1.0); DeepSpec DFlash: (1, 0, 0).

With a training vocabulary (`distill --train-vocab`, the draft vocabulary of models/draft_vocab.py)
the drafter is trained as it drafts with that subset S: z and p_d live on S only (p_d = 0
outside), p_t is still the target's full softmax, so ||p_d - p_t||_1 = sum_S |p_d - p_t| +
(1 - sum_S p_t), and a label outside S adds no CE (it cannot be drafted). Every V-wide tensor of
the loss and its gradient becomes |S|-wide; only the target's log-normaliser reads all of V.

Metrics (logged, not differentiated): accept@j = the masked mean of c*_j, and
tau = 1 + sum_j prod_{i<=j} c*_i per block (the expected acceptance length, DeepSpec's
`tau_probabilistic`).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass
class LossWeights:
    ce: float = 0.1
    tv: float = 0.9
    conf: float = 1.0
    gamma: float = 4.0

    @classmethod
    def for_kind(cls, kind: str, gamma: float = 4.0) -> "LossWeights":
        return cls(0.1, 0.9, 1.0, gamma) if kind == "dspark" else cls(1.0, 0.0, 0.0, gamma)


def draft_logits(
    model, hidden: mx.array, prev: mx.array, softcap: float | None, vocab: mx.array | None = None
) -> mx.array:
    """Markov-corrected draft logits z [..., V] of slot states hidden [..., H] (teacher-forced prev);
    with `vocab` (sorted token ids [K]) over those tokens only, z [..., K]."""
    w = model.lm_head.weight  # frozen, in the target's dtype (bf16 on a GPU: the big matmul runs in bf16)
    x = hidden.astype(w.dtype)
    u = (model.lm_head(x) if vocab is None else x @ w[vocab].T).astype(mx.float32)
    if softcap:
        u = mx.tanh(u / softcap) * softcap
    markov = getattr(model, "markov_head", None)
    if markov is not None:
        if vocab is None:
            u = u + markov(prev).astype(u.dtype)
        else:
            u = u + (markov.markov_w1(prev) @ markov.markov_w2.weight[vocab].T).astype(u.dtype)
    return u


@dataclass
class TrainVocab:
    """The training vocabulary: sorted token ids [K] and, per token id, its index in them (-1 outside)."""

    ids: mx.array
    index: mx.array

    @classmethod
    def of(cls, ids, vocab_size: int) -> "TrainVocab":
        import numpy as np

        ids = np.asarray(sorted(int(t) for t in ids), dtype=np.int32)
        index = np.full(vocab_size, -1, dtype=np.int32)
        index[ids] = np.arange(len(ids), dtype=np.int32)
        return cls(mx.array(ids), mx.array(index))

    def target_terms(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """Target logits [..., V] -> (their subset columns [..., K], their log-normaliser [...])."""
        return logits[..., self.ids], mx.logsumexp(logits.astype(mx.float32), axis=-1)


def block_loss(
    model,
    hidden: mx.array,
    prev: mx.array,
    labels: mx.array,
    mask: mx.array,
    target_logits,
    w: LossWeights,
    softcap: float | None = None,
    vocab: TrainVocab | None = None,
):
    """(loss, metrics) for slot states hidden [N, B, H] with labels/prev [N, B], mask [N, B] (0/1,
    already cumulative), target logits [N, B, V] aligned to the slots; with `vocab`, the pair
    `vocab.target_terms(...)` of them instead ([N, B, K] and [N, B])."""
    B = hidden.shape[1]
    z = draft_logits(model, hidden, prev, softcap, None if vocab is None else vocab.ids).astype(mx.float32)
    logp = z - mx.logsumexp(z, axis=-1, keepdims=True)
    pos_w = mx.exp(-mx.arange(B, dtype=mx.float32) / w.gamma)
    weight = mask.astype(mx.float32) * pos_w
    W = mx.maximum(weight.sum(), 1e-6)
    if vocab is None:
        ce = -mx.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    else:  # a label outside the subset cannot be drafted: no CE term
        at = vocab.index[labels]
        ce = -mx.take_along_axis(logp, mx.maximum(at, 0)[..., None], axis=-1)[..., 0] * (at >= 0)
    loss = w.ce * (weight * ce).sum() / W
    metrics = {"ce": (weight * ce).sum() / W}
    need_tv = w.tv > 0 or w.conf > 0
    if need_tv:
        if vocab is None:
            p_t = mx.softmax(target_logits.astype(mx.float32), axis=-1)
            l1 = mx.abs(mx.exp(logp) - p_t).sum(axis=-1)  # [N, B]
        else:
            t_sub, t_lse = target_logits
            p_t = mx.exp(t_sub.astype(mx.float32) - t_lse[..., None])
            l1 = mx.abs(mx.exp(logp) - p_t).sum(axis=-1) + mx.maximum(1.0 - p_t.sum(axis=-1), 0.0)
        tv = (weight * l1).sum() / W
        metrics["tv"] = tv
        if w.tv > 0:
            loss = loss + w.tv * tv
        c_star = mx.stop_gradient(mx.clip(1.0 - 0.5 * l1, 0.0, 1.0))
        m = mask.astype(mx.float32)
        metrics["accept"] = (c_star * m).sum(axis=0) / mx.maximum(m.sum(axis=0), 1.0)  # [B]
        full = m.prod(axis=-1)  # blocks whose every slot is supervised
        tau = 1.0 + mx.cumprod(c_star, axis=-1).sum(axis=-1)
        metrics["tau"] = (tau * full).sum() / mx.maximum(full.sum(), 1.0)
        conf_head = getattr(model, "confidence_head", None)
        if conf_head is not None and w.conf > 0:
            feats = hidden
            if conf_head.proj.weight.shape[-1] != hidden.shape[-1]:  # confidence_head_with_markov
                feats = mx.concatenate([hidden, model.markov_head.markov_w1(prev).astype(hidden.dtype)], axis=-1)
            s = conf_head.proj(feats)[..., 0].astype(mx.float32)
            bce = nn.losses.binary_cross_entropy(s, c_star, with_logits=True, reduction="none")
            conf = (weight * bce).sum() / W
            metrics["conf"] = conf
            loss = loss + w.conf * conf
    # Greedy agreement with the labels (what greedy verification accepts when the label is the
    # target's argmax): a cheap proxy, logged only.
    top = mx.argmax(z, axis=-1)
    hit = ((top if vocab is None else vocab.ids[top]) == labels).astype(mx.float32) * mask.astype(mx.float32)
    metrics["top1"] = hit.sum() / mx.maximum(mask.astype(mx.float32).sum(), 1.0)
    return loss, metrics


def anchor_targets(tokens, n_prompt: int, length: int, anchors, B: int):
    """numpy helper: (labels [A, B], prev [A, B], mask [A, B]) of one sequence's anchors.

    labels_j = x[p + 1 + j]; prev_j = x[p + j] (the anchor for j = 0); mask_j = label inside the
    sequence and inside the answer, cumulative along j."""
    import numpy as np

    A = len(anchors)
    pos = np.asarray(anchors)[:, None] + np.arange(B)[None, :]  # predecessor positions p + j
    lab_pos = pos + 1
    valid = (lab_pos < length) & (lab_pos >= n_prompt)
    valid = np.cumprod(valid, axis=1).astype(np.float32)
    toks = np.asarray(tokens)
    labels = toks[np.minimum(lab_pos, length - 1)]
    prev = toks[np.minimum(pos, length - 1)]
    return labels.reshape(A, B), prev.reshape(A, B), valid


__all__ = ["LossWeights", "TrainVocab", "block_loss", "draft_logits", "anchor_targets"]
