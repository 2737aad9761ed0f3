"""The one error type users see: a clear sentence, no traceback (unless --debug)."""


class MoerunError(Exception):
    """A problem with the user's input or files, described in one line."""


def one_line(e) -> str:
    """An exception's (or any) text folded onto one line, at most 300 characters: what an
    error message may quote of another error."""
    text = " ".join(str(e).split())
    return text if len(text) <= 300 else text[:297] + "..."


def short(v) -> str:
    """repr(v), cut short: what an error message quotes of a bad value."""
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def human_bytes(n: float) -> str:
    """A byte count as messages and reports write it: 512 B, 1.5 KiB, 3.2 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n}"
