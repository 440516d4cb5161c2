"""The one place where behaviour of other packages is adjusted. Each item names the versions it is for."""

from __future__ import annotations

import copy


def fresh_detokenizer(tokenizer, keep_leading_space: bool = False):
    """A private streaming detokenizer for one generation.

    mlx-lm (0.32.x) keeps one detokenizer instance per TokenizerWrapper, shared by every caller,
    so concurrent or interleaved generations would mix their text: a shallow copy shares only
    the read-only token map. mlx-lm's detokenizers also drop the output's leading space, right
    for a chat answer but wrong for a raw completion (" world" after "Hello"); the BPE one has no
    switch for it (0.32.x), so `keep_leading_space` turns the trim off on this copy only.
    """
    d = copy.copy(tokenizer.detokenizer)
    d.reset()
    if keep_leading_space:
        if hasattr(d, "trim_space"):
            d.trim_space = False
        if hasattr(d, "_maybe_trim_space"):
            d._maybe_trim_space = lambda text: text
    return d


def tap_decoder_layers(layers, recorder):
    """Record what each decoder layer returns, for drafters' taps, without wrapping modules.

    mlx-lm (0.32.x) decoder layers are plain nn.Modules whose __call__ returns the hidden state
    (or (h, extra) in some families). Each layer instance gets a subclass whose __call__ stores
    that output in `recorder.outputs[index]` while its index is in `recorder.active`; the
    parameter tree is untouched, so quantization, saving and mlx-lm's own forward still work.
    Returns the recorder the layers report to: layers tapped before (a second Target over the
    same model) keep theirs, which the new Target then shares."""
    if layers and getattr(type(layers[0]), "_mlx_dspark_tapped", False):
        return layers[0]._mlx_dspark_recorder
    for index, layer in enumerate(layers):
        base = type(layer)

        def tapped_call(self, *args, __base=base, **kwargs):
            out = __base.__call__(self, *args, **kwargs)
            rec = self._mlx_dspark_recorder
            if self._mlx_dspark_index in rec.active:
                rec.outputs[self._mlx_dspark_index] = out[0] if isinstance(out, tuple) else out
            return out

        layer.__class__ = type(base.__name__, (base,), {"__call__": tapped_call, "_mlx_dspark_tapped": True})
        object.__setattr__(layer, "_mlx_dspark_recorder", recorder)
        object.__setattr__(layer, "_mlx_dspark_index", index)
    return recorder


def retype_modules(modules, cls) -> None:
    """Give each module instance the class `cls` (a subclass of its own, or its own class back).

    MLX (0.32.x) modules keep all their state in instance fields and read nothing from their
    class but methods, so swapping an instance's class for a subclass that overrides __call__,
    and back, changes how it computes and nothing else. Used for nn.QuantizedLinear (MLX 0.32.x;
    kernels/wide_gemm.py) and mlx-lm's GatedDeltaNet layers (mlx-lm 0.32.x; models/hybrid.py)."""
    for m in modules:
        m.__class__ = cls


_sdpa_before_cpu_prefill = None


def route_prefill_attention_to_cpu_op(op) -> None:
    """mlx-lm (0.32.x) attention layers call mx.fast.scaled_dot_product_attention (MLX 0.32.x) by
    attribute at call time, with mask "causal" for a prefill chunk. MLX's CPU fallback computes
    the softmax's exp one float at a time, which made a 20k-token prefill take half an hour on
    2 cores. Wrap that attribute once so that, while kernels.cpu_attention.active() is on in the
    calling thread, a long float32 causal call on the CPU runs kernels/cpu_attention.py's blocked
    numpy op; every other call (other threads, GPUs, short prompts, array masks) goes through.
    `op` is that module (passed in, so compat imports nothing of kernels/ for it)."""
    global _sdpa_before_cpu_prefill
    import mlx.core as mx

    if _sdpa_before_cpu_prefill is not None:
        return
    original = mx.fast.scaled_dot_product_attention

    def scaled_dot_product_attention(q, k, v, *args, scale=None, mask=None, **kwargs):
        if not args and not kwargs.get("sinks") and op.wants(q, k, v, mask, scale):
            return op.attention(q, k, v, float(scale))
        return original(q, k, v, *args, scale=scale, mask=mask, **kwargs)

    _sdpa_before_cpu_prefill = original
    mx.fast.scaled_dot_product_attention = scaled_dot_product_attention


