"""GGUF import: a .gguf file -> an mlx-lm model folder (config.json, model.safetensors, tokenizer).

    convert_gguf(src, out, dtype=, quantize=)   write the folder (the `convert` subcommand)
    convert_gguf_cached(src, dtype=, quantize=) the same, once per (file hash, precision), in
                                                $MLX_DSPARK_CACHE/gguf (default ~/.cache/mlx-dspark)

Precision:
  * quantize None: every tensor becomes `dtype` (Q4_0/Q4_1/Q8_0/K-quants dequantized exactly as
    llama.cpp's reference code does, in float32, then cast).
  * quantize 4 or 8: Linear/Embedding weights become MLX affine-quantized. Q4_0/Q4_1/Q8_0 blocks
    that fit in that many bits are copied bit-exactly (group size 32); the rest are dequantized
    and re-quantized by MLX (group size 64). Scales are float32 on CPU, where MLX's quantized
    matmul crawls with half-precision scales.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ...errors import UserError, option
from ...paths import cache_root
from . import arch as archs
from . import quant as gq
from .reader import GGUFFile
from .tokenizer import transformers_version, write_tokenizer

CONVERTER_VERSION = 1  # bump when the converted layout changes: old cache entries are then ignored
DTYPE_NAMES = ("float32", "float16", "bfloat16")
SOURCE_FILE = "gguf_source.json"  # written into every converted folder: where it came from


# ---------------------------------------------------------------------------------- reading
def open_gguf(path: Path) -> GGUFFile:
    """The parsed file (metadata and tensor views). Missing, truncated or corrupt -> UserError."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"GGUF file {path} does not exist")
    return GGUFFile(path)


def check_tensors(reader, arch: str, source: str) -> None:
    """Refuse unsupported quant types and unknown tensor names, naming the first offender."""
    for t in reader.tensors:
        if t.tensor_type not in gq.SUPPORTED:
            raise UserError(
                f"{source}: tensor {t.name} uses GGML type {t.tensor_type.name}, which mlx-dspark "
                f"does not import (supported: {gq.supported_names()}); use a GGUF with one of those "
                "types (e.g. Q8_0, Q4_K_M) or an mlx-lm folder"
            )
        if t.name not in archs.CONFIG_ONLY and archs.tensor_rule(arch, t.name) is None:
            raise UserError(
                f"{source}: unexpected tensor {t.name!r} for architecture {arch}; "
                "this variant of the architecture is not supported"
            )


# ------------------------------------------------------------------------------- conversion
def _scale_dtype(dtype: str) -> str:
    import mlx.core as mx

    return "float32" if dtype == "float32" or mx.default_device() == mx.cpu else dtype


def _tensor(t, rule, cfg: dict, dtype: str, bits: int | None, scale_dtype: str):
    """One GGUF tensor -> {suffix: mx.array} ('' for a float weight; weight/scales/biases when
    quantized) and the quantization (group_size, bits) used, or None."""
    import mlx.core as mx

    mdt = getattr(mx, dtype)
    sdt = getattr(mx, scale_dtype)
    rows_cols = t.shape  # (rows, cols) for a matrix
    n_perm = {"q": cfg["num_attention_heads"], "k": cfg["num_key_value_heads"]}.get(rule.permute or "")

    def fix(a: np.ndarray) -> np.ndarray:
        return gq.permute_rows(a, n_perm) if n_perm else a

    cols = rows_cols[-1]
    if bits and rule.matrix and len(rows_cols) == 2:
        if t.tensor_type in gq.EXACT_AFFINE:
            exact = gq.exact_affine(t.data, t.tensor_type, bits)
            if exact is not None:
                w, s, b = (fix(x) for x in exact)
                return {"weight": mx.array(w), "scales": mx.array(s).astype(sdt), "biases": mx.array(b).astype(sdt)}, (
                    gq.GROUP,
                    bits,
                )
        group = 64 if cols % 64 == 0 else 32 if cols % 32 == 0 else 0
        if group:
            w, s, b = mx.quantize(mx.array(fix(gq.to_float32(t.data, t.tensor_type))), group_size=group, bits=bits)
            return {"weight": w, "scales": s.astype(sdt), "biases": b.astype(sdt)}, (group, bits)
    a = gq.to_float32(t.data, t.tensor_type).reshape(rows_cols)
    a = fix(a)
    if rule.minus_one:
        a = a - np.float32(1.0)
    return {"": mx.array(a).astype(mdt)}, None


def convert_tensors(reader, arch: str, cfg: dict, dtype: str, bits: int | None):
    """All weights in mlx-lm names, plus the per-layer quantization map (empty if none)."""
    import mlx.core as mx

    scale_dtype = _scale_dtype(dtype)
    weights: dict = {}
    qmap: dict = {}
    for t in reader.tensors:
        if t.name in archs.CONFIG_ONLY:
            continue
        hf, rule = archs.tensor_rule(arch, t.name)
        parts, q = _tensor(t, rule, cfg, dtype, bits, scale_dtype)
        base = hf[: -len(".weight")] if hf.endswith(".weight") else hf
        for suffix, arr in parts.items():
            weights[hf if suffix == "" else f"{base}.{suffix}"] = arr
        if q:
            qmap[base] = {"group_size": q[0], "bits": q[1], "mode": "affine"}
        mx.eval(list(parts.values()))
    return weights, qmap


