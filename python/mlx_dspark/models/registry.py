"""Target -> drafter pairs that `--mode auto` resolves without a `--drafter`.

Matching is quantization-agnostic: a target is known by its base model name, so
`Qwen/Qwen3-4B`, `mlx-community/Qwen3-4B-4bit`, `.../Qwen3-4B-8bit`, `.../Qwen3-4B-bf16` and
`Qwen/Qwen3-4B-MLX-4bit` all resolve the same drafters. A name match is confirmed against
the target's shape (family, hidden size, depth, vocabulary), so a renamed folder of another
model never picks up a drafter meant for something else.

The seed rows are the pairs DeepSeek (DeepSpec) and z-lab (the dflash
README) published. None is measured by mlx-dspark yet (`measured` is None): their figures will
come from users who can reach the hub (`mlx-dspark benchmark --json`). `--drafter` overrides
the registry; any compatible checkpoint runs through it without an entry here.

Our own drafters (distilled with `mlx-dspark distill`) are registered with what we measured and
the command that reproduces it (`measured`, `reproduce`). A drafter shipped as a folder under
python/mlx_dspark/assets/ with a `pair.json` beside its weights is registered by that file alone
(write_pair_file writes it: target name and shape, kind, packaging, figures, command); so is any
such folder named in MLX_DSPARK_PAIRS (folders separated by os.pathsep; a folder of drafter
folders works too), read at each lookup: a drafter you distilled and measured yourself.
"""

from __future__ import annotations

import json
import os
import re
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import UserError


@dataclass(frozen=True)
class Shape:
    families: tuple[str, ...]  # model_type values the target may report
    hidden_size: int
    num_layers: int
    vocab_size: int


@dataclass(frozen=True)
class Pair:
    target: str  # canonical base-model name (see canonical_name)
    kind: str  # dspark | dflash
    drafter: str  # HF repo id or folder; "" = not distributed: `make` says how to make it
    publisher: str
    packaging: str  # deepspec-dspark | deepspec-dflash | zlab-dflash
    block: int | None  # draft tokens per round at the full block (None: read from its config)
    shape: Shape
    measured: str | None = None  # our measurement (device, tok/s, accept length); None = not yet
    note: str = ""
    reproduce: str = ""  # the command that reproduces `measured`
    # Mean tokens committed per round (greedy, full block) per eval domain, as measured: what
    # `--mode auto` takes as the most this drafter can earn (decode/modes.py); () = not measured.
    accept: tuple[tuple[str, float], ...] = ()
    make: str = ""  # for a drafter not distributed: the commands that distill it (then MLX_DSPARK_PAIRS)


_QWEN3 = ("qwen3",)
_GEMMA4 = ("gemma4", "gemma4_text")
QWEN3_4B = Shape(_QWEN3, 2560, 36, 151936)
QWEN3_8B = Shape(_QWEN3, 4096, 36, 151936)
QWEN3_14B = Shape(_QWEN3, 5120, 40, 151936)
GEMMA4_12B = Shape(_GEMMA4, 3840, 48, 262144)
LLAMA31_8B = Shape(("llama",), 4096, 32, 128256)
SMOLLM2_135M = Shape(("llama",), 576, 30, 49152)
GEMMA3_270M = Shape(("gemma3_text",), 640, 18, 262144)
# Our own reference drafters for the demo target, distilled with `mlx-dspark distill`, shipped in the
# package (each folder's README holds how it was trained).
ASSETS = Path(__file__).resolve().parents[1] / "assets"
SMOLLM2_DSPARK = str(ASSETS / "dspark-smollm2-135m-instruct")
SMOLLM2_DFLASH = str(ASSETS / "dflash-smollm2-135m-instruct")
PAIR_FILE = "pair.json"
AUTO_KINDS = ("dspark", "dflash")  # the order in which --mode auto tries a target's registered drafters
ENV = "MLX_DSPARK_PAIRS"

_DEEPSEEK = "DeepSeek (DeepSpec)"
_ZLAB = "z-lab"
UNMEASURED = "published pair; not yet measured by mlx-dspark"

