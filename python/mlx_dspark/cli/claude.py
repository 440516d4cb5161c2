"""`mlx-dspark claude [-- claude args]`: run Claude Code against the local server.

It finds the running server (discovery file, else http://127.0.0.1:8080), builds the Claude Code
environment for the child process only, and replaces itself with `claude`. Nothing is written:
no shell profile, no settings file, no login.

With `--serve` it starts a server of its own first (`SERVE_DEFAULTS`: a window that holds Claude
Code's default prompt, its mid-conversation system entry merged into the user turn), runs Claude
Code as a child, and stops the server when Claude Code exits (its log goes to a file).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8080"
# Removed from the child: they would send a real Anthropic key to the local server, or route
# Claude Code to another provider.
DROP = ("ANTHROPIC_API_KEY", "CLAUDE_CODE_USE_BEDROCK", "CLAUDE_CODE_USE_VERTEX", "CLAUDE_CODE_USE_FOUNDRY")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "claude",
        help="run Claude Code on the local server",
        description="Find the running `mlx-dspark serve`, point Claude Code at it (for the launched "
        "process only) and hand over the terminal. Arguments after -- go to claude.",
    )
    p.add_argument("--url", help="the server (default: the running one found, else http://127.0.0.1:8080)")
    p.add_argument("--port", type=int, help="use the running server on this port")
    p.add_argument(
        "--api-key", help="the server's key (default: from the server's discovery file or MLX_DSPARK_API_KEY)"
    )
    p.add_argument("--model", help="the model name Claude Code sends (default: the server's)")
    p.add_argument("--claude", default="claude", help="the Claude Code executable (default: claude on PATH)")
    p.add_argument("--print-env", action="store_true", help="print shell exports instead of launching")
    p.add_argument(
        "--print-settings",
        action="store_true",
        help="print a project .claude/settings.local.json block instead of launching",
    )
    p.add_argument(
        "--serve",
        action="store_true",
        help="start a server for this session (" + " ".join(SERVE_DEFAULTS) + "), stop it when Claude Code exits",
    )
    p.add_argument("--serve-model", metavar="MODEL", help="with --serve: the model to serve (default: the demo model)")
    p.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="with --serve: one more `mlx-dspark serve` argument, repeatable (--serve-arg=--context-window=65536); "
        "those given win over the defaults",
    )
    p.add_argument("--serve-log", metavar="FILE", help="with --serve: the server's log (default: a temporary file)")
    p.add_argument("claude_args", nargs=argparse.REMAINDER, help="-- then arguments for claude")


def _opener():
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback never goes via a proxy


def _health(url: str, key: str | None) -> dict | int | None:
    """The server's /health, 401 when it wants a (different) key, None when nothing answers."""
    req = urllib.request.Request(url.rstrip("/") + "/health")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with _opener().open(req, timeout=5) as r:
            body = json.loads(r.read().decode())
            return body if isinstance(body, dict) and body.get("model") else None
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError):
        return None


def _url_of(info: dict) -> str:
    host = str(info.get("host") or "127.0.0.1")
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{info['port']}"


def locate(args) -> tuple[str, str | None, dict]:
    """(url, key, health) of the server to use, or a UserError saying what was tried."""
    from ..errors import UserError
    from ..serve import discovery

    key = args.api_key or os.environ.get("MLX_DSPARK_API_KEY") or None
    if args.url:
        candidates = [(args.url.rstrip("/"), key)]
    else:
        found = discovery.find()
        if args.port is not None:
            found = [f for f in found if f["port"] == args.port]
        candidates = [(_url_of(f), key or f.get("api_key")) for f in found]
        if not candidates:
            candidates = [(f"http://127.0.0.1:{args.port}" if args.port is not None else DEFAULT_URL, key)]
    live, refused = [], []
    for url, k in candidates:
        h = _health(url, k)
        if isinstance(h, dict):
            live.append((url, k, h))
        elif h == 401:
            refused.append(url)
    if live:
        if len(live) > 1:
            ports = ", ".join(u.rsplit(":", 1)[-1] for u, _, _ in live)
            print(
                f"mlx-dspark claude: several servers are running (ports {ports}); using {live[0][0]} "
                "(the newest): pass --port to choose",
                file=sys.stderr,
            )
        return live[0]
    if refused:
        raise UserError(f"the server at {refused[0]} needs an API key: pass --api-key KEY or set MLX_DSPARK_API_KEY")
    tried = ", ".join(u for u, _ in candidates)
    where = "" if args.url else f" (looked in {discovery.discovery_dir()} and at {tried})"
    raise UserError(
        f"no running mlx-dspark server found{where}: start one with `mlx-dspark serve --model MODEL`, or pass --url"
    )


