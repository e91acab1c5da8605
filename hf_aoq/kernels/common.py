"""Small pieces shared by the CPU and CUDA kernels."""
from __future__ import annotations

import torch


def scale_and_zero(w) -> torch.Tensor:
    """An Int4Tensor's scale and zero as the [K/g, N, 2] tensor that aten's int4 kernels read.
    Both kernels compute `(q - 8) * scale + zero`, which is exactly hf_aoq's int4 convention."""
    zero = w.zero if w.zero is not None else torch.zeros_like(w.scale)
    return torch.stack([w.scale.t(), zero.t()], dim=-1).contiguous()


def quantize_int8_per_token(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes and float32 scales, one per row of a 2-D activation."""
    xf = x2.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / 127).clamp(min=1e-12)
    return torch.round(xf / scale).clamp_(-127, 127).to(torch.int8), scale
