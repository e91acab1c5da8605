"""hf_aoq: quantize Hugging Face transformers models into PyTorch tensor subclasses."""
from .configs import (
    AOQBaseConfig,
    Float8DynamicActivationFloat8WeightConfig,
    Float8WeightOnlyConfig,
    FqnToConfig,
    Int4DQWeightOnlyConfig,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
)
from .core import AOQError, AOQTensor, FormatError, PerGroup, PerRow, PerTensor
from . import kernels
from .quantize import quantize_
from .tensors import Float8Tensor, Int4DQTensor, Int4Tensor, Int8Tensor

from ._version import __version__

__all__ = [
    "AOQBaseConfig",
    "AOQConfig",
    "AOQError",
    "AOQTensor",
    "Float8DynamicActivationFloat8WeightConfig",
    "Float8Tensor",
    "Float8WeightOnlyConfig",
    "FormatError",
    "FqnToConfig",
    "Int4DQTensor",
    "Int4DQWeightOnlyConfig",
    "Int4Tensor",
    "Int4WeightOnlyConfig",
    "Int8DynamicActivationInt8WeightConfig",
    "Int8Tensor",
    "Int8WeightOnlyConfig",
    "PerGroup",
    "PerRow",
    "PerTensor",
    "quantize_",
]

# Importing it registers AOQConfig and the "aoq" quantizer with transformers.
from .integrations.transformers import AOQConfig  # noqa: E402
