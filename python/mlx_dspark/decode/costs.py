"""Measured cost curves: what a verify forward of width w, and one drafter pass, cost here.

The round cost model (DESIGN.md, "Numbers to know") is tok/s ~ tau / (t_draft + t_verify(w)).
Whether speculation pays is a property of backend x BLAS x model x precision, so it is measured,
once, in a few seconds (`BUDGET_S`), and kept on disk:

    $MLX_DSPARK_CACHE/calibration/<hash>.json   (default ~/.cache/mlx-dspark; tests point it elsewhere)

The hash covers everything that changes the curve: the MLX and mlx-dspark versions, the device
(GPU name or CPU model), the BLAS MLX is using (blas.py), the target (source, layers, width,
vocabulary, weight dtype, quantization, KV bits) and the drafter (source, kind, bits, block,
draft vocabulary). A change in any of them measures again.

`MLX_DSPARK_CALIBRATION`: auto (default: read from disk, else measure and store) | refresh
(measure again, store) | off (no measurement: callers fall back to the fixed rules).

A curve measured while something else ran would be kept, and steer `--mode auto`, until the key
changes. So a measurement says whether it settled: other processes used at most OTHERS_MAX of
the machine's CPU capacity meanwhile (machine.OthersShare). One that did not is used, stored as
unsettled, and measured again at the next start, each point kept at the faster of the two (a busy
spell only ever slows a measurement down), at most MEASURES_MAX times in all. (The spread of a
width's own samples is no such signal: on the project's quiet 2-core VM a width's two fastest of
three differ by up to 30%.)

Measurement (on a CPU the smaller of wall and CPU time: see `_Clock`): a context of CONTEXT tokens
is prefilled once; each width w of `WIDTHS` is then fed
on top of it and trimmed away (the minimum over a few calls: the machine may be shared). Widths
go in doubling order and stop early when the budget is spent or when the curve is already linear
(t(w) >= LINEAR * w * t(1): a wider verify cannot pay), so a slow machine (reference BLAS) is
measured as fast as a quick one; unmeasured widths are interpolated, and extrapolated from the
last two measured points.

Plain decoding is measured as the loop runs it, not as a width-1 verify: pipelined steps (the
next step's forward is enqueued before the last token is read back), so on a GPU the host's graph
building overlaps the device's work and a plain step costs less than a synchronised width-1
forward (t_plain; on a CPU the two are close). A round syncs, so its cost stays t_verify(w).
Comparing rounds with the synchronised width-1 forward made speculation look up to ~1.6x better
than it is where decode is launch-bound.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field

import mlx.core as mx

# 2: t_plain, pipelined plain steps; 3: a CPU drafter pass on the native kernel; 4: + kernels;
# 5: t_plain timed once the pipeline is primed
VERSION = 6  # 6: the drafter pass timed after two untimed passes, three samples at least
WIDTHS = (1, 2, 4, 8, 16, 32, 3, 6, 12, 24)  # doubling first, then the gaps
CONTEXT = 16  # small: a prefill on reference BLAS runs at ~3 GFLOP/s
BUDGET_S = 4.0
LINEAR = 0.85
MIN_SLOPE = 0.04  # extrapolation floor, x t(1) per extra token (float32 SmolLM2, OpenBLAS: ~0.05)
PLAIN_STEPS = 6  # pipelined plain steps per timing
# Timed drafter passes at least, after two untimed ones (the context's ingest and a compiled pass's
# trace; a one-row ingest's first use): an H100 calibration that timed the second pass alone
# measured 5.5 ms for a pass that runs in 2.1 (bench/results/auto-h200.md, 26th session).
DRAFT_SAMPLES = 3
OTHERS_MAX = 0.25  # of the machine's CPU capacity, what other processes may use while it measures
MEASURES_MAX = 3  # an unsettled curve is measured again at the next start, this many times in all


@dataclass
class Costs:
    """t_verify(w) in seconds at the measured widths, and one drafter pass (None: no drafter)."""

    widths: list[int]
    t_verify: list[float]
    t_draft: float | None = None
    key: dict = field(default_factory=dict)
    measured_s: float = 0.0
    origin: str = "measured"  # "measured" | "disk" | "given"
    t_plain: float | None = None  # one pipelined plain step (None: taken as t_verify(1))
    settled: bool = True  # other processes left the machine alone while it measured (module docstring)
    others_share: float | None = None  # of the CPU capacity, what other processes used meanwhile
    measures: int = 1  # measurements merged into this curve

    def verify(self, w: int) -> float:
        """t_verify(w): measured points made non-decreasing (a wider verify never costs less),
        interpolated between them; past the last one the last slope, at least MIN_SLOPE x t(1)
        per token (noise must not make wide verifies look free)."""
        pts, top = [], 0.0
        for pw, pt in sorted(zip(self.widths, self.t_verify)):
            top = max(top, pt)
            pts.append((pw, top))
        if w <= pts[0][0]:
            return pts[0][1]
        for (w0, t0), (w1, t1) in zip(pts, pts[1:]):
            if w <= w1:
                return t0 + (t1 - t0) * (w - w0) / (w1 - w0)
        if len(pts) == 1:
            return pts[0][1] * w
        (w0, t0), (w1, t1) = pts[-2], pts[-1]
        return t1 + max((t1 - t0) / (w1 - w0), MIN_SLOPE * pts[0][1]) * (w - w1)

    @property
    def plain(self) -> float:
        """One plain decoding step as the loop takes it (pipelined): never more than t_verify(1)."""
        t1 = self.verify(1)
        return min(self.t_plain, t1) if self.t_plain else t1

    @property
    def bubble(self) -> float:
        """What a round costs beyond its synchronised forward where it interrupts plain steps:
        the step after it is built while the device waits (plain decoding builds each step while
        the one before it runs). t_verify(1) - t_plain: the host's share of a step that
        pipelining hides (an H100, the bf16 demo: 0.9 ms of a 3.4 ms forward)."""
        return max(0.0, self.verify(1) - self.plain)

    def summary(self) -> str:
        ws = sorted(zip(self.widths, self.t_verify))
        curve = ", ".join(f"w{w} {t / ws[0][1]:.2f}x" for w, t in ws[1:])
        draft = f"; drafter pass {self.t_draft * 1000:.1f} ms" if self.t_draft is not None else ""
        plain = f"; plain step {self.t_plain * 1000:.1f} ms pipelined" if self.t_plain else ""
        origin = self.origin
        if not self.settled:
            again = "measured again at the next start" if self.measures < MEASURES_MAX else "kept"
            origin += f", unsettled after {self.measures} measurement(s): {again}"
        return f"verify w1 {ws[0][1] * 1000:.1f} ms, {curve}{draft}{plain} ({origin})"

    def to_json(self) -> dict:
        return asdict(self)


def mode() -> str:
    m = os.environ.get("MLX_DSPARK_CALIBRATION", "auto").strip().lower() or "auto"
    if m not in ("auto", "refresh", "off"):
        from ..errors import UserError

        raise UserError(f"MLX_DSPARK_CALIBRATION={m!r}: expected auto, refresh or off")
    return m


def _kernels_hash() -> str | None:
    from ..kernels import native

    ext = native.ext(warn=False)
    return getattr(ext, "source_hash", None) if ext is not None else None


def _target_ops() -> bool | None:
    if mx.default_device() != mx.cpu:
        return None
    from ..kernels import target_ops

    return target_ops.enabled()


def key_for(target, drafter=None) -> dict:
    from .._version import __version__
    from ..blas import active_blas
    from ..machine import device_name
    from ..models.invariance import path_of
    from ..models.precision import weights_summary

    dtypes, quant = weights_summary(target.model)
    key = {
        "v": VERSION,
        "mlx": mx.__version__,
        "mlx_dspark": __version__,
        "device": device_name(),
        "blas": active_blas()["name"] if mx.default_device() == mx.cpu else None,
        "decode_path": path_of(target),
        "kernels": _kernels_hash(),  # a rebuilt extension (other native kernels) measures again
        "compiled": getattr(target, "compiled_decode", None) is not None,  # models/compiled_decode.py
        "target_ops": _target_ops(),  # kernels/target_ops.py: the CPU's RoPE and norms, native or MLX's
        "target": {
            "source": str(target.source or target.name),
            "layers": len(target.layers),
            "hidden": target.hidden_size,
            "vocab": target.vocab_size,
            "dtypes": dtypes,
            "quant": quant,
            "kv_bits": getattr(target, "kv_bits", None),
        },
    }
    if drafter is not None:
        d = drafter.describe()
        key["drafter"] = {k: d.get(k) for k in ("source", "kind", "bits", "block_size", "layers", "draft_vocab")}
        if mx.default_device() == mx.cpu:
            from ..kernels import native_products

            key["drafter"]["panels"] = native_products.panels_on()  # float16 panels or float32 weights
    return key


class _Clock:
    """Seconds of one call. CPU: the smaller of wall time and the process's CPU time: a busy
    machine inflates wall time (being descheduled costs no CPU time) and a multi-threaded BLAS
    inflates CPU time (threads add up), so the smaller one keeps the curve's ratios sound on a
    shared machine. GPU: wall time (the host waits for the device)."""

    def __init__(self):
        self.cpu = mx.default_device() == mx.cpu

    def __call__(self):
        return (time.perf_counter(), time.process_time() if self.cpu else 0.0)

    def since(self, t0) -> float:
        wall, cpu = time.perf_counter() - t0[0], (time.process_time() - t0[1]) if self.cpu else float("inf")
        return min(wall, cpu)


def measure(target, drafter=None, *, budget_s: float = BUDGET_S, context: int = CONTEXT) -> Costs:
    """Measure t_verify(w) (with the drafter's taps, when there is one) and one drafter pass.

    A first sweep times each width of WIDTHS once (after one untimed call: the first call of a
    process pays one-time set-up), stopping early where the curve is already linear; then sweeps
    over the same widths (and the drafter pass) repeat while the budget lasts, and each keeps its
    minimum; a sweep that would overrun the budget stops after its narrow widths (those a drafter's
    round verifies), so they get the most samples. Interleaving the widths in every sweep makes a
    busy machine slow them all alike, so their ratios, which decide the policy, stay sound."""
    from ..machine import OthersShare

    t_start, others = time.perf_counter(), OthersShare()
    taps = tuple(drafter.taps) if drafter is not None else ()
    vocab = max(2, min(int(target.vocab_size), 32000))
    ctx = [(17 + 7919 * i) % (vocab - 1) + 1 for i in range(context)]
    draft_ids = [(29 + 104729 * i) % (vocab - 1) + 1 for i in range(max(WIDTHS))]
    cache = target.make_cache()
    out = target.forward(mx.array([ctx]), cache, taps=taps, last_only=True)
    mx.eval([c.state for c in cache] + ([out.hidden] if out.hidden is not None else []))
    prompt_hidden = out.hidden[0] if out.hidden is not None else None

    clock = _Clock()

    def verify(w: int) -> float:
        t = clock()
        o = target.forward(mx.array([draft_ids[:w]]), cache, taps=taps)
        mx.eval([o.logits] + ([o.hidden] if o.hidden is not None else []))
        dt = clock.since(t)
        target.trim(cache, w)
        return dt

    plain_cache: list = []

    def plain(n: int = PLAIN_STEPS) -> float:
        """Seconds per step of n pipelined plain steps (greedy), as decode/loop.py takes them, on a
        cache of their own that each call extends (a recurrent layer cannot roll them back). The
        clock starts once the pipeline is primed (a step in flight while the one before it is read
        back), so it holds n + 1 steps of steady state and not the first step's unhidden build."""
        if not plain_cache:
            plain_cache.extend(target.make_cache())
            mx.eval(target.forward(mx.array([ctx]), plain_cache, taps=taps, last_only=True).logits)
        pc = plain_cache
        t = None
        tok, prev = mx.array([draft_ids[0]], dtype=mx.int32), None
        for _ in range(n + 2):
            o = target.forward(tok[None], pc, taps=taps)
            nxt = mx.argmax(o.logits[0, -1:], axis=-1).astype(mx.int32)
            mx.async_eval([nxt] + ([o.hidden] if o.hidden is not None else []))
            if prev is not None:
                prev.item()
                if t is None:
                    t = clock()
            prev = tok = nxt
        prev.item()
        return clock.since(t) / (n + 1)

    def spent() -> float:
        return time.perf_counter() - t_start

    verify(1)
    best: dict[int, float] = {}
    for w in WIDTHS:
        if len(best) >= 2 and spent() > budget_s * 0.5:  # two widths at least: a slope
            break
        if getattr(target, "compiled_decode", None) is not None:
            verify(w)  # a width's first step traces its graph (models/compiled_decode.py): untimed
        best[w] = verify(w)
        t1 = best[1]
        if w in (4, 8, 16, 32) and best[w] >= LINEAR * w * t1:
            break  # linear already: wider verifies cannot pay; extrapolate the rest
    draft = (
        _DraftTimer(drafter, target, ctx, prompt_hidden) if drafter is not None and prompt_hidden is not None else None
    )
    if draft is not None:
        draft.time()  # ingests the whole context (and traces a compiled pass): untimed
        draft.time()  # a one-row ingest's first use (MLX-CUDA compiles its kernels): untimed
    t_plain = plain()
    for _ in range(4):  # more sweeps, narrow widths first: each stops where the budget would run out
        if spent() > budget_s:
            break
        for w in sorted(best):
            if spent() + best[w] > budget_s:
                break
            best[w] = min(best[w], verify(w))
        if spent() + (PLAIN_STEPS + 2) * t_plain <= budget_s:  # plain() runs two steps more than it times
            t_plain = min(t_plain, plain())
        if draft is not None and spent() + (draft.best if draft.timed else 0.0) <= budget_s:
            draft.time()
    while draft is not None and draft.timed < DRAFT_SAMPLES:  # a sweep cut short by the budget left few
        draft.time()
    widths = sorted(best)
    share = others.share()
    return Costs(
        widths,
        [best[w] for w in widths],
        draft.best if draft else None,
        key_for(target, drafter),
        round(spent(), 3),
        t_plain=t_plain,
        settled=share is None or share <= OTHERS_MAX,
        others_share=None if share is None else round(share, 3),
    )


def merged(old: Costs, new: Costs) -> Costs:
    """A new measurement of `old`'s key with each point at the faster of the two: a busy spell
    only ever slows a measurement down. Settled when the new one is."""

    def faster(a, b):
        return b if a is None else a if b is None else min(a, b)

    before = dict(zip(old.widths, old.t_verify))
    return Costs(
        list(new.widths),
        [min(t, before.get(w, t)) for w, t in zip(new.widths, new.t_verify)],
        faster(new.t_draft, old.t_draft),
        new.key,
        round(old.measured_s + new.measured_s, 3),
        "measured",
        faster(new.t_plain, old.t_plain),
        settled=new.settled,
        others_share=new.others_share,
        measures=old.measures + 1,
    )


class _DraftTimer:
    """Times one drafter round: ingest one context row and draft a full block."""

    def __init__(self, drafter, target, ctx, prompt_hidden):
        from ..models import compiled_draft
        from .drafting import DrafterProposer

        self.drafter = drafter
        compiled = compiled_draft.for_drafter(drafter)
        if compiled is not None:  # time the compiled pass a drafter that drafts runs (after its first few)
            compiled.eager = compiled_draft.EAGER_PASSES
        self.prop = DrafterProposer(drafter, lookup_drafts=False)
        self.prop.begin(target, ctx, prompt_hidden)
        self.history = list(ctx) + [1]  # the anchor: the first token after the prompt
        self.row = prompt_hidden[-1:]
        self.calls = 0
        self.timed = 0
        self.best = float("inf")

    def time(self) -> None:
        clock = _Clock()
        t = clock()
        d = self.prop.propose(self.history, self.drafter.block_drafts, None)
        tokens = d.read()  # a draft left on the device is timed to its end
        dt = clock.since(t)
        if self.calls >= 2:  # the first two pay once-per-process costs (measure())
            self.best = min(self.best, dt)
            self.timed += 1
        self.calls += 1
        self.prop.observe(len(tokens), 0, self.row)
        self.history.append(tokens[0] if tokens else 1)


def load_cached(key: dict) -> Costs | None:
    from ..paths import read_fact

    data = read_fact("calibration", key)
    try:
        c = Costs(
            **{k: data[k] for k in ("widths", "t_verify", "t_draft", "measured_s", "t_plain")},
            key=key,
            settled=bool(data.get("settled", True)),  # a curve stored before the field: taken as settled
            others_share=data.get("others_share"),
            measures=int(data.get("measures", 1)),
        )
    except (KeyError, TypeError):  # nothing stored (None), or another layout
        return None
    c.origin = "disk"
    return c


def store(c: Costs) -> None:
    """Keep `c` under the cache root (paths.write_fact: a read-only cache only means it is measured again)."""
    from ..paths import write_fact

    write_fact("calibration", c.key, c.to_json())


_memo: dict[str, Costs] = {}  # the key, as JSON -> its curves


def costs_for(target, drafter=None) -> Costs | None:
    """The cost curves for this target (and drafter) on this machine: memoized per process, read
    from disk (measured again and merged while unsettled), else measured and stored. None when
    MLX_DSPARK_CALIBRATION=off."""
    m = mode()
    if m == "off":
        return None
    key = key_for(target, drafter)
    memo = json.dumps(key, sort_keys=True, default=str)
    if m == "auto" and memo in _memo:
        return _memo[memo]
    c = load_cached(key) if m == "auto" else None
    if c is None:
        c = measure(target, drafter)
        store(c)
    elif not c.settled and c.measures < MEASURES_MAX:  # measured on a busy machine: again, merged
        c = merged(c, measure(target, drafter))
        store(c)
    _memo[memo] = c
    return c
