"""Imported first by every bench script: which mlx_dspark to measure.

The installed package when there is one (`pip install .` or `-e .`): it carries the native
extension, so the figures are the ones users get. Otherwise this checkout's python/, on the
pure-MLX kernels (a NativeFallbackWarning says so). Inserting python/ unconditionally would
shadow an installed package and silently lose its extension.

A non-editable install is a copy: once this checkout changes (code, or the shipped drafter in
assets/), it measures the old one. Such a copy is named on stderr with the files that differ.
"""

import filecmp
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "python" / "mlx_dspark"
CHECKED = (".py", ".json", ".safetensors")


def stale_files(installed: Path, source: Path = SOURCE) -> list[str]:
    """The files of `source` (code, configs, weights) that `installed` lacks or holds other bytes of."""
    out = []
    for f in sorted(source.rglob("*")):
        if f.is_file() and f.suffix in CHECKED and "__pycache__" not in f.parts:
            g = installed / f.relative_to(source)
            if not g.is_file() or not filecmp.cmp(f, g, shallow=False):
                out.append(f.relative_to(source).as_posix())
    return out


try:
    import mlx_dspark
except ImportError:
    sys.path.insert(0, str(ROOT / "python"))
else:
    _here = Path(mlx_dspark.__file__).resolve().parent
    if _here != SOURCE and SOURCE.is_dir():
        _stale = stale_files(_here)
        if _stale:
            more = f" and {len(_stale) - 4} more files" if len(_stale) > 4 else ""
            print(
                f"bench: the installed mlx_dspark ({_here}) is not this checkout's: it differs in "
                f"{', '.join(_stale[:4])}{more}. These figures measure the installed copy; reinstall it "
                "(pip install . or pip install -e .) to measure this checkout.",
                file=sys.stderr,
                flush=True,
            )


PRECISIONS = ("bf16", "8", "4", "f32")


def load_precision(model: str | None, precision: str):
    """(target, tokenizer, model path) for a bench's --model / --precision: bf16 or float32 as
    loaded, 8 / 4 = bf16 quantized at load; the demo model when `model` is None."""
    import mlx_dspark as md

    if model is None:
        from mlx_dspark.models.demo import demo_model_path

        model = str(demo_model_path())
    dtype = "float32" if precision == "f32" else "bfloat16"
    quantize = int(precision) if precision in ("8", "4") else None
    target, tok = md.load_target(model, dtype=dtype, quantize=quantize)
    return target, tok, model