_sdpa_original = None


def route_causal_attention_to_invariant_op() -> None:
    """mlx-lm (0.32.x) attention layers call mx.fast.scaled_dot_product_attention (MLX 0.32.x) by
    attribute at call time, with mask "causal" (or None for one query) over a KV cache. Wrap that
    attribute once so that, while kernels.invariant.active() is on in the calling thread, such a
    call runs the width-invariant op instead (kernels/invariant.py), and a call with a boolean
    array mask (a sliding window's verify layout, models/sliding.py) runs kernels/invariant_masked.py.
    Other masks, attention sinks, other threads, and every call outside that block go to MLX's own
    kernel."""
    global _sdpa_original
    import mlx.core as mx

    if _sdpa_original is not None:
        return
    from .kernels import invariant, invariant_masked

    original = mx.fast.scaled_dot_product_attention

    def scaled_dot_product_attention(q, k, v, *args, scale=None, mask=None, sinks=None, **kwargs):
        if invariant.is_active() and not args and not kwargs and sinks is None and scale is not None:
            if (mask == "causal" if isinstance(mask, str) else mask is None and q.shape[2] == 1) and (
                invariant.supported(q, k, v)
            ):
                return invariant.invariant_attention(q, k, v, float(scale))
            if invariant_masked.supported(q, k, v, mask) and not invariant.offset_pending():
                return invariant_masked.attention(q, k, v, float(scale), mask)  # a sliding window's verify layout
        if invariant.offset_pending():  # a compiled decode step's KV buffer: only the invariant op reads it right
            invariant.take_offset()
            raise invariant.NotInvariant("this attention call (its mask or shapes) does not take the invariant op")
        return original(q, k, v, *args, scale=scale, mask=mask, sinks=sinks, **kwargs)

    _sdpa_original = original
    mx.fast.scaled_dot_product_attention = scaled_dot_product_attention


_norm_rope_originals: tuple | None = None


def route_target_norm_and_rope() -> None:
    """mlx-lm (0.32.x) layers call mx.fast.rope (nn.RoPE) and mx.fast.rms_norm (nn.RMSNorm and the
    families' own norms) by attribute at call time; MLX's CPU build (0.32.x) runs both as
    fallbacks of ~29 and ~7 ops. Wrap the two attributes once so that, while
    kernels.invariant.active() is on in the calling thread (the target's decode forward), a float32
    call on the CPU runs the native op instead (kernels/target_ops.py); every other call, and what
    the op does not express (RoPE freqs, other dtypes, a stream), goes to MLX's own."""
    global _norm_rope_originals
    import mlx.core as mx

    if _norm_rope_originals is not None:
        return
    from .kernels import invariant, target_ops

    rope_original, norm_original = mx.fast.rope, mx.fast.rms_norm

    def rope(a, dims, *, traditional, base, scale, offset, freqs=None, stream=None):
        if stream is None and invariant.is_active():
            y = target_ops.rope(a, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs)
            if y is not None:
                return y
        return rope_original(
            a, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs, stream=stream
        )

    def rms_norm(x, weight, eps, *, stream=None):
        if stream is None and invariant.is_active():
            y = target_ops.rms_norm(x, weight, eps)
            if y is not None:
                return y
        return norm_original(x, weight, eps, stream=stream)

    _norm_rope_originals = (rope_original, norm_original)
    mx.fast.rope, mx.fast.rms_norm = rope, rms_norm


_linear_originals: dict | None = None
OWN_PRODUCT = "_mlx_dspark_own_product"  # instance attribute: (layer, x, ...) -> y, set by checked_qmm


