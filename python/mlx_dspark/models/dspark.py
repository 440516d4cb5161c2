"""DSpark (DeepSpec): the parallel backbone + a rank-r Markov head + a confidence head
(deepspec/modeling/dspark/qwen3/modeling.py and markov_head.py; DSpark paper Eq. 4-8).
DeepSpec's DFlash packaging is this class with both heads off.

Per round, for the k draft slots (slot j predicts the token at anchor position + j + 1):

  U_j = lm_head(hidden_j)                      (Gemma: 30*tanh(U/30), BEFORE the Markov bias)
  prev = anchor
  for j in 0..k-1:                             sequential: slot j sees the token drafted at j-1
      z_j = U_j + W2 . W1[prev]                (the Markov-corrected logits define q_j)
      x_j = choose(z_j); prev = x_j
  s_j = proj([hidden_j ; W1[prev_j]]) + b      (prev_j = anchor for j = 0, else x_{j-1})

Adaptive truncation: with `--confidence-threshold` tau > 0 (decode/drafting.py's
confident_prefix, as DeepSpec's evaluator `_confident_prefix_length`) the proposal is cut at the
FIRST j with sigmoid(s_j) < tau (a per-position test, not a cumulative product); 0 means a plain
step. Under the cost model (decode/policy.py, CostPolicy.cut) the confidences are weighed against
the verify's cost per width instead. Either only ever shortens the draft, before the slot it
drops is verified, so neither can change the output.

The greedy path never syncs inside the block: each step's argmax stays a lazy array that the
next step's W1 gather consumes, and the whole block is evaluated once.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .checkpoints import DrafterSpec
from .dflash import BlockDrafter, Chooser
from .draft_vocab import greedy_choice, row_subset
from .drafter_backbone import Backbone


class MarkovHead(nn.Module):
    """Vanilla low-rank transition bias B(prev, .) = W2 . W1[prev]."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)  # W1 [V, r]
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)  # W2 [V, r]

    def __call__(self, prev: mx.array) -> mx.array:
        if prev.ndim == 0:  # a quantized embedding gathers rows of a 1-D index only
            return self.markov_w2(self.markov_w1(prev.reshape(1)))[0]
        return self.markov_w2(self.markov_w1(prev))


