"""The error types hf_aoq raises for bad input, and `short`, how their messages quote it."""
from typing import Any


class AOQError(ValueError):
    """Bad input to a quantization routine: a bad weight, shape, dtype or option."""


class FormatError(AOQError):
    """A checkpoint or its metadata is malformed, truncated, or names something not allowed."""


def short(value: Any, limit: int = 80) -> str:
    """`repr(value)`, cut to `limit` characters: error messages quote untrusted input."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
