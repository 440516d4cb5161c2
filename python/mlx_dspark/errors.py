"""Errors that reach a user as one line, without a traceback.

A message names the setting to change the way the user spells it: `option("drafter")` reads
`--drafter` when the command line is the surface (cli/main.py says so) and `drafter=` in the
Python API, so Python users are never told about flags they cannot pass."""

_surface = {"cli": False}

# Python keyword names that differ from the flag with dashes turned into underscores.
_PYTHON_NAMES = {"drafter-bits": "bits", "prompt": "prompt", "model": "model"}


class UserError(Exception):
    """Bad input or an unsupported setup: the message says what was wrong and what to do."""


def use_cli_names(on: bool = True) -> bool:
    """Name settings by their command-line flags (cli/main.py, for the length of a command);
    returns the previous setting."""
    previous, _surface["cli"] = _surface["cli"], on
    return previous


def option(flag: str, value=None) -> str:
    """`--flag [value]` on the command line, `keyword=[repr(value)]` in Python."""
    if _surface["cli"]:
        return f"--{flag}" if value is None else f"--{flag} {value}"
    name = _PYTHON_NAMES.get(flag, flag.replace("-", "_"))
    return f"{name}=" if value is None else f"{name}={value!r}"