def route_linears_to_invariant_op() -> None:
    """mlx.nn (MLX 0.32.x) looks up Linear.__call__, QuantizedLinear.__call__ and the embeddings'
    as_linear (the tied lm_head) on the class at call time. Wrap them once so that, while
    kernels.invariant.active() is on in the calling thread, they compute through the row-invariant
    product of kernels/invariant_linear.py (where it supports the layer: affine 2/4/8-bit, float
    weights), and float layers do inside kernels.native_products.native_products() (a drafter pass
    on the CPU); every other call, thread and layer kind keeps MLX's own op. mlx-lm's MoE expert
    layers are routed the same way (_route_experts). A quantized layer to which
    kernels/checked_qmm.py gave its own product (the instance attribute OWN_PRODUCT: MLX's is
    wrong or not reproducible for its kind on this device) computes its other calls with it."""
    global _linear_originals
    import mlx.nn as nn

    if _linear_originals is not None:
        return
    from .kernels import invariant, invariant_linear, native_products

    originals = {}
    for cls, attr, as_linear in (
        (nn.Linear, "__call__", False),
        (nn.QuantizedLinear, "__call__", False),
        (nn.Embedding, "as_linear", True),
        (nn.QuantizedEmbedding, "as_linear", True),
    ):
        original = cls.__dict__[attr]

        def routed(self, x, _original=original, _as_linear=as_linear):
            if invariant.is_active():
                y = invariant_linear.call(self, x, as_linear=_as_linear)
                if y is not None:
                    return y
            elif native_products.is_on():  # a drafter pass on the CPU
                y = native_products.linear(self, x, as_linear=_as_linear)
                if y is not None:
                    return y
            product = vars(self).get(OWN_PRODUCT)  # MLX's product failed its load check here
            if product is not None:
                return product(self, x)
            return _original(self, x)

        originals[(cls, attr)] = original
        setattr(cls, attr, routed)
    _route_experts(originals)
    _linear_originals = originals


def _route_experts(originals: dict) -> None:
    """mlx-lm (0.32.x) MoE blocks (SwitchGLU / SwitchMLP) call SwitchLinear.__call__ and
    QuantizedSwitchLinear.__call__(x, indices, sorted_indices) by class lookup, which run
    mx.gather_mm / mx.gather_qmm and then add the per-expert bias. While kernels.invariant.active()
    is on, the product runs through kernels/invariant_gather.py where it takes the layer (and the
    bias is added as mlx-lm adds it); otherwise, and for what it does not take, mlx-lm's own call.
    SwitchGLU.__call__(x, indices) calls up_proj then gate_proj on the same x and indices: while
    active it runs inside invariant_gather.pair, so the two are one launch on a GPU."""
    import mlx.core as mx
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear

    from .kernels import invariant, invariant_gather

    glu = SwitchGLU.__dict__["__call__"]

    def routed_glu(self, x, indices, _original=glu):  # its up and gate projections: one launch
        if invariant.is_active():
            with invariant_gather.pair(self.up_proj, self.gate_proj):
                return _original(self, x, indices)
        return _original(self, x, indices)

    originals[(SwitchGLU, "__call__")] = glu
    SwitchGLU.__call__ = routed_glu
    for cls in (SwitchLinear, QuantizedSwitchLinear):
        original = cls.__dict__["__call__"]

        def routed(self, x, indices, sorted_indices=False, _original=original):
            if invariant.is_active():
                y = invariant_gather.call(self, x, indices)
                if y is not None:
                    return y + mx.expand_dims(self["bias"][indices], -2) if "bias" in self else y
            product = vars(self).get(OWN_PRODUCT)
            if product is not None:
                return product(self, x, indices, sorted_indices)
            return _original(self, x, indices, sorted_indices)

        originals[(cls, "__call__")] = original
        cls.__call__ = routed
    _route_hadamard(originals)


def _route_hadamard(originals: dict) -> None:
    """mlx-lm (0.32.x) prism_hadamard_qwen35.HadamardQuantizedLinear.__call__ (PrismML Bonsai's
    2-bit packs; its embedding's as_linear calls it too) rotates x by a per-row blockwise
    Walsh-Hadamard transform (hadamard_rotate) and runs mx.quantized_matmul (2-bit affine, group
    128). While kernels.invariant.active() is on and the linear kernels run on a GPU, the same
    rotation then kernels/invariant_linear.py's affine product; otherwise mlx-lm's own call."""
    try:
        from mlx_lm.models.prism_hadamard_qwen35 import HadamardQuantizedLinear, hadamard_rotate
    except ImportError:  # an mlx-lm without the Bonsai packs
        return
    from .kernels import invariant, invariant_linear

    original = HadamardQuantizedLinear.__dict__["__call__"]

    def routed(self, x, _original=original):
        if invariant.is_active() and invariant_linear.linear_path() in ("cuda", "metal"):
            xr = hadamard_rotate(x, self.block, self.signs) if self.block else x
            y = invariant_linear.affine(xr, self["weight"], self["scales"], self["biases"], self.group_size, self.bits)
            if y is not None:
                return y
        return _original(self, x)

    originals[(HadamardQuantizedLinear, "__call__")] = original
    HadamardQuantizedLinear.__call__ = routed