_OURS: tuple[Pair, ...] = (
    Pair(
        "smollm2-135m-instruct",
        "dspark",
        SMOLLM2_DSPARK,
        "mlx-dspark (distill)",
        "deepspec-dspark",
        7,
        SMOLLM2_135M,
        measured="CPU float32: accept 3.20 humaneval, 3.51 mbpp, 2.32 mt-bench; code 2.36x greedy "
        "(bench/results/dspark-cpu.md)",
        reproduce="python bench/bench_dspark.py --dtype float32 --samples 20 --skip-speed (acceptance); "
        "python bench/bench_dspark.py --dtype float32 --skip-accept --speed-prompts 3 (speed)",
        note="the demo target's drafter (mlx-dspark distill; its README says how it "
        "was trained); 5 layers stored 8-bit, Markov rank 48, embed/lm_head bound to the target's",
        accept=(("humaneval", 3.20), ("mbpp", 3.51), ("mt-bench", 2.32)),
    ),
    # Auto tries DSpark pairs first (AUTO_KINDS); --mode dflash takes this one.
    Pair(
        "smollm2-135m-instruct",
        "dflash",
        SMOLLM2_DFLASH,
        "mlx-dspark (distill)",
        "zlab-dflash",
        15,
        SMOLLM2_135M,
        measured="CPU float32: accept 2.72 humaneval, 2.79 mbpp, 2.17 mt-bench (full block, 8-bit drafter) "
        "(bench/results/dflash-cpu.md)",
        reproduce="python bench/bench_dflash.py --dtype float32 --drafter "
        "python/mlx_dspark/assets/dflash-smollm2-135m-instruct --samples 10 --max-new-tokens 128",
        note="the demo target's DFlash drafter (mlx-dspark distill --kind dflash; its README says how it "
        "was trained); z-lab layout, block 16, 5 layers stored 8-bit, embed/lm_head bound to the target's",
        accept=(("humaneval", 2.72), ("mbpp", 2.79), ("mt-bench", 2.17)),
    ),
    # Not distributed (README, "Repository: weights": only the demo target's drafters are in git):
    # listed with what we measured and the commands that make it; a user's own copy registers
    # through its pair.json (MLX_DSPARK_PAIRS=DIR) and then runs in auto mode.
    Pair(
        "gemma-3-270m",
        "dspark",
        "",
        "mlx-dspark (distill)",
        "deepspec-dspark",
        7,
        GEMMA3_270M,
        measured="CPU float32: accept 2.72 humaneval, 2.89 mbpp; H100 bf16: 2.97, 3.10 (greedy, full block, "
        "10 eval prompts per domain as raw code; lossless on all 20, and past the 512-token window) "
        "(bench/results/gemma-dspark.md)",
        reproduce="python bench/bench_dflash.py --model gemma-3-270m-q4_k_m.gguf --dtype float32 --drafter DIR "
        "--bits 16 --raw-code --domains humaneval mbpp --samples 10 --max-new-tokens 128 --register",
        note="the base model (no chat template): prompts as raw code (generate --no-chat-template); "
        "4 layers, block 7, draft vocabulary 4839 tokens, 53 MB stored 8-bit",
        accept=(("humaneval", 2.72), ("mbpp", 2.89)),
        make="bench/h200_gemma_dspark.sh on one GPU, three calls: `setup gen` (BUDGET=330), `train` "
        "(BUDGET=470), `more` (BUDGET=470 MORE_FRAC=63): 1.09M answer tokens, 3264 + 2412 steps (~15 GPU "
        "minutes); then MLX_DSPARK_PAIRS=DIR registers it (the measure's --register writes its pair.json)",
    ),
)
_PUBLISHED: tuple[Pair, ...] = (
    Pair("qwen3-4b", "dspark", "deepseek-ai/dspark_qwen3_4b_block7", _DEEPSEEK, "deepspec-dspark", 7, QWEN3_4B),
    Pair("qwen3-8b", "dspark", "deepseek-ai/dspark_qwen3_8b_block7", _DEEPSEEK, "deepspec-dspark", 7, QWEN3_8B),
    Pair("qwen3-14b", "dspark", "deepseek-ai/dspark_qwen3_14b_block7", _DEEPSEEK, "deepspec-dspark", 7, QWEN3_14B),
    Pair(
        "gemma-4-12b-it", "dspark", "deepseek-ai/dspark_gemma4_12b_block7", _DEEPSEEK, "deepspec-dspark", 7, GEMMA4_12B
    ),
    Pair("qwen3-4b", "dflash", "deepseek-ai/dflash_qwen3_4b_block7", _DEEPSEEK, "deepspec-dflash", 7, QWEN3_4B),
    Pair("qwen3-8b", "dflash", "deepseek-ai/dflash_qwen3_8b_block7", _DEEPSEEK, "deepspec-dflash", 7, QWEN3_8B),
    Pair("qwen3-14b", "dflash", "deepseek-ai/dflash_qwen3_14b_block7", _DEEPSEEK, "deepspec-dflash", 7, QWEN3_14B),
    Pair(
        "gemma-4-12b-it", "dflash", "deepseek-ai/dflash_gemma4_12b_block7", _DEEPSEEK, "deepspec-dflash", 7, GEMMA4_12B
    ),
    Pair(
        "qwen3-4b",
        "dflash",
        "z-lab/Qwen3-4B-DFlash-b16",
        _ZLAB,
        "zlab-dflash",
        15,
        QWEN3_4B,
        note="trained on non-thinking answers",
    ),
    Pair(
        "qwen3-8b",
        "dflash",
        "z-lab/Qwen3-8B-DFlash-b16",
        _ZLAB,
        "zlab-dflash",
        15,
        QWEN3_8B,
        note="trained on non-thinking answers",
    ),
    Pair(
        "llama-3.1-8b-instruct",
        "dflash",
        "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
        _ZLAB,
        "zlab-dflash",
        None,
        LLAMA31_8B,
        note="block size read from its config at load",
    ),
)


