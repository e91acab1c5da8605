"""Parameters stored as the transpose of the model's (AOQConfig.stored_transposed).

gpt-oss's experts hold [E, in, out] parameters (x @ w[e]); transformers' Mxfp4 checkpoints
quantize them in MX blocks along "in", so `hf-aoq convert` stores each as the MXTensor of the
[E, out, in] matrix, named in `stored_transposed`. Loading one gives the module the
`TransposedExperts` view of it ([E, in, out], what the module expects; grouped_mm and bmm run it
expert by expert on the kernels, as linear weights); saving stores the tensor under the view,
and dequantizing gives the float parameter in the module's layout.
"""
from __future__ import annotations

import torch
from torch import nn

from ...core.errors import FormatError
from ...core.tensor import AOQTensor
from ...tensors.experts import TransposedExperts


def swapped(shape) -> tuple[int, ...]:
    shape = tuple(shape)
    return shape[:-2] + (shape[-1], shape[-2])


def expected_stored_shape(name: str, model_shape, transposed, source: str) -> tuple[int, ...]:
    """The shape the checkpoint must store for parameter `name` of shape `model_shape`."""
    if name not in transposed:
        return tuple(model_shape)
    if len(model_shape) != 3:
        raise FormatError(f"{source}: {name} is listed in quantization_config.stored_transposed, but the model's "
                          f"parameter has shape {tuple(model_shape)}; only 3-D fused experts are stored transposed")
    return swapped(model_shape)


def check_listed(transposed, stored: set[str], source: str) -> None:
    """Every name in stored_transposed must be a quantized tensor of the checkpoint."""
    missing = sorted(set(transposed) - stored)
    if missing:
        raise FormatError(f"{source}: quantization_config.stored_transposed names {missing[0]!r}, which the "
                          f"checkpoint does not store as a quantized tensor")


def as_parameter(tensor: AOQTensor, name: str) -> nn.Parameter:
    """The module's parameter: the view of `tensor` (the whole one, or this rank's experts under
    expert parallelism, tensor_parallel.local_shard)."""
    return nn.Parameter(TransposedExperts(tensor.place()), requires_grad=False)


def dequantized(tensor: AOQTensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The float parameter, in the module's layout."""
    return tensor.dequantize(dtype).transpose(-2, -1).contiguous()


def unwrap(value):
    """The stored tensor under a transposed view; anything else as it is."""
    return value.experts if isinstance(value, TransposedExperts) else value
