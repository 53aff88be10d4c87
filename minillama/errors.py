"""The one exception type the CLI turns into a single clear line and a non-zero exit, and the
helper that quotes what the user typed without echoing a 100 KB argument back at them."""

import math


class UserError(Exception):
    """Bad input from the user: the message says what is wrong and what to do (exit 1)."""


class UsageError(UserError):
    """A command line that cannot work whatever the files and the model hold: options out of range
    or at odds with each other, a missing argument (exit 2, as click's own usage errors)."""


def shown(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut to about `limit` characters with a note of how long it was."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f" ({len(str(value)):,} characters)" if isinstance(value, str) else ""
    return text[:limit] + "..." + size


def finite(value: float, what: str) -> float:
    """`value` if it is a finite number; a UserError naming `what` otherwise (nan, inf)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError(f"{what} must be a finite number, not {shown(value)}")
    return value
