"""The Target: an mlx-lm text model behind one protocol.

The verify loop and the drafters never touch a model family directly. They ask a Target to
  * run a width-w forward over a KV cache and return logits plus the hidden states of the
    requested layers (the drafter taps: the raw output of decoder layer `i`, 0-based);
  * roll that cache back to any accept point (`trim`);
  * embed tokens and apply the output head (drafters that bind the target's matrices).

Taps are recorded by giving each decoder-layer instance a subclass whose __call__ stores its
output when a recording is active (compat.tap_decoder_layers). The parameter tree is untouched
(no wrapper modules), so quantization, saving and mlx-lm's own forward keep working on it.

`probe()` runs once at load: it checks that the tapped forward reproduces the model's own
forward, that the fast last-row head matches, and that trim + re-forward reproduces the
logits (rollback is exact). A target that fails still decodes plainly (baseline); the
speculative modes are refused with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..compat import tap_decoder_layers
from ..errors import UserError, option
from ..kernels import checked_qmm
from . import invariance, sliding


@dataclass
class ForwardOut:
    logits: mx.array  # [B, w, V] (or [B, 1, V] with last_only)
    hidden: mx.array | None  # [B, w, len(taps) * H], concatenated in `taps` order


class _TapRecorder:
    """Shared state of the tapped layers of one model."""

    def __init__(self):
        self.active: set[int] = set()
        self.outputs: dict[int, mx.array] = {}


def _text_config(config: dict) -> dict:
    return config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config


class Target:
    """An mlx-lm model plus tokenizer, with tapped forward and rollback."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        config: dict,
        *,
        name: str = "",
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        source: str = "",
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.name = name
        self.source = source  # where the weights came from (path, repo id, gguf file)
        self.kv_bits = kv_bits
        self.kv_group_size = kv_group_size
        tc = _text_config(config)
        self.model_type = tc.get("model_type", config.get("model_type", "unknown"))
        self.layers = list(model.layers)
        self.num_layers = len(self.layers)
        self.hidden_size = int(tc.get("hidden_size", 0))
        self.vocab_size = int(tc.get("vocab_size", 0))
        self.max_context = int(tc.get("max_position_embeddings") or 0) or None
        if kv_bits:
            head_dim = int(tc.get("head_dim") or self.hidden_size // max(int(tc.get("num_attention_heads", 1)), 1))
            fits = [g for g in (kv_group_size, 64, 32) if head_dim % g == 0]
            if not fits:
                raise UserError(
                    f"{option('kv-bits')} needs a head dimension divisible by 32; this model's is {head_dim}"
                )
            self.kv_group_size = fits[0]
        self._recorder = tap_decoder_layers(self.layers, _TapRecorder())
        # Multimodal wrappers (gemma3, gemma4) hold the text model as `language_model`.
        self._lm = getattr(model, "language_model", None) or model
        self._inner = getattr(self._lm, "model", None)
        self._fast_head = False  # set by probe() once last-row heads are proven equal
        self.rollback_refusal: str | None = None  # set by probe(): why speculative modes cannot run
        self.tap_refusal: str | None = None  # set by probe(): why drafters' taps cannot be read
        # Width invariance (models/invariance.py), chosen by probe() by measurement: decode forwards
        # at their real width through the invariant kernels, or every one at width W = decode_width
        # (0: not) with the invariant attention; neither: the native forward.
        self.invariant_kernels = False
        # Prompts prefill through the invariant kernels too, where the load timed them faster than
        # MLX's matmuls (MLX's reference BLAS); every mode shares the prefill, so all stay equal.
        self.kernel_prefill = False
        self.compiled_decode = None  # models/compiled_decode.py: set with the kernel path where it traces
        self.decode_width = 0
        self.invariance = "unchecked"
        self.dense_products: list[str] = []  # set by probe(): MLX products this target routes around

    # ------------------------------------------------------------------ cache
    def make_cache(self) -> list:
        from mlx_lm.models.cache import KVCache, make_prompt_cache

        cache = make_prompt_cache(self.model)
        if self.kv_bits:
            cache = [c.to_quantized(self.kv_group_size, self.kv_bits) if isinstance(c, KVCache) else c for c in cache]
        return self._rollback_caches(cache)

    def _rollback_caches(self, cache: list) -> list:
        """Swap in caches that roll back exactly: recording + replay for recurrent (GDN) layers
        (models/hybrid.py), rewind for sliding windows (models/sliding.py). Proven bitwise on this
        model once; where the proof fails, mlx-lm's own caches stay and `rollback_kind` says why."""
        from . import hybrid, sliding

        def convert(c):
            return sliding.convert_cache(hybrid.convert_cache(c))

        if getattr(self, "_rollback_checked", None) is None:
            kinds = [
                name
                for name, present in (
                    ("replay", hybrid.is_hybrid(self.layers)),
                    ("rewind", sliding.has_rotating(cache)),
                )
                if present
            ]
            why = hybrid.install_recording(self.layers) if "replay" in kinds else None
            if kinds and why is None:
                from mlx_lm.models.cache import make_prompt_cache

                if getattr(self, "_choosing_path", False):
                    # probe() is still choosing the decode path: the proof runs on the chosen one
                    return convert(cache)
                why = hybrid.prove_replay(
                    self.model, lambda: convert(make_prompt_cache(self.model)), self.vocab_size, self._proof_forward
                )
            self._rollback_kind = ("+".join(kinds) or "trim") if why is None else f"none ({why})"
            self._rollback_checked = why is None
        return convert(cache) if self._rollback_checked else cache

    def _proof_forward(self, ids: mx.array, cache: list, prefill: bool = False) -> mx.array:
        """The forward rollback is proven on: the decode path this target runs (kernels, fixed
        width or native), so that a verify round's rows are compared as they are computed."""
        return self.forward(ids, cache, last_only=prefill).logits

    @property
    def rollback_kind(self) -> str:
        """How verify rounds roll back on this target: trim (dense KV), replay (recurrent layers),
        rewind (sliding windows), joined by '+'; or 'none (why)'."""
        if getattr(self, "_rollback_checked", None) is None:
            self.make_cache()
        return self._rollback_kind

    @staticmethod
    def snapshot(cache: list) -> list | None:
        """The cache's state as fresh, evaluated arrays (None for a layer kind it cannot copy):
        what a checkpoint-mode prefix cache keeps at a prompt boundary (models/snapshot.py)."""
        from . import snapshot

        return snapshot.snapshot(cache)

    @staticmethod
    def restore(snap: list) -> list:
        """A fresh cache holding a snapshot's state; it continues bitwise as the original would."""
        from . import snapshot

        return snapshot.restore(snap)

    @staticmethod
    def cache_len(cache: list) -> int:
        for c in cache:
            if hasattr(c, "offset"):
                return int(c.offset)
        return 0

    @staticmethod
    def can_trim(cache: list, n: int) -> bool:
        """Whether `trim(cache, n)` can drop n positions of the forward that fed them (asked
        before a verify round: dense KV trims, recurrent layers replay, sliding windows rewind)."""
        if n == 0:
            return True
        return all(c.is_trimmable() for c in cache)

    @staticmethod
    def trim(cache: list, n: int) -> None:
        """Drop the last `n` positions of the last forward from every layer's cache. Call it after
        every verify forward, n = 0 included: a sliding-window cache then commits the round in
        the layout plain decoding holds, a recurrent one lets go of the round's record."""
        for c in cache:
            rewind = getattr(c, "rewind", None)
            if rewind is not None:
                rewind(max(n, 0))
                continue
            if n <= 0:
                continue
            trimmed = c.trim(n)
            if trimmed != n:
                raise RuntimeError(f"cache {type(c).__name__} trimmed {trimmed} of {n} positions")

    # ---------------------------------------------------------------- forward
    def forward(self, tokens: mx.array, cache: list, taps: Sequence[int] = (), last_only: bool = False) -> ForwardOut:
        """Run tokens [B, w] through the model, appending to `cache`.

        With `last_only`, logits are computed for the last position only (prefill). A verify-shaped
        call (width > 1 on a cache, not `last_only`) on a target whose rollback failed the probe,
        or a tapped call on one whose taps failed it, raises the probe's UserError."""
        if tokens.ndim == 1:
            tokens = tokens[None]
        if (self.rollback_refusal and cache is not None and not last_only and tokens.shape[1] > 1) or (
            taps and self.tap_refusal
        ):
            self.check_speculation(taps)  # a verify round (or a tapped forward) on a target that failed the probe
        w = tokens.shape[1]
        sliding.mark_verify(cache, w > 1 and not last_only)  # sliding windows: verify in plain ring order
        decode = cache is not None and (not last_only or w == 1)
        if decode and self.invariant_kernels:
            return ForwardOut(*invariance.forward_kernels(self, tokens, cache, taps))
        if decode and self.decode_width and invariance.fixed_width_ok(cache):
            logits, hidden = invariance.forward_fixed(self, tokens, cache, taps, self.decode_width)
            return ForwardOut(logits, hidden)
        if cache is not None and self.kernel_prefill and self.invariant_kernels:
            from ..kernels import invariant

            with invariant.active():
                return self._forward_native(tokens, cache, taps, last_only)
        return self._forward_native(tokens, cache, taps, last_only)

    def _forward_native(self, tokens: mx.array, cache: list, taps: Sequence[int], last_only: bool) -> ForwardOut:
        """The model's own forward at the width it is given (taps recorded)."""
        rec = self._recorder
        rec.active = set(taps)
        rec.outputs = {}
        try:
            if last_only and self._fast_head and tokens.shape[1] > 1:
                h = self._inner(tokens, cache=cache)
                logits = self.head(h[:, -1:, :])
            else:
                logits = self.model(tokens, cache=cache)
                if last_only:
                    logits = logits[:, -1:, :]
            hidden = None
            if taps:
                hidden = mx.concatenate([rec.outputs[i] for i in taps], axis=-1)
        finally:
            rec.active = set()
            rec.outputs = {}
        return ForwardOut(logits, hidden)

    # ------------------------------------------------- embedding and head
    @property
    def embed_tokens(self) -> nn.Module:
        return self._inner.embed_tokens

    def embed(self, tokens: mx.array) -> mx.array:
        """Input embeddings as the model's own forward computes them (family scaling included)."""
        h = self._inner.embed_tokens(tokens)
        if self.model_type.startswith("gemma"):
            scale = getattr(self._inner, "embed_scale", None)  # gemma4 (mlx-lm, mlx-vlm): sqrt(hidden) as is
            if scale is not None:
                return h * scale
            h = h * mx.array(self.hidden_size**0.5, dtype=mx.bfloat16).astype(h.dtype)  # gemma3: rounded to bf16
        return h

    def head(self, h: mx.array) -> mx.array:
        """Logits from final-normed hidden states (softcap included where the family has one)."""
        m = self._lm
        if getattr(m, "lm_head", None) is not None and not getattr(
            getattr(m, "args", None), "tie_word_embeddings", False
        ):
            out = m.lm_head(h)
        else:
            out = self._inner.embed_tokens.as_linear(h)
        cap = _text_config(self.config).get("final_logit_softcapping")
        if cap:
            out = mx.tanh(out / cap) * cap
        return out

    # ------------------------------------------------------------------ probe
    def probe(self, taps: Sequence[int] = ()) -> None:
        """Check that the tapped forward, the fast head and rollback reproduce the model's own forward.

        Never blocks plain decoding: a failed check is recorded (`rollback_refusal`,
        `tap_refusal`) and refused only where it matters, by `forward()` (a verify-shaped call on
        a cache, or a tapped one). Width-dependent rounding of a bf16 or quantized forward on a GPU
        is not a defect: rollback is checked by replaying the same widths over the same cache
        (which must reproduce the logits to a few units of the dtype's precision), and the
        cross-width comparison refuses only a difference past `width_tolerance` that also
        changes an argmax. Raises UserError only for tap layers out of range."""
        probe_taps = tuple(sorted(set(taps) | {0, self.num_layers - 1}))
        for t in probe_taps:
            if not 0 <= t < self.num_layers:
                raise UserError(
                    f"tap layer {t} is out of range: the target has {self.num_layers} layers (0..{self.num_layers - 1})"
                )
        self.rollback_refusal = self.tap_refusal = None
        # MLX quantized products that are wrong or not reproducible here go dense (checked_qmm.py).
        self.dense_products = checked_qmm.check_model(self.model)
        self._choosing_path, self._rollback_checked = True, None
        try:
            self.invariance = invariance.choose(self)
        finally:
            self._choosing_path = False
        vocab = max(self.vocab_size, 2)
        ids = mx.array([[(17 * i + 3) % vocab for i in range(8)]], dtype=mx.int32)

        ref = self.model(ids, cache=self.make_cache())
        out = self.forward(ids, self.make_cache(), taps=probe_taps)
        mx.eval(ref, out.logits, out.hidden)
        tight, loose = replay_tolerance(ref), width_tolerance(ref)
        H = self.hidden_size
        if not logits_agree(ref, out.logits, loose):
            self.tap_refusal = (
                f"{self.model_type}: the tapped forward does not reproduce the model's own logits; "
                "this family needs bespoke support for drafters (use --mode baseline or lookup)"
            )
        elif out.hidden is None or out.hidden.shape != (1, 8, len(probe_taps) * H):
            got = None if out.hidden is None else tuple(out.hidden.shape)
            self.tap_refusal = (
                f"{self.model_type}: tapped hidden states have shape {got}, expected "
                f"(1, 8, {len(probe_taps) * H}); this family's decoder layers cannot be tapped "
                "(use --mode baseline or lookup)"
            )
        # Fast last-row head: prefill computes only the last row of logits when this matches.
        if self._inner is not None and hasattr(self._inner, "embed_tokens"):
            try:
                h = self._inner(ids, cache=self.make_cache())
                self._fast_head = logits_agree(self.head(h[:, -1:, :]), ref[:, -1:, :], loose)
            except Exception:  # a family whose inner model takes other arguments
                self._fast_head = False
        self.rollback_refusal = self._probe_rollback(ids, ref, tight, loose)

    def _probe_rollback(self, ids: mx.array, ref: mx.array, tight: float, loose: float) -> str | None:
        """None when trimming the cache is exact, else the refusal for the speculative modes."""
        cache = self.make_cache()
        if not self.can_trim(cache, 3):
            return None  # the loop never drafts on a cache it cannot trim
        why = (
            f"{self.model_type}: rolling the KV cache back does not reproduce the logits; "
            "speculative modes cannot run on this target (use --mode baseline)"
        )
        self.forward(ids[:, :5], cache)
        first = self.forward(ids[:, 5:], cache).logits  # positions 5..7 at width 3
        mx.eval(first)
        # Full replay: trim the 3 positions, feed the same 3 again (same widths, same cache).
        self.trim(cache, 3)
        again = self.forward(ids[:, 5:], cache).logits
        if self.cache_len(cache) != 8 or not logits_replayed(first, again, tight):
            return why
        # Partial trim, as a verify round does: keep position 5, feed 6..7 at width 2. A new width
        # may round differently (bf16, quantized, GPU); only a difference past the width tolerance
        # that also moves an argmax is a defect.
        self.trim(cache, 2)
        part = self.forward(ids[:, 6:], cache).logits
        mx.eval(part)
        if self.cache_len(cache) != 8:
            return why
        if not logits_agree(first[:, 1:], part, loose) and not logits_agree(ref[:, 6:], part, loose):
            return why
        return None

    def check_speculation(self, taps: Sequence[int] = ()) -> None:
        """Raise the recorded refusal when a speculative mode (with these taps) cannot run."""
        if self.rollback_refusal:
            raise UserError(self.rollback_refusal)
        if taps and self.tap_refusal:
            raise UserError(self.tap_refusal)


# Units in the last place of each float dtype (relative precision).
_EPS = {mx.float32: 2.0**-23, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}


def _eps(a: mx.array) -> float:
    return _EPS.get(a.dtype, 2.0**-7)


def replay_tolerance(ref: mx.array) -> float:
    """Same arithmetic replayed: a few ulps of the logits' dtype at their magnitude."""
    return 4 * _eps(ref) * (1.0 + float(mx.abs(ref.astype(mx.float32)).max().item()))


def width_tolerance(ref: mx.array) -> float:
    """Rounding that a different verify width may bring: 16 ulps of the dtype (at least 1e-3) at
    the logits' magnitude."""
    return max(16 * _eps(ref), 1e-3) * (1.0 + float(mx.abs(ref.astype(mx.float32)).max().item()))


def logits_agree(a: mx.array, b: mx.array, tol: float) -> bool:
    """Logits of the same rows agree: within `tol`, or with the same argmax in every row."""
    a32, b32 = a.astype(mx.float32), b.astype(mx.float32)
    if a32.shape != b32.shape:
        return False
    if float(mx.abs(a32 - b32).max().item()) <= tol:
        return True
    return bool(mx.all(mx.argmax(a32, -1) == mx.argmax(b32, -1)).item())


def logits_replayed(a: mx.array, b: mx.array, tol: float) -> bool:
    """The same arithmetic gave the same logits (within `tol`, the same argmax in every row)."""
    a32, b32 = a.astype(mx.float32), b.astype(mx.float32)
    return (
        a32.shape == b32.shape
        and float(mx.abs(a32 - b32).max().item()) <= tol
        and bool(mx.all(mx.argmax(a32, -1) == mx.argmax(b32, -1)).item())
    )
