"""`mlx-dspark serve` as a process (discovery file, clean exit) and the `mlx-dspark claude` launcher
with a fake `claude` on PATH: the environment it gets, the arguments passed through, and nothing
written under HOME."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serve_support import free_port, make_model

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key-123"


def tree(root: Path) -> dict:
    return (
        {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}
        if root.exists()
        else {}
    )


def only_the_servers_cache(listing: dict) -> bool:
    """Under HOME only the server's own cache may exist (e.g. its width-invariance verdict)."""
    return all(p == ".cache" or p.startswith(".cache/mlx-dspark") for p in listing)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = tmp_path_factory.mktemp("cli")
    home, run, fakebin = base / "home", base / "run", base / "bin"
    for d in (home, run, fakebin):
        d.mkdir()
    run.chmod(0o700)
    fake = fakebin / "claude"
    fake.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "record = {'argv': sys.argv[1:], 'env': dict(os.environ)}\n"
        "if os.environ.get('FAKE_CLAUDE_HEALTH'):\n"
        "    import urllib.request\n"
        "    op = urllib.request.build_opener(urllib.request.ProxyHandler({}))\n"
        "    record['health'] = json.load(op.open(os.environ['ANTHROPIC_BASE_URL'] + '/health', timeout=30))\n"
        "json.dump(record, open(os.environ['FAKE_CLAUDE_LOG'], 'w'))\n"
        "sys.exit(int(os.environ.get('FAKE_CLAUDE_RC', '0')))\n"
    )
    fake.chmod(0o755)
    e = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "MLX_DSPARK_", "CLAUDE_CODE_"))}
    e.update(
        HOME=str(home),
        XDG_RUNTIME_DIR=str(run),
        PYTHONPATH=str(ROOT / "python"),
        FAKE_CLAUDE_LOG=str(base / "claude.json"),
    )
    return {"base": base, "home": home, "run": run, "bin": fakebin, "env": e, "model": make_model(base)}


@pytest.fixture(scope="module")
def server(env):
    e = dict(env["env"], MLX_DSPARK_API_KEY=KEY)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_dspark", "serve", "--model", str(env["model"]), "--port", "0", "--no-warmup"],
        env=e,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    d = env["run"] / "mlx-dspark"
    t0 = time.monotonic()
    while not (d.exists() and list(d.glob("*.json"))):
        if proc.poll() is not None or time.monotonic() - t0 > 90:
            proc.kill()
            pytest.fail("server did not start:\n" + proc.stdout.read())
        time.sleep(0.1)
    info_file = next(d.glob("*.json"))
    yield {"proc": proc, "file": info_file, "info": json.loads(info_file.read_text())}
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def launcher(env, *args, extra_env=None, path_with_fake=True, timeout=60):
    e = dict(env["env"], **(extra_env or {}))
    if path_with_fake:
        e["PATH"] = f"{env['bin']}{os.pathsep}{e.get('PATH', '')}"
    else:
        e["PATH"] = str(Path(sys.executable).parent)  # python, but no claude
    return subprocess.run(
        [sys.executable, "-m", "mlx_dspark", "claude", *args], env=e, capture_output=True, text=True, timeout=timeout
    )


