"""Errors that reach a user as one line, without a traceback."""


class UserError(Exception):
    """Bad input or an unsupported setup: the message says what was wrong and what to do."""
