"""The error types hf_aoq raises for bad input."""


class AOQError(ValueError):
    """Bad input to a quantization routine: a bad weight, shape, dtype or option."""


class FormatError(AOQError):
    """A checkpoint or its metadata is malformed, truncated, or names something not allowed."""