def mlx_lm_tool_call(syntax: str, text: str, tools):
    """Parse one tool call with mlx-lm's own parser for `syntax` ("qwen3_coder": the XML
    <function=...> form; "gemma4"). mlx-lm (0.32.x) exposes these as
    mlx_lm.tool_parsers.<name>.parse_tool_call(text, tools), returning a dict (or a list of
    them) with "name" and "arguments"."""
    import importlib

    return importlib.import_module(f"mlx_lm.tool_parsers.{syntax}").parse_tool_call(text, tools)


def compile_before_threads(tokenizer) -> None:
    """Import what requests would import lazily, and compile the chat template, before any
    request thread runs: compiling Python code in two threads at once trips a CPython bug
    ("SystemError: AST constructor recursion depth mismatch", gh-106905; seen on 3.11.7)."""
    import importlib

    for name in ("mlx_dspark.decode.sampled", "mlx_lm.tool_parsers.qwen3_coder", "mlx_lm.tool_parsers.gemma4"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    if getattr(tokenizer, "chat_template", None) is not None:
        try:
            tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
            )
        except Exception:  # a template that needs more than this; requests will say why
            pass


_decoding_threads: dict = {}  # native id -> threading.Thread: the threads, not the main one, that decoded
_exit_hook = {"registered": False, "ended_unlisted": False}


def note_decoding_thread() -> None:
    """Call from a thread about to decode. At interpreter exit, threads that decoded and have
    ended get time to finish MLX's thread-local teardown (see _await_decoding_threads).

    Why (MLX 0.32.4, CPU and CUDA): each thread keeps its own cache of mx.compile'd graphs
    (ours, and mlx.nn's compiled activations), freed by a thread-exit destructor that takes
    the GIL. A thread that ends just before the interpreter finalizes takes it too late: CPython
    exits it mid-destructor and the C++ runtime aborts the process ("terminate called without
    an active exception", exit code 134). Plain MLX reproduces it; a server that decoded
    through compiled steps in its engine thread hit it at nearly every exit."""
    import threading

    t = threading.current_thread()
    n = threading.get_native_id()
    if t is threading.main_thread() or _decoding_threads.get(n) is t:
        return
    if not _exit_hook["registered"]:
        import atexit

        atexit.register(_await_decoding_threads)
        _exit_hook["registered"] = True
    for m, x in list(_decoding_threads.items()):  # forget the ended ones the OS has let go
        if not x.is_alive() and not _os_lists_thread(m):
            del _decoding_threads[m]
    _decoding_threads[n] = t


def _os_lists_thread(native_id: int) -> bool:
    """Whether the OS still holds the thread (Linux: /proc); where it cannot say, False, and the
    exit hook then waits a fixed time instead."""
    import os

    if os.path.isdir("/proc/self/task"):
        return os.path.exists(f"/proc/self/task/{native_id}")
    _exit_hook["ended_unlisted"] = True
    return False


def _await_decoding_threads(limit_s: float = 2.0) -> None:
    """Before the interpreter finalizes (atexit, GIL released while waiting): wait until every
    noted thread that has ended is gone from the OS, at most `limit_s`; where the OS does not
    list its threads (/proc), a fixed 0.1 s. A thread still running is not waited for."""
    import os
    import time

    ended = [n for n, t in _decoding_threads.items() if not t.is_alive()]
    if not os.path.isdir("/proc/self/task"):
        if ended or _exit_hook["ended_unlisted"]:
            time.sleep(0.1)
        return
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and any(_os_lists_thread(n) for n in ended):
        time.sleep(0.005)