# ------------------------------------------------------------------- pair.json (our drafters)
def read_pair_file(folder) -> Pair:
    """The Pair a drafter folder's pair.json registers (the drafter is the folder itself)."""
    folder = Path(folder).expanduser().resolve()
    f = folder / PAIR_FILE
    try:
        d = json.loads(f.read_text())
        sh = d["shape"]
        shape = Shape(tuple(sh["families"]), int(sh["hidden_size"]), int(sh["num_layers"]), int(sh["vocab_size"]))
        if d["kind"] not in ("dspark", "dflash"):
            raise ValueError(f"kind must be dspark or dflash, not {d['kind']!r}")
        block = d.get("block")
        return Pair(
            str(d["target"]),
            d["kind"],
            str(folder),
            str(d.get("publisher") or "mlx-dspark (distill)"),
            str(d["packaging"]),
            int(block) if block is not None else None,
            shape,
            measured=d.get("measured") or None,
            note=str(d.get("note") or ""),
            reproduce=str(d.get("reproduce") or ""),
            accept=tuple((str(k), float(v)) for k, v in (d.get("accept") or {}).items()),
        )
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise UserError(f"registered drafter {f} is unreadable ({type(e).__name__}: {e}); fix or remove it") from None


def write_pair_file(
    folder,
    target,
    *,
    measured: str | None = None,
    reproduce: str = "",
    note: str = "",
    publisher: str = "",
    accept: dict | None = None,
) -> Path:
    """Register the drafter in `folder` for `target` (a loaded Target): pair.json with the target's
    canonical name and shape, the drafter's kind, packaging and drafts per round (from its own
    checkpoint), what was measured with the command that reproduces it, and the measured mean
    accepted length per domain (`accept`, greedy, full block)."""
    from .checkpoints import build_spec, read_config, tensor_shapes

    folder = Path(folder)
    spec = build_spec(folder, read_config(folder), tensor_shapes(folder))
    names = target_names(target)
    if not names:
        raise UserError("write_pair_file: the target has no name to register the drafter under")
    d = {
        "target": names[0],
        "kind": spec.kind,
        "packaging": spec.packaging,
        "block": spec.block_drafts,
        "shape": asdict(Shape((target.model_type,), target.hidden_size, target.num_layers, target.vocab_size)),
        "publisher": publisher or "mlx-dspark (distill)",
        "measured": measured,
        "reproduce": reproduce,
        "note": note,
        "accept": {str(k): round(float(v), 3) for k, v in (accept or {}).items()},
    }
    (folder / PAIR_FILE).write_text(json.dumps(d, indent=1) + "\n")
    return folder / PAIR_FILE


def _folders_with_pairs(root: Path) -> list[Path]:
    if (root / PAIR_FILE).is_file():
        return [root]
    return [p.parent for p in sorted(root.glob(f"*/{PAIR_FILE}")) if p.is_file()]


def _shipped() -> tuple[Pair, ...]:
    known = {p.drafter for p in _OURS}
    if not ASSETS.is_dir():
        return ()
    return tuple(read_pair_file(f) for f in _folders_with_pairs(ASSETS) if str(f.resolve()) not in known)


def extra_pairs() -> list[Pair]:
    """The pairs MLX_DSPARK_PAIRS registers (read at each call)."""
    out = []
    for part in os.environ.get(ENV, "").split(os.pathsep):
        if not part.strip():
            continue
        root = Path(part).expanduser()
        found = _folders_with_pairs(root) if root.is_dir() else []
        if not found:
            raise UserError(f"{ENV}: {root} holds no {PAIR_FILE} (a drafter folder with one, or a folder of them)")
        out += [read_pair_file(f) for f in found]
    return out


