"""Small pieces shared by the CPU and CUDA kernels (and the tensor types that feed them)."""
from __future__ import annotations

import torch

# The group sizes of Int4Tensor: what every int4 kernel takes (aten's CPU int4 and tinygemm, and
# hf_aoq's pairs layout), so that every int4 weight has a fast kernel. The one definition;
# tensors/int4.py and the backends import it.
INT4_GROUP_SIZES = (32, 64, 128, 256)

FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # activation dtypes the CPU kernels take
ALIGNMENT = 64  # bytes: what aten's CPU kernels assume of their operands (a fresh allocation's)


def rows(x: torch.Tensor) -> int:
    """The rows of an activation [..., K]: the product of its leading dims (0 when K is 0)."""
    k = x.shape[-1]
    return x.numel() // k if k else 0


def aligned_contiguous(t: torch.Tensor) -> torch.Tensor:
    """`t` if it is contiguous and starts on an ALIGNMENT boundary, else such a copy. Tensors read
    from a file view its bytes at whatever offset they have; aten's int8 CPU kernel crashes on
    those (SIGSEGV, torch 2.13), so the packings that feed it copy once, at placement."""
    if t.is_contiguous() and t.data_ptr() % ALIGNMENT == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def scale_and_zero(w) -> torch.Tensor:
    """An Int4Tensor's scale and zero as the [K/g, N, 2] tensor that aten's int4 kernels read.
    Both kernels compute `(q - 8) * scale + zero`, which is exactly hf_aoq's int4 convention."""
    zero = w.zero if w.zero is not None else torch.zeros_like(w.scale)
    return torch.stack([w.scale.t(), zero.t()], dim=-1).contiguous()


def quantize_int8_per_token(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes and float32 scales, one per row of a 2-D activation."""
    return quantize_int_per_token(x2, 127)


def quantize_int_per_token(x2: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric integer codes in [-qmax, qmax] (as int8) and float32 scales max|x| / qmax, one
    per row of a 2-D activation (int8 activations: qmax 127; int4: 7)."""
    xf = x2.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / qmax).clamp(min=1e-12)
    return torch.round(xf / scale).clamp_(-qmax, qmax).to(torch.int8), scale


def fake_quantize_int8_per_token_asymmetric(x2: torch.Tensor) -> torch.Tensor:
    """Asymmetric int8 per-token fake quantization of a 2-D activation, in x2's own dtype, as
    torchao's IntxUnpackedToInt8Tensor does it for activation_quantization
    "int8_asym_per_token": per row, lo = min(min x, 0), hi = max(max x, 0),
    scale = max((hi - lo) / 255, eps of the dtype), zero point
    zp = clamp(-128 - round(lo / scale), -128, 127), codes q = clamp(round(x * (1 / scale)) + zp,
    -128, 127) (round half to even), and back (q - zp) * scale. Every step is in x2's dtype
    (bf16 activations: bf16 scales), so the result is torchao's bit for bit."""
    zero = x2.new_zeros(())
    lo = torch.minimum(x2.amin(dim=-1, keepdim=True), zero)
    hi = torch.maximum(x2.amax(dim=-1, keepdim=True), zero)
    scale = ((hi - lo) / 255.0).clamp(min=torch.finfo(x2.dtype).eps)
    zp = (-128 - torch.round(lo / scale)).clamp(-128, 127).to(torch.int8)
    codes = (torch.round(x2 * (1.0 / scale)) + zp).clamp(-128, 127).to(torch.int8)
    return (codes.to(torch.int32) - zp.to(torch.int32)).to(x2.dtype) * scale


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