def route_row_attention() -> None:
    """mlx-lm (0.32.x) attention layers pass whatever their cache's update_and_fetch returned as
    keys and values to mx.fast.scaled_dot_product_attention (MLX 0.32.x), looked up at call time.
    decode/batch.py's RowsCache returns an object holding each batch row's own keys and values
    (it has `row_attention`); make sure the outermost wrapper of that attribute hands such a
    call to it, which attends row by row through the wrapped function. Called before every
    batched forward (cheap): a wrapper installed later (the invariant routing) is wrapped again."""
    import mlx.core as mx

    current = mx.fast.scaled_dot_product_attention
    if getattr(current, "_rows_aware", False):
        return

    def scaled_dot_product_attention(q, k, v, *args, scale=None, mask=None, **kwargs):
        if hasattr(k, "row_attention"):
            return k.row_attention(q, scale, current)
        return current(q, k, v, *args, scale=scale, mask=mask, **kwargs)

    scaled_dot_product_attention._rows_aware = True
    mx.fast.scaled_dot_product_attention = scaled_dot_product_attention


# ------------------------------------------------------------------- mlx-vlm (the [gemma] extra)
def dist_version(name: str) -> tuple[int, ...] | None:
    """The installed version of distribution `name` as a tuple of ints (None if not installed)."""
    import re
    from importlib import metadata

    try:
        v = metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])


def vlm_rope_utils_shim_active(vlm: tuple | None = None) -> bool:
    """mlx-vlm < 0.6.5 keeps its rope utilities in mlx_vlm.models.gemma4.rope_utils; 0.6.5 moved
    them to mlx_vlm.models.rope_utils (importing the new path crashed older mlx-dspark on fresh
    installs). Active when the installed mlx-vlm has the old layout."""
    vlm = dist_version("mlx-vlm") if vlm is None else vlm
    return vlm is not None and vlm < (0, 6, 5)


def vlm_rope_utils():
    """mlx-vlm's rope utilities module (initialize_rope, ...) from whichever layout is installed:
    mlx_vlm.models.rope_utils (mlx-vlm >= 0.6.5), else mlx_vlm.models.gemma4.rope_utils (<= 0.6.4)."""
    import importlib

    try:
        return importlib.import_module("mlx_vlm.models.rope_utils")
    except ImportError:
        return importlib.import_module("mlx_vlm.models.gemma4.rope_utils")


def vlm_video_processor_shim_active(vlm: tuple | None = None, transformers: tuple | None = None) -> bool:
    """mlx-vlm 0.6.3 - 0.6.4 with transformers >= 5.12: loading a Gemma 4 processor fails with a
    misleading "OSError: Can't load video processor" (Blaizzy/mlx-vlm#1578, fixed in 0.6.5):
    transformers resolves a video processor the checkpoint does not ship. Active in that range."""
    vlm = dist_version("mlx-vlm") if vlm is None else vlm
    transformers = dist_version("transformers") if transformers is None else transformers
    return vlm is not None and (0, 6, 3) <= vlm < (0, 6, 5) and transformers is not None and transformers >= (5, 12)


_video_shim_original = None


def apply_vlm_video_processor_shim(force: bool = False) -> bool:
    """Where `vlm_video_processor_shim_active()` (or `force`): make transformers'
    AutoVideoProcessor.from_pretrained answer None instead of raising that OSError, so the Gemma 4
    processor builds its own default video processor (its constructor does when given None).
    Returns whether the shim is installed. Idempotent; other errors still raise."""
    global _video_shim_original
    if _video_shim_original is not None:
        return True
    if not (force or vlm_video_processor_shim_active()):
        return False
    import transformers

    auto = transformers.AutoVideoProcessor
    original = auto.__dict__["from_pretrained"]

    def from_pretrained(cls, *args, **kwargs):
        try:
            return original.__get__(None, cls)(*args, **kwargs)
        except OSError as e:
            if "video processor" in str(e).lower():
                return None
            raise

    _video_shim_original = original
    auto.from_pretrained = classmethod(from_pretrained)
    return True


def remove_vlm_video_processor_shim() -> None:
    global _video_shim_original
    if _video_shim_original is not None:
        import transformers

        transformers.AutoVideoProcessor.from_pretrained = _video_shim_original
        _video_shim_original = None


