"""One query token's attention on CPU: hf_aoq's decode-step kernel (csrc/attention.cpp), which
hf_aoq.decode_attention gives to transformers models as their attention at one query token.

aten's scaled_dot_product_attention takes 0.15-0.2 ms for one bf16 decode token of one layer at 56
cached positions and 0.6-0.8 ms at 300 (32 query heads over 4 KV heads, head size 64; 2 threads,
AMD EPYC Zen 4): over 22 layers 3-4 ms a token at short contexts, more than a tenth of an int4
model's. The kernel here took 0.012 ms and 0.05 ms on the same shapes (a tenth). It reads each KV
head once for the query heads that share it, sums in float32 and rounds once at the end; against
aten's bf16 attention (which rounds the probabilities to bf16 before the values' GEMM) it is the
closer of the two to a float32 reference.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import cpu_ext
from .cpu_dense import SIMD_EXT
from .registry import capable, opaque_op

DTYPES = (torch.bfloat16, torch.float32)


def _out(query, key, value, mask, scale):
    return query.new_empty((query.shape[0], 1, query.shape[1], value.shape[-1]))


@opaque_op("decode_attention_cpu", _out)
def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor],
                     scale: float) -> torch.Tensor:
    """softmax(query key^T scale + mask) value for query [B, H, 1, D] over key [B, Hk, L, D] and
    value [B, Hk, L, Dv] (query head h reads KV head h // (H // Hk)); mask None, bool (True:
    attend) or float (added; float32 or query's dtype), broadcastable to [B, H, 1, L]. Returns
    [B, 1, H, Dv]."""
    return cpu_ext.load().decode_attention(query, key, value, mask, scale)


def applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor]) -> bool:
    """Whether `decode_attention` takes this call: one query token, plain (not subclass) CPU tensors
    of one dtype in DTYPES with a contiguous last dimension, query heads a multiple of KV heads, a
    mask that is None or a 4-d bool, float32 or query-dtype tensor broadcastable to [B, H, 1, L], no gradient
    wanted, and hf_aoq's C++ extension built with its vector kernels."""
    if not (type(query) is torch.Tensor and type(key) is torch.Tensor and type(value) is torch.Tensor):
        return False
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.shape[2] != 1:
        return False
    if query.device.type != "cpu" or key.device.type != "cpu" or value.device.type != "cpu":
        return False
    if query.dtype not in DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    b, h, _, d = query.shape
    hk, length = key.shape[1], key.shape[2]
    if key.shape[0] != b or value.shape[0] != b or key.shape[3] != d or tuple(value.shape[1:3]) != (hk, length):
        return False
    if hk == 0 or h % hk or query.stride(3) != 1 or key.stride(3) != 1 or value.stride(3) != 1:
        return False
    if mask is not None:
        if type(mask) is not torch.Tensor or mask.dim() != 4 or mask.device.type != "cpu" \
                or mask.dtype not in (torch.bool, torch.float32, query.dtype):
            return False
        if any(m not in (1, n) for m, n in zip(mask.shape, (b, h, 1, length))):
            return False
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return False
    return capable((SIMD_EXT,), query.device)
