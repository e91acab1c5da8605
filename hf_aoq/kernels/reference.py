"""Reference kernels: dequantize, then the float op. Every type, packing and device; the yardstick."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import ANY, CANONICAL, register_kernel

TYPES = ("Int4Tensor", "Int4DQTensor", "Int8Tensor", "IntxTensor", "IntxDQTensor", "Float8Tensor", "MXTensor", "NVFP4Tensor", "FPxTensor",
         "Float8SemiSparseTensor")


def reference_linear(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    # Dynamic-activation types quantize the input too; the reference does the same in float.
    x = weight.simulate_input_quantization(x)
    b = None if bias is None else bias.to(x.dtype)
    return F.linear(x, weight.dequantize(x.dtype), b)


def reference_embedding(indices: torch.Tensor, weight, padding_idx=None) -> torch.Tensor:
    return F.embedding(indices, weight.dequantize(), padding_idx)


def rowgather_embedding(indices: torch.Tensor, weight, padding_idx=None) -> torch.Tensor:
    """Dequantize only the looked-up rows: rows are independent in every canonical layout."""
    rows = weight.select_rows(indices.reshape(-1))
    return rows.dequantize().reshape(*indices.shape, weight.shape[-1])


for _name in TYPES:
    register_kernel("linear", _name, "reference", backend="reference", priority=0, reads=(ANY,))(reference_linear)
    register_kernel("embedding", _name, "reference", backend="reference", priority=0, reads=(ANY,))(reference_embedding)
    register_kernel("embedding", _name, "rowgather", backend="any", priority=10, reads=(CANONICAL,))(
        rowgather_embedding
    )
