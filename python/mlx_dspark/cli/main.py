"""`mlx-dspark` entry point: one module per subcommand; parsing only, no logic here."""

from __future__ import annotations

import argparse
import importlib
import sys

from ..errors import UserError, use_cli_names

# name -> module under mlx_dspark.cli exposing add_parser(subparsers) and run(args) -> int
SUBCOMMANDS = {
    "generate": "generate",
    "serve": "serve",
    "benchmark": "benchmark",
    "models": "models",
    "doctor": "doctor",
    "claude": "claude",
    "distill": "distill",
    "convert": "convert",
}


def _load(name: str):
    try:
        return importlib.import_module(f"mlx_dspark.cli.{SUBCOMMANDS[name]}")
    except ModuleNotFoundError as e:
        if e.name == f"mlx_dspark.cli.{SUBCOMMANDS[name]}":
            return None
        raise


class Parser(argparse.ArgumentParser):
    """Usage errors in one line, without the usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="mlx-dspark", description="Lossless speculative decoding on MLX.")
    from .._version import __version__

    parser.add_argument("--version", action="version", version=f"mlx-dspark {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        mod = _load(name)
        if mod is not None:
            mod.add_parser(sub)
    return parser


COMPUTE_COMMANDS = {"generate", "serve", "benchmark", "distill", "doctor"}  # doctor: report what they get


def main(argv: list[str] | None = None) -> int:
    previous = use_cli_names(True)
    try:
        return _main(argv)
    finally:
        use_cli_names(previous)


def _main(argv: list[str] | None) -> int:
    from_shell = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    # The old flat form `mlx-dspark --model M --prompt P` maps to `generate`.
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        argv = ["generate"] + argv
    if from_shell and argv and argv[0] in COMPUTE_COMMANDS:
        from ..blas import maybe_reexec

        maybe_reexec(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(_load(args.command).run(args) or 0)
    except UserError as e:
        print(f"mlx-dspark {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
