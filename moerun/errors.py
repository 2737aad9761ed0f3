"""The one error type users see: a clear sentence, no traceback (unless --debug)."""


class MoerunError(Exception):
    """A problem with the user's input or files, described in one line."""