def vlm_shims() -> list[dict]:
    """The mlx-vlm shims, the versions each is for, and whether it is active here (doctor)."""
    vlm, tf = dist_version("mlx-vlm"), dist_version("transformers")
    fmt = lambda v: ".".join(map(str, v)) if v else "not installed"  # noqa: E731
    return [
        {
            "name": "mlx-vlm rope-utils layout",
            "for": "mlx-vlm < 0.6.5 (rope_utils under models/gemma4/)",
            "active": vlm_rope_utils_shim_active(vlm),
            "installed": f"mlx-vlm {fmt(vlm)}",
        },
        {
            "name": "gemma4 video-processor OSError",
            "for": "mlx-vlm 0.6.3 - 0.6.4 with transformers >= 5.12",
            "active": vlm_video_processor_shim_active(vlm, tf) or _video_shim_original is not None,
            "installed": f"mlx-vlm {fmt(vlm)}, transformers {fmt(tf)}",
        },
    ]


def shims() -> list[dict]:
    """Every adjustment this module makes to other packages (doctor): its name, the versions it
    was written for (`for`, and `fits`: whether the installed version is in that range), when it
    applies (`when`), and whether it is active in this process (`active`: installed now, or, for
    the mlx-vlm shims, needed by what is installed)."""
    mlx, lm = dist_version("mlx"), dist_version("mlx-lm")
    fmt = lambda v: ".".join(map(str, v)) if v else "not installed"  # noqa: E731
    minor = lambda v, want: v is not None and v[:2] == want  # noqa: E731
    on_mlx = {"installed": f"mlx {fmt(mlx)}", "fits": minor(mlx, (0, 32))}
    on_lm = {"installed": f"mlx-lm {fmt(lm)}", "fits": minor(lm, (0, 32))}
    on_both = {"installed": f"mlx {fmt(mlx)}, mlx-lm {fmt(lm)}", "fits": on_mlx["fits"] and on_lm["fits"]}
    out = [
        {
            "name": "private detokenizer per generation",
            "for": "mlx-lm 0.32.x",
            "when": "every generation",
            "active": True,
            **on_lm,
        },
        {
            "name": "decoder-layer taps (instance subclass)",
            "for": "mlx-lm 0.32.x",
            "when": "a drafter reads the target's hidden states",
            "active": False,
            **on_lm,
        },
        {
            "name": "module class swap",
            "for": "MLX 0.32.x, mlx-lm 0.32.x",
            "when": "a quantized target runs wide GEMMs on the CPU, or a hybrid target loads",
            "active": False,
            **on_both,
        },
        {
            "name": "prefill attention -> blocked CPU op",
            "for": "MLX 0.32.x, mlx-lm 0.32.x",
            "when": "a float32 target prefills a long prompt on the CPU",
            "active": _sdpa_before_cpu_prefill is not None,
            **on_both,
        },
        {
            "name": "attention -> width-invariant op",
            "for": "MLX 0.32.x, mlx-lm 0.32.x",
            "when": "a target runs the invariant kernel path",
            "active": _sdpa_original is not None,
            **on_both,
        },
        {
            "name": "linears / MoE experts / Bonsai Hadamard -> width-invariant op",
            "for": "MLX 0.32.x, mlx-lm 0.32.x",
            "when": "a target runs the invariant kernel path",
            "active": _linear_originals is not None,
            **on_both,
        },
        {
            "name": "per-row attention for batched rows",
            "for": "MLX 0.32.x, mlx-lm 0.32.x",
            "when": "serve batches requests (--max-batch)",
            "active": _sdpa_is_rows_aware(),
            **on_both,
        },
        {
            "name": "mlx-lm tool-call parsers",
            "for": "mlx-lm 0.32.x",
            "when": "a reply uses the qwen3_coder / gemma4 tool syntax",
            "active": False,
            **on_lm,
        },
        {
            "name": "imports and template compile before threads",
            "for": "CPython 3.11 (gh-106905)",
            "when": "the server starts",
            "active": False,
            "installed": "",
            "fits": True,
        },
    ]
    return out + [{**s, "when": "a Gemma loads through mlx-vlm", "fits": True} for s in vlm_shims()]


def _sdpa_is_rows_aware() -> bool:
    import mlx.core as mx

    return bool(getattr(mx.fast.scaled_dot_product_attention, "_rows_aware", False))