def test_launcher_serve_starts_and_stops_its_own_server(env):
    """--serve: a server of its own with Claude Code's window (at least 32768: the fixture is
    trained for 4096, so YaRN) and the mid-system entry merged; Claude Code runs as a child against
    it, its exit status is the launcher's, and the server is gone afterwards."""
    run = env["base"] / "serve-run"
    run.mkdir(mode=0o700, exist_ok=True)
    log = env["base"] / "serve.log"

    def serve(*args, **extra_env):
        common = ("--serve", "--serve-model", str(env["model"]), "--serve-arg=--no-warmup", "--serve-log", str(log))
        e = {"XDG_RUNTIME_DIR": str(run), "FAKE_CLAUDE_HEALTH": "1", **extra_env}
        return launcher(env, *common, *args, extra_env=e, timeout=180)

    r = serve("--", "-p", "Say hello", FAKE_CLAUDE_RC="3")
    assert r.returncode == 3, r.stderr + log.read_text()
    got = json.loads(Path(env["env"]["FAKE_CLAUDE_LOG"]).read_text())
    assert got["argv"] == ["-p", "Say hello"]
    h = got["health"]
    assert h["context_window"] == 32768 and h["mid_system"] == "merge", h
    assert "yarn" in json.dumps(h).lower(), h
    assert got["env"]["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "8192"  # a quarter of the window
    assert got["env"]["ANTHROPIC_BASE_URL"].startswith("http://127.0.0.1:")
    assert "--min-context-window 32768 --mid-system merge" in r.stderr and "server stopped" in r.stderr
    assert not list((run / "mlx-dspark").glob("*.json"))  # the server exited and took its discovery file
    assert "stopped" in log.read_text()

    # A window given by the user replaces the default one.
    r = serve("--serve-arg=--context-window=2048")
    assert r.returncode == 0, r.stderr
    got = json.loads(Path(env["env"]["FAKE_CLAUDE_LOG"]).read_text())
    assert got["health"]["context_window"] == 2048 and "--min-context-window" not in r.stderr


def test_discovery_file_is_private(server, env):
    info = server["info"]
    assert info["pid"] == server["proc"].pid and info["needs_key"] is True and info["api_key"] == KEY
    assert isinstance(info["port"], int) and info["port"] > 0
    assert stat.S_IMODE(server["file"].stat().st_mode) == 0o600
    assert stat.S_IMODE(server["file"].parent.stat().st_mode) == 0o700


def test_launcher_execs_claude_with_env_and_args(server, env):
    before = tree(env["home"])
    r = launcher(env, "--", "--continue", "-p", "fix the bug", extra_env={"ANTHROPIC_API_KEY": "sk-real-account"})
    assert r.returncode == 0, r.stderr
    got = json.loads(Path(env["env"]["FAKE_CLAUDE_LOG"]).read_text())
    assert got["argv"] == ["--continue", "-p", "fix the bug"]
    e = got["env"]
    port = server["info"]["port"]
    assert e["ANTHROPIC_BASE_URL"] == f"http://127.0.0.1:{port}"
    assert e["ANTHROPIC_AUTH_TOKEN"] == KEY
    assert e["ANTHROPIC_MODEL"] == e["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == server["info"]["model"]
    assert e["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "1024"  # a quarter of the fixture's 4096 window
    assert "ANTHROPIC_API_KEY" not in e  # the real key never reaches the local server
    assert e["FAKE_CLAUDE_LOG"] == env["env"]["FAKE_CLAUDE_LOG"]  # the rest of the environment passes through
    assert tree(env["home"]) == before  # the launcher writes nothing under HOME
    assert only_the_servers_cache(before)


def test_print_env_and_settings(server, env):
    r = launcher(env, "--print-env")
    assert r.returncode == 0, r.stderr
    port = server["info"]["port"]
    assert f"export ANTHROPIC_BASE_URL=http://127.0.0.1:{port}" in r.stdout
    assert f"export ANTHROPIC_AUTH_TOKEN={KEY}" in r.stdout and "unset ANTHROPIC_API_KEY" in r.stdout
    r = launcher(env, "--print-settings")
    settings = json.loads(r.stdout)
    assert settings["env"]["ANTHROPIC_BASE_URL"] == f"http://127.0.0.1:{port}"
    assert only_the_servers_cache(tree(env["home"]))


def test_clear_errors(server, env):
    r = launcher(env, path_with_fake=False)
    assert r.returncode == 2 and "was not found on PATH" in r.stderr
    r = launcher(env, "--api-key", "wrong", "--print-env")
    assert r.returncode == 2 and "needs an API key" in r.stderr
    empty = env["base"] / "empty-run"
    empty.mkdir(exist_ok=True)
    r = launcher(env, "--port", str(free_port()), extra_env={"XDG_RUNTIME_DIR": str(empty)})
    assert r.returncode == 2 and "no running mlx-dspark server found" in r.stderr and "mlx-dspark serve" in r.stderr


def test_server_answers_and_exits_cleanly(server, env):
    import openai

    port = server["info"]["port"]
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=30)
    r = c.chat.completions.create(
        model=server["info"]["model"], messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert r.usage.completion_tokens >= 1
    server["proc"].send_signal(signal.SIGTERM)
    assert server["proc"].wait(timeout=20) == 0
    assert not server["file"].exists()  # the discovery file goes with the server
