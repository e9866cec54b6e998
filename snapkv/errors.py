"""The one first-line-of-an-error helper: rows, logs and CLI messages keep an error on one line."""

from __future__ import annotations


def first_line(err: BaseException) -> str:
    """First non-blank line of the error's message, else the exception type's name.

    A `KeyError`'s message is its key (`str(KeyError("x"))` would be `"'x'"` with quotes).
    """
    text = err.args[0] if isinstance(err, KeyError) and err.args else err
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()
    return type(err).__name__


def one_line(err: BaseException) -> str:
    """`Type: first line of the message` (the `error` column of a failed row)."""
    text = first_line(err)
    return text if text == type(err).__name__ else f"{type(err).__name__}: {text}"
