"""The base tensor class, quantization primitives and granularities. Knows nothing of transformers."""
from .errors import AOQError, FormatError
from .granularity import PerGroup, PerRow, PerTensor
from .tensor import AOQTensor

__all__ = ["AOQError", "FormatError", "AOQTensor", "PerGroup", "PerRow", "PerTensor"]
