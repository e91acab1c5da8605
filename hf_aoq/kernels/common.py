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


# An Int4Tensor's last group may be partial (K not a multiple of g). aten's int4 kernels need
# whole groups, so the packings pad the codes with the midpoint code (8, weight value = zero)
# and the kernels pad the input with zeros: the padded columns add zero * 0 to every output.
INT4_PAD_CODE = 8


def int4_padded_k(w) -> int:
    """The input dimension rounded up to whole groups."""
    g = w.block_size[-1]
    return -(-w.shape[-1] // g) * g


def pad_int4_codes(codes: torch.Tensor, padded_k: int) -> torch.Tensor:
    k = codes.shape[-1]
    return codes if k == padded_k else torch.nn.functional.pad(codes, (0, padded_k - k), value=INT4_PAD_CODE)


def pad_input(x2: torch.Tensor, padded_k: int) -> torch.Tensor:
    k = x2.shape[-1]
    return x2 if k == padded_k else torch.nn.functional.pad(x2, (0, padded_k - k))