class ConfidenceHead(nn.Module):
    """AcceptRatePredictor: one logit per slot from [hidden ; W1[prev]] (or hidden alone)."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, 1, bias=True)


class DSparkModel(Backbone):
    """The module tree of a DeepSpec checkpoint, named 1:1 (top level, no `model.` prefix)."""

    def __init__(self, spec: DrafterSpec):
        super().__init__(spec.backbone)
        H, V, r = spec.backbone.hidden_size, spec.vocab_size, spec.markov_rank
        if not spec.config.get("embeddings_from_target"):  # else bound to the target's at load
            self.embed_tokens = nn.Embedding(V, H)
            self.lm_head = nn.Linear(H, V, bias=False)
        if r > 0:
            self.markov_head = MarkovHead(V, r)
        if spec.confidence:
            self.confidence_head = ConfidenceHead(H + (r if spec.confidence_with_markov else 0))


class DSparkDrafter(BlockDrafter):
    def __init__(self, model: DSparkModel, spec: DrafterSpec, *, bits: int = 16):
        super().__init__(model, spec, bits=bits)
        self.kind = spec.kind  # "dspark", or "dflash" for DeepSpec's DFlash packaging
        self.markov = getattr(model, "markov_head", None)
        self.conf_head = getattr(model, "confidence_head", None)
        self._embed = getattr(model, "embed_tokens", None)  # may be rebound to the target's identical matrix
        self._head = getattr(model, "lm_head", None)
        self._dtype = model.norm.weight.dtype
        self._scale = float(spec.embed_scale)
        self._softcap = float(spec.softcap) if spec.softcap else None

    def bind(self, embed=None, head=None) -> None:
        """Use the target's own matrices instead of identical copies (saves memory)."""
        if embed is not None:
            self._embed = embed
        if head is not None:
            self._head = head
        self._compiled_draft = None  # its graphs hold the old matrices

    def embed(self, ids: mx.array) -> mx.array:
        e = self._embed(ids)
        if self._scale != 1.0:  # Gemma: x bf16(sqrt(H)), not stored in the checkpoint
            e = e * mx.array(self._scale, dtype=e.dtype)
        return e.astype(self._dtype)

    def logits(self, hidden: mx.array) -> mx.array:
        u = self._head(hidden)
        if self._softcap:  # Gemma: final_logit_softcapping, before the Markov bias
            u = mx.tanh(u / self._softcap) * self._softcap
        return u

    def refresh(self) -> None:
        """Re-read the own embed / lm_head modules (after nn.quantize replaced them); bound ones stay."""
        if "embed_tokens" in self.model:
            self._embed = self.model.embed_tokens
        if "lm_head" in self.model:
            self._head = self.model.lm_head
        self._compiled_draft = None

    def restrict_vocab(self, ids) -> None:
        super().restrict_vocab(ids)
        if self.markov is not None:
            self._w2 = row_subset(self.markov.markov_w2, self.vocab_ids)

    def markov_bias(self, prev: mx.array) -> mx.array:
        """The transition bias after token `prev` (a scalar: [V']; one per row, [B]: [B, V'])."""
        if self.vocab_ids is None:
            return self.markov(prev)
        bias = self._w2(self.markov.markov_w1(prev.reshape(-1)))
        return bias[0] if prev.ndim == 0 else bias

    def _native_chain(self, U: mx.array, prev: mx.array) -> mx.array | None:
        """kernels/draft_ops.markov_greedy over the slots' logits U, or None (MLX's ops run)."""
        w1 = self.markov.markov_w1
        if "scales" in w1:
            return None
        if self.vocab_ids is None:
            w2 = self.markov.markov_w2
            w2 = None if "scales" in w2 else w2.weight
        else:
            w2 = getattr(self._w2, "dense_weight", None)  # row_subset's gathered rows (None: quantized)
        if w2 is None:
            return None
        from ..kernels import draft_ops

        return draft_ops.markov_greedy(U, w1.weight, w2, self.vocab_ids, prev)

    def confidence_logits(self, hidden: mx.array, prevs: mx.array) -> mx.array:
        """s [k] for slot states hidden [k, H] and their previous tokens prevs [k]."""
        feats = hidden
        if self.spec.confidence_with_markov:
            feats = mx.concatenate([hidden, self.markov.markov_w1(prevs).astype(hidden.dtype)], axis=-1)
        return self.conf_head.proj(feats)[:, 0]

    def greedy_rows(self, hidden: mx.array, anchors: mx.array, with_conf: bool = False):
        B, k, H = hidden.shape
        conf = None
        if self.markov is None:
            toks, _ = super().greedy_rows(hidden, anchors)
            if self.conf_head is not None and with_conf:
                conf = self.confidence_logits(hidden.reshape(B * k, H), None).reshape(B, k)
            return toks, conf
        U = self.logits(hidden)  # [B, k, V'] over every row's slots at once
        prev = anchors.astype(mx.int32)
        toks, prevs = [], []
        for j in range(k):  # the chain: slot j of every row after slot j - 1 of every row
            t, _ = self.choose_in_vocab(U[:, j] + self.markov_bias(prev).astype(U.dtype), greedy_choice, toks)
            prevs.append(prev)
            toks.append(t)
            prev = t
        if self.conf_head is not None and with_conf:
            conf = self.confidence_logits(hidden.reshape(B * k, H), mx.stack(prevs, axis=1).reshape(-1)).reshape(B, k)
        return mx.stack(toks, axis=1), conf

    def sample(self, hidden: mx.array, anchor: int, choose: Chooser, with_conf: bool = False):
        if self.markov is None:
            toks, qs, _ = super().sample(hidden, anchor, choose)
            conf = None
            if self.conf_head is not None and with_conf:
                conf = self.confidence_logits(hidden, None)  # no Markov head: hidden features only
            return toks, qs, conf
        U = self.logits(hidden)
        prev = anchor if isinstance(anchor, mx.array) else mx.array(int(anchor), dtype=mx.int32)
        chain = self._native_chain(U, prev) if getattr(choose, "argmax", False) else None
        if chain is not None:  # the greedy chain as one native op (a drafter pass on the CPU)
            conf = None
            if self.conf_head is not None and with_conf:
                prevs = mx.concatenate([prev.reshape(1).astype(mx.int32), chain[:-1]])
                conf = self.confidence_logits(hidden, prevs)
            return [chain[j] for j in range(chain.shape[0])], [None] * chain.shape[0], conf
        toks, qs, prevs = [], [], []
        for j in range(U.shape[0]):
            z = U[j] + self.markov_bias(prev).astype(U.dtype)
            t, q = self.choose_in_vocab(z, choose, toks)
            prevs.append(prev)
            toks.append(t)
            qs.append(q)
            prev = t
        conf = None
        if self.conf_head is not None and with_conf and toks:
            conf = self.confidence_logits(hidden, mx.stack(prevs).astype(mx.int32))
        return toks, qs, conf


__all__ = ["DSparkDrafter", "DSparkModel", "MarkovHead", "ConfidenceHead"]