PAIRS: tuple[Pair, ...] = _OURS + _shipped() + _PUBLISHED


def all_pairs() -> list[Pair]:
    """Every registered pair: MLX_DSPARK_PAIRS's first, then the package's (ours, then published)."""
    return extra_pairs() + list(PAIRS)


def is_packaged(drafter: str) -> bool:
    """A drafter shipped inside the package (under assets/)."""
    try:
        return Path(drafter).resolve().parent == ASSETS
    except (OSError, ValueError):
        return False


# Trailing name parts that only say how a checkpoint is stored, never which model it is.
_STORAGE_SUFFIX = re.compile(
    r"[-_.](gguf|mlx|\d+bit|\d+-bit|bf16|fp16|f16|fp32|f32|float16|bfloat16|float32|qat|dwq|awq|gptq|mxfp4|nvfp4|"
    r"q\d(_[a-z0-9]+)*|int\d|w\d+a\d+)$",
    re.IGNORECASE,
)


def canonical_name(name: str) -> str:
    """Base-model name of a repo id, folder or HF cache path, lowercased, storage suffixes off.

    'mlx-community/Qwen3-4B-4bit' -> 'qwen3-4b'; '.../models--Qwen--Qwen3-8B/snapshots/<sha>' -> 'qwen3-8b'."""
    s = str(name).strip().rstrip("/")
    m = re.search(r"models--[^/]+?--([^/]+)", s)
    if m:
        s = m.group(1)
    else:
        s = Path(s).name if "/" in s or "\\" in s else s
    s = s.lower()
    while True:
        t = _STORAGE_SUFFIX.sub("", s)
        if t == s:
            return s
        s = t


def _converted_from(source: str) -> str:
    """The GGUF file a converted folder came from (`convert` and the conversion cache record it
    in gguf_source.json), so a converted folder keeps the pairing of its original."""
    try:
        info = json.loads((Path(source).expanduser() / "gguf_source.json").read_text())
        return Path(str(info.get("source") or "")).name
    except (OSError, ValueError, TypeError, AttributeError):
        return ""


def target_names(target) -> list[str]:
    """The names a loaded Target is known by (source, folder, config name, converted-from file)."""
    names = []
    source = getattr(target, "source", "") or ""
    for n in (
        source,
        getattr(target, "name", ""),
        (getattr(target, "config", None) or {}).get("_name_or_path", ""),
        _converted_from(source) if source else "",
    ):
        if n:
            c = canonical_name(n)
            if c and c not in names:
                names.append(c)
    return names


def shape_matches(shape: Shape, target) -> bool:
    return (
        getattr(target, "model_type", "") in shape.families
        and target.hidden_size == shape.hidden_size
        and target.num_layers == shape.num_layers
        and target.vocab_size == shape.vocab_size
    )


def pairs_for(target, kind: str | None = None) -> list[Pair]:
    """Registered pairs for a loaded target (name and shape must both match), in registry order;
    a pair whose drafter is not distributed has nothing to load and is left out."""
    names = target_names(target)
    return [
        p
        for p in all_pairs()
        if p.drafter and p.target in names and (kind is None or p.kind == kind) and shape_matches(p.shape, target)
    ]


def typical_acceptance(drafter_source: str) -> float | None:
    """The median over measured domains of the mean accepted length per round (greedy, full
    block) of the registered pair whose drafter is `drafter_source` (a folder or repo id): what it
    earns on content of unknown kind. None if unmeasured."""

    def same(a: str, b: str) -> bool:
        if a == b:
            return True
        try:
            return Path(a).expanduser().resolve() == Path(b).expanduser().resolve() and Path(a).exists()
        except (OSError, ValueError):
            return False

    got = [
        v for p in all_pairs() if p.accept and p.drafter and same(p.drafter, str(drafter_source)) for _, v in p.accept
    ]
    return statistics.median(got) if got else None


def pairs_for_name(name: str, kind: str | None = None) -> list[Pair]:
    c = canonical_name(name)
    return [p for p in all_pairs() if p.target == c and (kind is None or p.kind == kind)]


def table() -> list[dict]:
    return [
        {
            "target": p.target,
            "mode": p.kind,
            "drafter": p.drafter,
            "publisher": p.publisher,
            "packaging": p.packaging,
            "drafts_per_round": p.block,
            "measured": p.measured,
            "status": p.measured or UNMEASURED,
            "note": p.note,
            "reproduce": p.reproduce,
            "make": p.make,
            "accept": dict(p.accept),
        }
        for p in all_pairs()
    ]