def claude_env(url: str, key: str | None, model: str, window: int | None) -> dict[str, str]:
    """The variables Claude Code reads, for the child process only."""
    env = {
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_AUTH_TOKEN": key or "mlx-dspark",
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "CLAUDE_CODE_SUBAGENT_MODEL": model,
    }
    if window:
        # Claude Code asks for 32k output tokens by default, which alone overflows small windows.
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(min(32000, max(1024, int(window) // 4)))
    return env


# Defaults for the child that the user's own environment overrides. Claude Code gives up on a
# stream after 5 minutes without an event (pings do not count) and then resends the whole request:
# a CPU prefill of its ~20k-token prompt takes longer. The rest keeps all its traffic on the
# local server (no telemetry, error reports, update checks or other non-essential calls).
LOCAL_DEFAULTS = {
    "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "3600000",
    "API_TIMEOUT_MS": "3600000",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
}


# What `--serve` starts the server with (bench/results/claude-code-cpu.md): Claude Code's default
# prompt is ~20k tokens (24 tool schemas), so the window is at least 32768 (the demo model is
# trained for 8192: YaRN, --rope-scaling auto, holds it); its trailing mid-conversation system
# entry goes ahead of the request in the user turn (small models then answer the request instead
# of continuing the system text). Decoding is the server's default (greedy): --serve-arg changes it.
SERVE_DEFAULTS = ("--min-context-window", "32768", "--mid-system", "merge")


def serve_command(args) -> list[str]:
    """The `mlx-dspark serve` command line `--serve` runs (on a free loopback port)."""
    cmd = [sys.executable, "-m", "mlx_dspark", "serve", "--host", "127.0.0.1", "--port", "0"]
    if args.serve_model:
        cmd += ["--model", args.serve_model]
    given = {a.split("=", 1)[0] for a in args.serve_arg if a.startswith("--")}
    defaults = list(SERVE_DEFAULTS)
    if "--context-window" in given:
        defaults[0:2] = []
    cmd += defaults + list(args.serve_arg)  # argparse: the last of a repeated option wins
    return cmd


def start_server(args) -> tuple[subprocess.Popen, int, str]:
    """Start `serve_command(args)` in its own session (a Ctrl-C for Claude Code does not reach it)
    and wait until its discovery file names it. Returns (process, port, log path)."""
    from ..errors import UserError
    from ..serve import discovery

    if args.serve_log:
        log_path = os.path.abspath(args.serve_log)
        log = open(log_path, "ab")
    else:
        fd, log_path = tempfile.mkstemp(prefix="mlx-dspark-serve-", suffix=".log")
        log = os.fdopen(fd, "ab")
    cmd = serve_command(args)
    shown = " ".join(shlex.quote(c) for c in ["mlx-dspark", *cmd[3:]])
    print(f"mlx-dspark claude: starting `{shown}` (log: {log_path})", file=sys.stderr, flush=True)
    with log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    try:
        while True:
            mine = [f["port"] for f in discovery.find() if f.get("pid") == proc.pid]
            if mine:
                return proc, mine[0], log_path
            if proc.poll() is not None:
                with open(log_path, errors="replace") as f:
                    tail = "".join(f.readlines()[-8:])
                raise UserError(f"the server exited with status {proc.returncode} before it was ready:\n{tail}")
            time.sleep(0.25)
    except BaseException:  # Ctrl-C while it loads: never leave it running
        stop_server(proc)
        raise


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run(args) -> int:
    from ..errors import UserError

    extra = list(args.claude_args or [])
    if extra and extra[0] == "--":
        extra = extra[1:]
    if args.serve:
        if args.url or args.port is not None:
            raise UserError("--serve starts a server of its own: leave out --url and --port")
        if args.print_env or args.print_settings:
            raise UserError("--serve runs Claude Code with its own server: leave out --print-env / --print-settings")
        if shutil.which(args.claude) is None:
            raise UserError(
                f"`{args.claude}` was not found on PATH: install Claude Code (npm install -g @anthropic-ai/claude-code)"
            )
        proc, args.port, log_path = start_server(args)
        try:
            return launch(args, extra, child=True)
        finally:
            stop_server(proc)
            print(f"mlx-dspark claude: server stopped (log: {log_path})", file=sys.stderr, flush=True)
    return launch(args, extra)


def launch(args, extra: list[str], child: bool = False) -> int:
    """Point Claude Code at the located server: replace this process with it, or (`child`) run it
    as a child and return its exit status."""
    from ..errors import UserError

    url, key, health = locate(args)
    model = args.model or health["model"]
    env_add = claude_env(url, key, model, health.get("context_window"))
    for k, v in LOCAL_DEFAULTS.items():
        env_add[k] = os.environ.get(k, v)
    if os.environ.get("CLAUDE_CODE_MAX_OUTPUT_TOKENS"):  # the user's own choice wins
        env_add["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = os.environ["CLAUDE_CODE_MAX_OUTPUT_TOKENS"]
    if args.print_env:
        for k, v in env_add.items():
            print(f"export {k}={shlex.quote(v)}")
        print("unset " + " ".join(DROP))
        return 0
    if args.print_settings:
        print(
            "# for .claude/settings.local.json in your project (keep it out of version control: "
            "it holds the server key)",
            file=sys.stderr,
        )
        print(json.dumps({"env": env_add}, indent=2))
        return 0
    env = {k: v for k, v in os.environ.items() if k not in DROP}
    env.update(env_add)
    exe = shutil.which(args.claude, path=env.get("PATH"))
    if exe is None:
        raise UserError(
            f"`{args.claude}` was not found on PATH: install Claude Code "
            "(npm install -g @anthropic-ai/claude-code) or pass --claude /path/to/claude; "
            "--print-env shows the settings to use by hand"
        )
    print(f"mlx-dspark claude: {model} at {url}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    if child:
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # Claude Code handles Ctrl-C itself
        try:
            return subprocess.call([exe, *extra], env=env)
        finally:
            signal.signal(signal.SIGINT, old)
    os.execve(exe, [exe, *extra], env)
    return 0  # not reached