def _validate_folder(folder: Path, source: str) -> None:
    """Load the folder lazily through mlx-lm: shapes and names must match its model class."""
    from mlx_lm.utils import load_model

    try:
        load_model(folder, lazy=True, strict=True)
    except Exception as e:
        raise UserError(
            f"{source}: the converted weights do not fit mlx-lm's model ({type(e).__name__}: {str(e)[:300]})"
        ) from None


def _check_options(dtype: str, quantize: int | None) -> int | None:
    if dtype not in DTYPE_NAMES:
        raise UserError(f"{option('dtype')} must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")
    if quantize not in (None, 0, 4, 8):
        raise UserError(f"{option('quantize')} must be 4 or 8, got {quantize}")
    return int(quantize) if quantize else None


def convert_gguf(
    src: Path, out: Path, *, dtype: str = "float32", quantize: int | None = None, sha256: str | None = None
) -> Path:
    """Write `src` as an mlx-lm model folder at `out` (which must not exist or be empty)."""
    import mlx.core as mx

    src, out = Path(src).expanduser(), Path(out).expanduser()
    bits = _check_options(dtype, quantize)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"output folder {out} already exists and is not empty; pick a new folder")
    reader = open_gguf(src)
    meta = reader.meta
    arch = archs.check_arch(meta.get("general.architecture"), str(src))
    check_tensors(reader, arch, str(src))
    by_name = {t.name: t for t in reader.tensors}
    shapes = {t.name: t.shape for t in reader.tensors}
    rope = by_name.get("rope_freqs.weight")
    cfg = archs.build_config(
        arch, meta, shapes, str(src), rope_freqs=(lambda: gq.to_float32(rope.data, rope.tensor_type)) if rope else None
    )
    started = time.perf_counter()
    weights, qmap = convert_tensors(reader, arch, cfg, dtype, bits)
    if bits:
        cfg["quantization"] = {"group_size": 64, "bits": bits, "mode": "affine", **qmap}
        cfg["quantization_config"] = cfg["quantization"]
    cfg["torch_dtype"] = dtype
    # The release whose converters write the tokenizer files below. Without it, transformers 5.0-5.17
    # take any local folder for a Mistral one and warn of "incorrect tokenization" at every load.
    cfg["transformers_version"] = transformers_version()

    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
        del weights
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        write_tokenizer(meta, out, str(src))
        info = {
            "source": str(src.resolve()),
            "sha256": sha256,
            "architecture": arch,
            "name": meta.get("general.name"),
            "dtype": dtype,
            "quantize": bits,
            "scale_dtype": _scale_dtype(dtype) if bits else None,
            "tensor_types": _type_counts(reader),
            "converter_version": CONVERTER_VERSION,
            "convert_s": round(time.perf_counter() - started, 3),
        }
        (out / SOURCE_FILE).write_text(json.dumps(info, indent=2))
        _validate_folder(out, str(src))
    except BaseException:  # leave no half-written folder behind
        for child in [out] if created else list(out.iterdir()):
            shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
        raise
    return out


def _type_counts(reader) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts


# ------------------------------------------------------------------------------------ cache
def _atomic_write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def sha256_of(path: Path) -> str:
    """sha256 of a file's bytes, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of a file, remembered by (path, size, mtime) in the cache so a second load skips it."""
    path = Path(path).resolve()
    st = path.stat()
    index_path = cache_root() / "gguf" / "hashes.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    hit = index.get(str(path))
    if hit and hit.get("size") == st.st_size and hit.get("mtime_ns") == st.st_mtime_ns:
        return hit["sha256"]
    digest = sha256_of(path)
    index = {k: v for k, v in index.items() if Path(k).exists()}
    index[str(path)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    try:
        _atomic_write_json(index_path, index)
    except OSError:
        pass  # a read-only cache only costs the re-hash
    return digest


def cache_dir_for(src: Path, dtype: str, quantize: int | None) -> Path:
    bits = _check_options(dtype, quantize)
    digest = file_sha256(src)
    q = f"q{bits}-s{_scale_dtype(dtype)}" if bits else "noq"
    return cache_root() / "gguf" / f"{digest[:20]}-v{CONVERTER_VERSION}-{dtype}-{q}"


def convert_gguf_cached(src: Path, *, dtype: str = "float32", quantize: int | None = None) -> Path:
    """The converted folder for `src` at this precision: from the cache, or converted once now."""
    src = Path(src).expanduser()
    if not src.is_file():
        raise UserError(f"GGUF file {src} does not exist")
    folder = cache_dir_for(src, dtype, quantize)
    if (folder / SOURCE_FILE).exists() and (folder / "model.safetensors").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"converting {src.name} to MLX ({dtype}{f', {quantize}-bit' if quantize else ''}) once, into {folder}",
        file=sys.stderr,
        flush=True,
    )
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".tmp-{folder.name}-"))
    try:
        convert_gguf(src, tmp, dtype=dtype, quantize=quantize, sha256=file_sha256(src))
        try:
            os.rename(tmp, folder)
        except OSError:  # another process finished first: keep theirs
            if not (folder / SOURCE_FILE).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def cached_conversions() -> list[dict]:
    """What the GGUF cache holds (for `models` / `doctor`)."""
    out = []
    for d in sorted((cache_root() / "gguf").glob("*-v*")):
        try:
            info = json.loads((d / SOURCE_FILE).read_text())
        except (OSError, ValueError):
            continue
        out.append({"path": str(d), **info})
    return out
