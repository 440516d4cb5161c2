"""Rollback of hybrid targets' recurrent layers (Gated DeltaNet) by recording and replay.

A GDN layer (mlx-lm `qwen3_5`, `qwen3_5_moe`, `qwen3_next`) keeps two arrays instead of a KV
cache: the last K-1 inputs of its causal conv1d and the recurrent state [B, Hv, Dv, Dk]. Neither
can be trimmed. So every forward into a `ReplayArraysCache` records what the recurrence consumed:

  conv_input   [B, K-1+S, C]  the conv state before the forward followed by the S new inputs
  q, k, v, a, b               the recurrence inputs of the S positions (after conv and q/k norm)
  state_before                the recurrent state before the forward (None on the first one)

and `rewind(n)` rebuilds the layer at the accept point m = S - n: the conv state is a slice of
conv_input (data movement only) and the recurrent state is the same `gated_delta_update` the
family's forward calls, run over the m accepted positions from `state_before`. Nothing is
recomputed through the projections, so the result is the state plain decoding would hold, bit
for bit, wherever the recurrence is computed per position the same way at any length (mlx-lm's
ops path on CPU and CUDA; its Metal kernel loops over positions). `prove_replay` checks exactly
that on the loaded model before speculation is allowed on it.

On MLX's CUDA backend mlx-lm's recurrence is its ops loop (several launches per position), so
there every GDN forward of a Target (prefill, plain step, verify) and the replay run one native
kernel instead (kernels/gdn_replay.py, `MLX_DSPARK_GDN_KERNEL=0` turns it off): its arithmetic
per position does not depend on how many positions a call covers, so a replay of m positions is
bitwise the m plain steps that also ran it. It sums in its own order, so there the forward is
mlx-lm's to float32 rounding, not bitwise. On the CPU and on Metal (where mlx-lm's own kernel
already loops over positions in one launch) mlx-lm's `gated_delta_update` stays.

The recording forward is installed on each GDN module instance by giving it a subclass (as the
taps in target.py do): it is the family's own forward, step for step, with the recording added;
`prove_replay` compares its logits with mlx-lm's own forward bitwise. Batched caches (lengths or
left padding set) go through the family's forward untouched and cannot be rewound.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from ..compat import retype_modules
from ..kernels import gdn_replay

_FAMILY_GDN = ("GatedDeltaNet", "Qwen3NextGatedDeltaNet")  # class names of the supported GDN modules


@dataclass
class GDNRound:
    conv_input: mx.array
    q: mx.array
    k: mx.array
    v: mx.array
    a: mx.array
    b: mx.array
    state_before: mx.array | None
    width: int
    module: Any  # the GDN module (A_log, dt_bias, conv kernel size)
    update: Callable  # the family's gated_delta_update
    g: mx.array | None = None  # the decays and betas the native kernel consumed (kernel rounds only)
    beta: mx.array | None = None
    kernel: str | None = None  # "cuda" when the round ran kernels/gdn_replay.py, else None


class ReplayArraysCache(ArraysCache):
    """An ArraysCache whose last forward can be rolled back to any of its positions."""

    def __init__(self, size: int = 2):
        super().__init__(size)
        self.round: GDNRound | None = None

    def is_trimmable(self) -> bool:
        return self.lengths is None and self.left_padding is None

    def trim(self, n: int) -> int:
        self.rewind(n)
        return n

    def rewind(self, n: int) -> None:
        """Keep the first S - n positions of the last forward (S its width); n = 0 commits it."""
        r, self.round = self.round, None
        if n <= 0:
            return
        if r is None or n > r.width:
            width = 0 if r is None else r.width
            raise RuntimeError(f"cannot roll a recurrent layer back {n} positions: its last forward fed {width}")
        m = r.width - n
        keep = r.module.conv_kernel_size - 1
        self[0] = r.conv_input[:, m : m + keep, :]  # a view (no copy): the next forward concatenates it
        if m == 0:
            self[1] = r.state_before
            return
        if r.kernel is not None:  # the same instance (with y) as the forward: bitwise its state
            sl = slice(0, m)
            self[1] = gdn_replay.gdn_recurrence_gpu(
                r.q[:, sl], r.k[:, sl], r.v[:, sl], r.g[:, sl], r.beta[:, sl], r.state_before, lang=r.kernel
            )[1]
            return
        _, state = r.update(
            r.q[:, :m],
            r.k[:, :m],
            r.v[:, :m],
            r.a[:, :m],
            r.b[:, :m],
            r.module.A_log,
            r.module.dt_bias,
            r.state_before,
            None,
            use_kernel=not r.module.training,
        )
        self[1] = state


def replay_state(update: Callable, module, q, k, v, a, b, state_before):
    """The pure-MLX reference of the replay: the recurrent state after q..b from state_before."""
    return update(q, k, v, a, b, module.A_log, module.dt_bias, state_before, None, use_kernel=not module.training)[1]


def _projections(self, inputs):
    """The family-specific head of the GDN forward: (mixed qkv [B,S,C], z, b, a)."""
    B, S, _ = inputs.shape
    if hasattr(self, "in_proj_qkvz"):  # qwen3_next
        q, k, v, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(inputs), self.in_proj_ba(inputs))
        mixed = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        return mixed, z, b, a
    qkv = self.in_proj_qkv(inputs)  # qwen3_5, qwen3_5_moe
    z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
    return qkv, z, self.in_proj_b(inputs), self.in_proj_a(inputs)


def _recording_call(self, inputs, mask=None, cache=None, *, _base, _globals):
    if (
        not isinstance(cache, ReplayArraysCache)
        or mask is not None
        or cache.lengths is not None
        or getattr(self, "sharding_group", None) is not None
    ):
        return _base.__call__(self, inputs, mask, cache)
    B, S, _ = inputs.shape
    mixed, z, b, a = _projections(self, inputs)
    if cache[0] is not None:
        conv_state = cache[0]
    else:
        conv_state = mx.zeros((B, self.conv_kernel_size - 1, self.conv_dim), dtype=inputs.dtype)
    conv_input = mx.concatenate([conv_state, mixed], axis=1)
    cache[0] = mx.contiguous(conv_input[:, -(self.conv_kernel_size - 1) :, :])
    lang = kernel_lang(self, None, None, head_k_dim=self.head_k_dim)
    conv = self.conv1d(conv_input) if lang is None else depthwise_conv(self.conv1d, conv_input)
    conv_out = nn.silu(conv)
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
            [self.num_k_heads, self.num_k_heads, self.num_v_heads],
            [self.head_k_dim, self.head_k_dim, self.head_v_dim],
        )
    ]
    state = cache[1]
    q, k = _globals["normalize_qk"](q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)
    update = _globals["gated_delta_update"]
    if lang is None:
        out, new_state = update(q, k, v, a, b, self.A_log, self.dt_bias, state, None, use_kernel=not self.training)
        cache.round = GDNRound(conv_input, q, k, v, a, b, state, S, self, update)
    else:
        if state is None:
            state = mx.zeros((B, self.num_v_heads, self.head_v_dim, self.head_k_dim), dtype=mx.float32)
        g, beta = _globals["compute_g"](self.A_log, a, self.dt_bias), mx.sigmoid(b)
        y, new_state = gdn_replay.gdn_recurrence_gpu(q, k, v, g, beta, state, lang=lang)
        out = y.astype(q.dtype)
        cache.round = GDNRound(conv_input, q, k, v, a, b, state, S, self, update, g, beta, lang)
    cache[1] = new_state
    cache.advance(S)
    out = self.norm(out, z)
    return self.out_proj(out.reshape(B, S, -1))


def kernel_lang(module, k: mx.array | None = None, v: mx.array | None = None, head_k_dim: int = 0) -> str | None:
    """Where this GDN forward runs kernels/gdn_replay.py's native recurrence: "cuda" on MLX's CUDA
    backend in eval mode for shapes the kernel takes (unless MLX_DSPARK_GDN_KERNEL=0), else None
    (mlx-lm's gated_delta_update). Shapes from k / v, or from the module's head sizes."""
    import os

    if module.training or getattr(_route, "off", False) or os.environ.get("MLX_DSPARK_GDN_KERNEL", "1") == "0":
        return None
    if gdn_replay.replay_path() != "cuda":
        return None
    if k is None:
        dk = head_k_dim or module.head_k_dim
        k = mx.zeros((1, 1, module.num_k_heads, dk))
        v = mx.zeros((1, 1, module.num_v_heads, 1))
    probe = mx.zeros((1, 1, 1, 1), dtype=mx.float32)  # the state the kernel keeps is float32
    if not gdn_replay.supported(k, v, probe):
        return None
    why = gdn_replay.self_check("cuda")
    if why is not None:
        _warn_once(f"{why}; hybrid layers keep mlx-lm's recurrence (rollback replays it, slower)")
        return None
    return "cuda"


@functools.lru_cache(maxsize=None)
def _warn_once(msg: str) -> None:
    import warnings

    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def depthwise_conv(conv1d, x: mx.array) -> mx.array:
    """What the GDN layer's depthwise nn.Conv1d (groups = channels, no padding, no bias) computes
    over x [B, L, C], as K shifted elementwise products summed in tap order: each output position
    is computed the same way whatever L is (a backend's convolution may pick another algorithm
    by size), so a verify forward's rows equal plain steps'. Used on the native-kernel route."""
    w = conv1d.weight  # [C, K, 1]
    K = w.shape[1]
    S = x.shape[1] - K + 1
    y = x[:, 0:S, :] * w[:, 0, 0]
    for j in range(1, K):
        y = y + x[:, j : j + S, :] * w[:, j, 0]
    return y


def gdn_modules(layers) -> list:
    """The GDN module of each decoder layer (None for attention layers)."""
    return [getattr(layer, "linear_attn", None) if getattr(layer, "is_linear", False) else None for layer in layers]


def is_hybrid(layers) -> bool:
    return any(m is not None for m in gdn_modules(layers))


def install_recording(layers) -> str | None:
    """Give each GDN module the recording forward. Returns None, or why this model's GDN layers
    cannot be recorded (an unknown module class, a missing helper)."""
    for m in gdn_modules(layers):
        if m is None or getattr(type(m), "_mlx_dspark_replay", False):
            continue
        base = type(m)
        if base.__name__ not in _FAMILY_GDN:
            return f"its recurrent layers are {base.__name__}, which mlx-dspark cannot replay"
        g = base.__call__.__globals__
        if "gated_delta_update" not in g or "normalize_qk" not in g:
            return f"{base.__module__} no longer calls gated_delta_update / normalize_qk"
        if "compute_g" not in g:
            from mlx_lm.models.gated_delta import compute_g

            g = dict(g, compute_g=compute_g)

        def call(self, inputs, mask=None, cache=None, __base=base, __g=g):
            return _recording_call(self, inputs, mask, cache, _base=__base, _globals=__g)

        retype_modules([m], type(base.__name__, (base,), {"__call__": call, "_mlx_dspark_replay": True}))
    return None


def convert_cache(cache: list) -> list:
    """mlx-lm's ArraysCache of each GDN layer -> ReplayArraysCache (both empty at creation)."""
    return [ReplayArraysCache(len(c.cache)) if type(c) is ArraysCache else c for c in cache]


def _states(cache) -> list:
    """Every array (and position counter) a cache holds, to compare two caches bitwise."""
    from mlx_lm.models.cache import RotatingKVCache

    out = []
    for c in cache:
        if isinstance(c, ArraysCache):
            out.extend(x for x in c.cache if x is not None)
        elif isinstance(c, RotatingKVCache):
            if c.keys is not None:
                out.extend([c.keys, c.values, mx.array([c.offset, c._idx, c.keys.shape[2]])])
        elif getattr(c, "keys", None) is not None:  # KV caches: the positions below offset
            from mlx.utils import tree_flatten

            n = c.offset
            out.extend(x[..., :n, :] for _, x in tree_flatten([c.keys, c.values]))
            out.append(mx.array([n]))
    return out


def prove_replay(model, make_cache: Callable[[], list], vocab: int, forward: Callable | None = None) -> str | None:
    """Check on this model that (1) the recording forward gives mlx-lm's own logits bitwise and
    (2) a 7-wide verify forward rewound by 4 leaves every layer's state equal to feeding the same
    3 tokens one at a time: bitwise where the model's wide rows equal its one-token rows, else
    to the dtype's precision. Returns None, or what differed. `forward(ids, cache, prefill)` ->
    logits is the decode path the target runs (Target._proof_forward: on a GPU its width-invariant
    kernels, under which wide rows are one-token rows); default the model's own forward."""
    from mlx_lm.models.cache import make_prompt_cache

    if forward is None:

        def forward(ids, cache, prefill=False):
            return model(ids, cache=cache)

    ids = mx.array([[(29 * i + 7) % max(vocab, 2) for i in range(12)]], dtype=mx.int32)
    ref = model(ids, cache=make_prompt_cache(model))
    rec = make_cache()
    ours = model(ids, cache=rec)
    if not mx.array_equal(ref, ours).item():
        if not any(getattr(getattr(c, "round", None), "kernel", None) for c in rec):
            return _NOT_MLX_LM
        # The native-kernel route sums its conv and recurrence in its own order, so its logits
        # are not mlx-lm's bitwise, and how far they are is not a measure either: MLX's float32
        # matmul on CUDA is 3e-4 relative from the CPU's (TF32-like), which turns the kernel's
        # last-bit differences into logits 4x past float32 tolerance (qwen3_5 fixture, H200:
        # bench/results/hybrid-replay-h200.md). So: the recording forward without the kernel must
        # be mlx-lm's bitwise, and the route's two parts the CPU's float32 on what each layer
        # recorded.
        why = kernel_parts_differ(rec)
        if why is not None:
            return why
        with native_kernel_off():
            if not mx.array_equal(ref, model(ids, cache=make_cache())).item():
                return _NOT_MLX_LM
    from . import sliding

    wide, plain = make_cache(), make_cache()
    forward(ids[:, :5], wide, True)
    forward(ids[:, :5], plain, True)
    sliding.mark_verify(wide, True)  # a verify round, as Target.forward marks one
    rows = forward(ids[:, 5:12], wide)
    sliding.mark_verify(wide, False)
    for c in wide:
        (c.rewind if hasattr(c, "rewind") else c.trim)(4)
    steps = mx.concatenate([forward(ids[:, i : i + 1], plain) for i in range(5, 8)], axis=1)
    a, b = _states(wide), _states(plain)
    # Bitwise where `forward` computes a wide forward's rows as one-token forwards do: the
    # width-invariant decode paths (native on CPU float32 with MLX's own BLAS; the kernels on a
    # GPU or with OpenBLAS). Only where no invariant path exists (models/invariance.py warns
    # then) can the state a wide forward leaves not be bitwise plain decoding's, and there only a
    # difference beyond the dtype's precision is a replay defect.
    same = _equal if _equal(rows[:, :3], steps) else _close
    if len(a) != len(b) or not all(x.shape == y.shape and same(x, y) for x, y in zip(a, b)):
        return "replaying the accepted positions does not rebuild the recurrent state bitwise"
    if not same(forward(ids[:, 8:9], wide), forward(ids[:, 8:9], plain)):
        return "the logits after a replayed rollback differ from plain decoding"
    return None


_NOT_MLX_LM = "the recording forward of its recurrent layers does not reproduce mlx-lm's logits bitwise"


def kernel_parts_differ(cache: list) -> str | None:
    """What the native-kernel route computes its own way in each GDN layer of `cache`'s last
    forward, against the same float32 arithmetic on the CPU over the inputs the layer recorded:
    the causal conv (depthwise_conv against the layer's nn.Conv1d) and the recurrence (the kernel
    against its pure-MLX reference, mlx-lm's per-position ops). None, or which part differs."""
    for i, c in enumerate(cache):
        r = getattr(c, "round", None)
        if r is None or r.kernel is None:
            continue
        m = r.module
        state = r.state_before
        if state is None:
            state = mx.zeros((r.k.shape[0], r.v.shape[2], r.v.shape[3], r.k.shape[3]), dtype=mx.float32)
        conv = depthwise_conv(m.conv1d, r.conv_input)
        y, new = gdn_replay.gdn_recurrence_gpu(r.q, r.k, r.v, r.g, r.beta, state, lang=r.kernel)
        with mx.stream(mx.cpu):
            conv_ref = m.conv1d(r.conv_input)
            y_ref, new_ref = gdn_replay.gdn_recurrence_reference(r.q, r.k, r.v, r.g, r.beta, state)
            mx.eval(conv_ref, y_ref, new_ref)
        if not _close(conv, conv_ref):
            return f"layer {i}: the width-invariant causal conv differs from the float32 conv"
        if not (_close(y, y_ref) and _close(new, new_ref)):
            return f"layer {i}: the native GDN kernel differs from the float32 recurrence"
    return None


_route = threading.local()


@contextlib.contextmanager
def native_kernel_off():
    """GDN forwards in this thread take mlx-lm's recurrence (and conv), as off the CUDA route."""
    _route.off = True
    try:
        yield
    finally:
        _route.off = False


def _equal(x: mx.array, y: mx.array) -> bool:
    return bool(mx.array_equal(x, y).item())


def _close(x: mx.array, y: mx.array) -> bool:
    if not mx.issubdtype(x.dtype, mx.floating):
        return _equal(x, y)
    tol = 1e-4 if x.dtype == mx.float32 and y.dtype == mx.float32 else 3e-2
    x, y = x.astype(mx.float32), y.astype(mx.float32)
    scale = 1.0 + float(mx.abs(y).max().item())
    return float(mx.abs(x - y).max().item()) <= tol * scale
