"""`mlx-dspark serve`: the OpenAI and Anthropic APIs on one port."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from .common import add_decode_args, add_model_args, drafter_options, load_from_args, positive_int, sampling_from_args


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the OpenAI and Anthropic APIs on one port",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models (OpenAI) and "
        "/v1/messages (Anthropic) on one port, plus /health and /metrics.",
    )
    add_model_args(p)
    add_decode_args(p)
    g = p.add_argument_group("server")
    g.add_argument(
        "--host",
        default="127.0.0.1",
        help="bind address (default 127.0.0.1: this machine only; 0.0.0.0 serves the network)",
    )
    g.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    g.add_argument(
        "--api-key",
        default=None,
        help="require this key on every route (Bearer or x-api-key). Other users can read a command "
        "line: prefer the MLX_DSPARK_API_KEY environment variable",
    )
    g.add_argument(
        "--no-thinking", action="store_true", help="requests default to the chat template's non-thinking mode"
    )
    g.add_argument(
        "--context-window",
        type=positive_int,
        default=None,
        help="refuse prompt + max_tokens beyond this (default: the model's own window)",
    )
    g.add_argument(
        "--min-context-window",
        type=positive_int,
        default=None,
        metavar="N",
        help="without --context-window: the model's own window, or N where that is smaller (then as "
        "--context-window N: RoPE rescaled per --rope-scaling). `mlx-dspark claude --serve` passes 32768, "
        "which holds Claude Code's default prompt",
    )
    g.add_argument(
        "--rope-scaling",
        choices=["auto", "yarn", "linear", "none"],
        default="auto",
        help="a --context-window past the model's trained window rescales its RoPE positions: yarn, "
        "linear (position interpolation), or none (positions as trained: past them the model writes "
        "noise); auto (default) = yarn, unless the model scales its RoPE already. Said at start",
    )
    g.add_argument(
        "--mid-system",
        choices=["turn", "merge"],
        default="turn",
        help="a system entry after the first message (Claude Code sends one): a system turn in place "
        "where the chat template renders one (turn, default), or its text in the user turn next to it, "
        "ahead of the user's text (merge: small models trained on system-first chats then answer the "
        "request rather than continue the system text)",
    )
    g.add_argument(
        "--default-max-tokens",
        type=positive_int,
        default=4096,
        help="the token budget of an OpenAI request that sets none (default 4096)",
    )
    g.add_argument(
        "--model-alias",
        action="append",
        default=[],
        metavar="NAME",
        help="another model name requests may use (repeatable)",
    )
    g.add_argument("--max-body-mb", type=positive_int, default=32, help="largest request body (default 32 MiB)")
    g.add_argument(
        "--max-queue",
        type=positive_int,
        default=16,
        help="requests waiting for the engine before new ones get 429 (default 16)",
    )
    g.add_argument(
        "--max-batch",
        type=positive_int,
        default=4,
        help="requests that share each target forward (continuous batching; default 4, 1 = one at a time)",
    )
    g.add_argument(
        "--max-kv-mb",
        type=float,
        default=None,
        metavar="MB",
        help="KV cache budget of the running requests: a request that does not fit now waits, one that "
        "never fits is refused (default: no budget)",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds an idle keep-alive connection or a slow body read may take (default 120)",
    )
    g.add_argument(
        "--no-key-in-discovery",
        action="store_true",
        help="leave the key out of the discovery file (then `mlx-dspark claude` needs --api-key)",
    )
    g.add_argument("--no-warmup", action="store_true", help="skip the warm-up generation at start")
    g.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="prefill every prompt in full (default: a prompt that starts like an earlier "
        "conversation reuses its KV and prefills only the rest)",
    )
    g.add_argument(
        "--prefix-cache-slots",
        type=positive_int,
        default=2,
        help="conversations kept in RAM, most recently used first (default 2)",
    )
    g.add_argument(
        "--prefix-cache-max-ram-mb",
        type=float,
        default=None,
        help="RAM budget of the kept conversations (default: no budget beyond the slots)",
    )
    g.add_argument(
        "--prefix-cache-dir",
        default=None,
        metavar="DIR",
        help="write conversations pushed out of RAM here and read them back, also after a restart",
    )
    g.add_argument("--verbose", action="store_true", help="log every request")


def run(args) -> int:
    from .._version import __version__
    from ..errors import UserError
    from ..serve import discovery
    from ..serve.engine import Engine
    from ..serve.http import is_loopback_host
    from ..serve.metrics import Metrics
    from ..serve.server import make_server

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(name)s: %(message)s"
    )
    api_key = args.api_key or os.environ.get("MLX_DSPARK_API_KEY") or None
    if isinstance(args.max_draft, int) and args.max_draft < 0:
        raise UserError(f"--max-draft must be >= 0, got {args.max_draft}")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in 0..65535, got {args.port}")
    if args.max_kv_mb is not None and args.max_kv_mb <= 0:
        raise UserError(f"--max-kv-mb must be positive, got {args.max_kv_mb:g}")
    if args.timeout <= 0:
        raise UserError(f"--timeout must be positive, got {args.timeout}")
    loopback = is_loopback_host(args.host.lower())
    if not loopback and api_key is None:
        print(
            f"mlx-dspark serve: warning: binding {args.host} without --api-key: anyone who can reach this "
            "machine can use the model",
            file=sys.stderr,
        )
    sampling = sampling_from_args(args)
    if args.min_context_window and args.context_window is None:
        from ..models.loading import trained_window_of

        trained = trained_window_of(args.model, dtype=args.dtype, quantize=args.quantize)
        if trained is None or trained < args.min_context_window:
            args.context_window = args.min_context_window
    from .. import kernels

    kernels.expect_long_run()  # a server earns back the accept kernels' compile (CUDA)
    target, tokenizer, drafter = load_from_args(args)
    engine = Engine(
        target,
        tokenizer,
        drafter=drafter,
        mode=args.mode,
        max_draft=args.max_draft,
        drafter_options=drafter_options(args),
        lookup_long_draft=args.lookup_long_draft,
        max_queue=args.max_queue,
        aliases=args.model_alias,
        context_window=args.context_window,
        default_thinking=False if args.no_thinking else None,
        default_sampling=sampling,
        default_max_tokens=args.default_max_tokens,
        prefix_cache=_prefix_cache(args, target),
        max_batch=args.max_batch,
        max_kv_mb=args.max_kv_mb,
        mid_system=args.mid_system,
    )
    if args.context_window and engine.trained_context and args.context_window > engine.trained_context:
        print(f"mlx-dspark serve: warning: {_window_note(args, engine, target)}", file=sys.stderr)
    engine.metrics = Metrics(model=engine.model_id, mode=engine.resolved_mode, version=__version__)
    try:
        server = make_server(
            engine, args.host, args.port, api_key=api_key, max_body=args.max_body_mb << 20, idle_timeout=args.timeout
        )
    except OSError as e:
        raise UserError(
            f"cannot listen on {args.host}:{args.port} ({e.strerror or e}): pass another --port "
            "(is another server running? `mlx-dspark claude --print-env` lists what it finds)"
        ) from None
    stopping = threading.Event()

    def on_signal(signum, _frame):
        if not stopping.is_set():
            stopping.set()
            engine.stop_soon()  # a warm-up or request in flight is cancelled at its next round
            threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    engine.start()
    if not args.no_warmup:
        engine.warmup(stopping)
    path = None
    try:
        path = discovery.write(
            server.port, host=args.host, model=engine.model_id, api_key=api_key, store_key=not args.no_key_in_discovery
        )
    except OSError as e:
        print(
            f"mlx-dspark serve: warning: could not write the discovery file ({e}); `mlx-dspark claude` will need --url",
            file=sys.stderr,
        )
    window = engine.context_window or "unknown"
    print(
        f"mlx-dspark {__version__}: serving {engine.model_id} (mode {engine.resolved_mode}, context {window}) "
        f"at {server.url}\n  OpenAI:    {server.url}/v1\n  Anthropic: {server.url}  (Claude Code: mlx-dspark claude)"
        + ("\n  auth: API key required" if api_key else ""),
        file=sys.stderr,
        flush=True,
    )
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        discovery.remove(path)
        engine.stop(timeout=10.0)  # cancels the running and queued Jobs; their clients get a 503 / error frame
        server.wait_idle(3.0)  # let the handlers write those last frames
        server.server_close()
    print("mlx-dspark serve: stopped", file=sys.stderr, flush=True)
    sys.stdout.flush()
    # Exit without interpreter teardown: daemon handler threads and a prefill that outlived the
    # grace period must not meet C++ static destructors (that aborted with exit 134).
    os._exit(0)


def _window_note(args, engine, target) -> str:
    """What a --context-window past the trained one does to this model (models/rope.py)."""
    from ..models import rope

    head = (
        f"--context-window {args.context_window} is beyond the {engine.trained_context} tokens this model "
        "was trained for"
    )
    block = getattr(target, "rope_scaling", None)
    if block:
        return (
            f"{head}: its RoPE is scaled ({rope.describe(block)}, --rope-scaling {args.rope_scaling}), which "
            "changes its answers at every length a little; --rope-scaling none keeps the trained positions"
        )
    if args.rope_scaling == "none":
        why = "--rope-scaling none"
    elif getattr(target, "rope_scaling_skipped", None):
        why = "mlx-lm builds this family's RoPE without reading rope_scaling"
    else:
        why = f"it scales its RoPE already: {rope.own_scaling(target.config)}"
    return f"{head} and its RoPE is not rescaled ({why}): answers past that length may be noise"


def _prefix_cache(args, target):
    """The server's prefix cache, or None with --no-prefix-cache (or where it cannot run: said once)."""
    if args.no_prefix_cache:
        return None
    from ..serve.prefix_cache import PrefixCache

    spill = args.prefix_cache_dir
    block = getattr(target, "rope_scaling", None)
    if spill and block:  # entries of a rescaled model must never meet the unscaled model's (same weights)
        spill = os.path.join(spill, f"rope-{block['rope_type']}-x{block['factor']:g}")
    pc = PrefixCache(target, slots=args.prefix_cache_slots, max_ram_mb=args.prefix_cache_max_ram_mb, spill_dir=spill)
    if not pc.enabled:
        print(f"mlx-dspark serve: prefix cache off: {pc.off_reason}", file=sys.stderr)
        return None
    return pc
