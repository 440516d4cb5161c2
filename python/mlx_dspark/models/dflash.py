"""DFlash drafters, and the block-drafter base that DSpark extends.

A block drafter turns (anchor, new context rows, context cache) into a block of draft
distributions in one backbone pass:

  ids    = [anchor, mask x (B-1)] at positions start .. start+B-1   (start = anchor position)
  hidden = backbone(embed(ids), ctx rows of positions cache.offset .. start-1)
  drafts = logits of slots logits_start .. B-1

Two DFlash packagings (DeepSpec's config/dflash/*, and z-lab's, arXiv 2602.06036):
  DeepSpec  `DSparkDrafter` with both heads off (models/dspark.py): own embed / lm_head copies,
            every slot is a draft (slot j predicts anchor + j + 1), block 7.
  z-lab     `ZLabDFlashDrafter` (here): no embed / lm_head in the checkpoint, the target's are
            bound (its embedding scale included, x input_embedding_scale; the raw output head,
            x output_multiplier, then the drafter's own softcap if its config has one); slot 0
            is the anchor only, slots 1..B-1 are the B-1 drafts; block 16 for the -b16 heads.

Without a Markov head the draft slots are independent: slot j's token is chosen from its own
logits alone.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from .checkpoints import DrafterSpec
from .drafter_backbone import Backbone, ContextKV

# choose(logits_row [V], drafted_so_far) -> (token: mx int32 scalar, q_row [V] or None)
Chooser = Callable[[mx.array, list], tuple[mx.array, "mx.array | None"]]


class BlockDrafter:
    """What the DSpark / DFlash proposers (decode/drafting.py) drive."""

    kind = "dflash"
    markov = None
    conf_head = None
    vocab_ids: mx.array | None = None  # the draft vocabulary (sorted token ids), None: the full one
    _compiled_draft = None  # models/compiled_draft.py, made at the first compiled pass

    def __init__(self, model: Backbone, spec: DrafterSpec, *, bits: int = 16):
        self.model = model
        self.spec = spec
        self.bits = bits
        self.source = spec.source
        self.packaging = spec.packaging
        self.taps = tuple(spec.taps)
        self.block_size = spec.block_size
        self.block_drafts = spec.block_drafts
        self.mask_token_id = spec.mask_token_id

    def product_weights(self) -> list[mx.array]:
        """The float weights a drafter pass multiplies: the backbone's linear layers and the head's
        (the draft vocabulary's gathered rows where it has one). kernels/native_products.py packs
        them at load on the CPU."""
        mods = [m for top in (self.model.fc, *self.model.layers) for _, m in top.named_modules()]
        out = [m["weight"] for m in mods if type(m) is nn.Linear]
        proj = getattr(self, "_head", None)
        head = getattr(proj, "dense_weight", None)  # draft_vocab.row_subset's gathered rows
        if head is None:
            mod = getattr(proj, "__self__", proj)  # an Embedding's as_linear: the embedding
            head = mod.get("weight") if isinstance(mod, (nn.Linear, nn.Embedding)) and "scales" not in mod else None
        return out + ([head] if head is not None else [])

    # ------------------------------------------------------------------ protocol
    def new_state(self) -> list[ContextKV]:
        return self.model.make_context_cache()

    def ingest(self, rows: mx.array, state: list[ContextKV]) -> None:
        self.model.ingest(rows, state)

    # embed() and logits() differ per packaging: DSparkDrafter (own copies, or the target's) and
    # ZLabDFlashDrafter (always the target's) define them.
    def embed(self, ids: mx.array) -> mx.array:
        """Input embeddings of block ids [n] -> [n, H], family scaling included."""
        raise NotImplementedError

    def logits(self, hidden: mx.array) -> mx.array:
        """Base draft logits U [n, V] of final-normed slot hidden states [n, H]."""
        raise NotImplementedError

    def restrict_vocab(self, ids) -> None:
        """Draft only from these token ids (models/draft_vocab.py): logits() then returns [n, N]
        over the subset, and sample() chooses through choose_in_vocab()."""
        from .draft_vocab import row_subset

        self.vocab_ids = mx.array(sorted({int(t) for t in ids}), dtype=mx.int32)
        self._head = row_subset(self._head, self.vocab_ids)
        self._compiled_draft = None  # its graphs hold the old head

    def choose_in_vocab(self, z: mx.array, choose: Chooser, drafted: list):
        """choose() on a logits row over the draft vocabulary. A plain argmax (choose.argmax) is
        taken within the subset and mapped to its token id; any other chooser gets the row over the
        whole vocabulary, -inf outside the subset (so q is 0 there)."""
        if self.vocab_ids is None:
            return choose(z, drafted)
        if getattr(choose, "argmax", False):
            return self.vocab_ids[mx.argmax(z, axis=-1)], None
        from .draft_vocab import expand

        return choose(expand(z, self.vocab_ids, self.spec.vocab_size), drafted)

    def block_hidden(self, anchor: int, rows: mx.array | None, state: list[ContextKV]) -> mx.array:
        """Final-normed hidden states of the draft slots [block_drafts, H] (one backbone pass)."""
        ids = mx.array([int(anchor)] + [self.mask_token_id] * (self.block_size - 1), dtype=mx.int32)
        h = self.model.run_block(self.embed(ids)[None], rows, state)[0]
        return h[self.spec.logits_start :]

    def block_hidden_rows(self, anchors: list, rows: list, states: list) -> mx.array:
        """block_hidden for several generations in one backbone pass -> [B, block_drafts, H]."""
        ids = mx.array([[int(a)] + [self.mask_token_id] * (self.block_size - 1) for a in anchors], dtype=mx.int32)
        emb = self.embed(ids.reshape(-1)).reshape(len(anchors), self.block_size, -1)
        return self.model.run_block_rows(emb, rows, states)[:, self.spec.logits_start :]

    def greedy_block(self, anchor: int, rows: mx.array | None, state: list[ContextKV], with_conf: bool = False):
        """(tokens [block_drafts], confidences or None), lazy: one compiled greedy pass after
        ingesting `rows` (models/compiled_draft.py), or None where passes are not compiled here
        or not yet in this process (the caller runs block_hidden and sample)."""
        from . import compiled_draft

        compiled = compiled_draft.for_drafter(self)
        return None if compiled is None or not compiled.earned() else compiled(anchor, rows, state, with_conf)

    def greedy_block_rows(self, anchors: list, rows: list, states: list, with_conf: bool = False):
        """greedy_block for several generations in one compiled pass: a list of (tokens,
        confidences or None), lazy; None where passes are not compiled here."""
        from . import compiled_draft

        compiled = compiled_draft.for_drafter(self)
        return None if compiled is None else compiled.rows(anchors, rows, states, with_conf)

    def sample(self, hidden: mx.array, anchor: int, choose: Chooser, with_conf: bool = False):
        """Draft tokens from slot states hidden [k, H]: (tokens [k] lazy, q rows or None, confidences or None).

        Without a Markov head the slots are independent."""
        U = self.logits(hidden)
        toks, qs = [], []
        for j in range(U.shape[0]):
            t, q = self.choose_in_vocab(U[j], choose, toks)
            toks.append(t)
            qs.append(q)
        return toks, qs, None

    def greedy_rows(self, hidden: mx.array, anchors: mx.array, with_conf: bool = False):
        """The greedy drafts of B rows at once (a compiled drafter pass of several generations):
        hidden [B, k, H] final-normed slot states, anchors [B] int32 -> (tokens [B, k] int32,
        confidences [B, k] or None). Row b drafts what sample() drafts for it alone, with every op
        over all rows (one launch, not one a row); drafts need no exactness, only determinism."""
        from .draft_vocab import greedy_choice

        return self.choose_in_vocab(self.logits(hidden), greedy_choice, [])[0], None

    def describe(self) -> dict:
        b = self.spec.backbone
        return {
            "kind": self.kind,
            "packaging": self.packaging,
            "style": self.spec.style,
            "source": self.source,
            "block_size": self.block_size,
            "drafts_per_round": self.block_drafts,
            "taps": list(self.taps),
            "layers": b.num_layers,
            "hidden_size": b.hidden_size,
            "bits": self.bits,
            "markov_rank": self.spec.markov_rank,
            "confidence_head": self.spec.confidence,
            "draft_vocab": int(self.vocab_ids.size) if self.vocab_ids is not None else self.spec.vocab_size,
        }


class ZLabDFlashModel(Backbone):
    """z-lab's DFlashDraftModel tensors: fc, hidden_norm, layers.N.*, norm (Qwen3-style layers)."""


def _raw_head(target) -> Callable[[mx.array], mx.array]:
    """The target's output projection without its softcap (z-lab applies `target.lm_head`)."""
    m = target.model
    tied = getattr(getattr(m, "args", None), "tie_word_embeddings", False)
    if getattr(m, "lm_head", None) is not None and not tied:
        return m.lm_head
    lm = getattr(m, "language_model", None)
    if lm is not None and getattr(lm, "lm_head", None) is not None:
        return lm.lm_head
    return target.embed_tokens.as_linear


class ZLabDFlashDrafter(BlockDrafter):
    kind = "dflash"

    def __init__(self, model: ZLabDFlashModel, spec: DrafterSpec, target, *, bits: int = 16):
        super().__init__(model, spec, bits=bits)
        self._target_embed = target.embed  # family scaling included (Gemma: x sqrt(H))
        self._head = _raw_head(target)
        self._in_scale = float(spec.embed_scale or 1.0)
        self._out_mult = float(spec.output_multiplier) if spec.output_multiplier else None
        self._softcap = float(spec.softcap) if spec.softcap else None
        self._dtype = model.norm.weight.dtype

    def embed(self, ids: mx.array) -> mx.array:
        e = self._target_embed(ids)
        if self._in_scale != 1.0:
            e = e * self._in_scale
        return e.astype(self._dtype)

    def logits(self, hidden: mx.array) -> mx.array:
        u = self._head(hidden)
        if self._out_mult is not None:
            u = u * self._out_mult
        if self._softcap:
            u = mx.tanh(u / self._softcap) * self._softcap
        return u


__all__ = ["BlockDrafter", "ZLabDFlashDrafter", "ZLabDFlashModel", "Chooser"]
