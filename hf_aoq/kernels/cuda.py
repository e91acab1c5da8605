"""CUDA kernels: tinygemm int4, `_int_mm` int8, `_scaled_mm` float8, and the tinygemm packing.

Each row meets the contract of the aten kernel it calls, as aten's CUDA sources check it (the
meta functions check only part of it): tinygemm takes bf16 A only (other float activations are
cast to bf16 and back), `_int_mm` more than 16 rows and K, N multiples of 8, `_scaled_mm` K, N
multiples of 16, a row-major mat1 and a column-major mat2, never e5m2 x e5m2, and 2-D
[M, 1] x [1, N] scales for row-wise scaling (bf16 output). An empty batch (M = 0) returns an
empty output without launching anything. What the GPU and the torch build allow (compute
capability, torch version, NVIDIA rather than ROCm) are capabilities, probed once per device.
tests/kernels/test_cuda_contracts.py runs every path here on a CPU build (FakeTensorMode), and
tinygemm_layout.py is the oracle for the packing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.primitives import pack_int4, unpack_int4
from .common import FLOATS, INT4_GROUP_SIZES, int4_padded_k, pad_input, pad_int4_codes, scale_and_zero
from .nibbles import unpack_nibbles
from .registry import Packing, capability, capable, register_kernel, register_packing
from .tinygemm_layout import inner_k_tiles, tinygemm_pack, tinygemm_unpack
from .triton_kernels import quantize_input_fused, quantize_int8_per_token_fused, simulate_input_quantization_fused

aten = torch.ops.aten


def torch_at_least(version: str) -> bool:
    return torch.torch_version.TorchVersion(torch.__version__) >= version


def _nvidia(device) -> bool:
    return torch.version.hip is None


def _sm_at_least(major: int, minor: int):
    return lambda device: _nvidia(device) and tuple(torch.cuda.get_device_capability(device)) >= (major, minor)


# Probed once per GPU (see registry.capable). ROCm builds have other tinygemm tiles and float8
# "fnuz" formats, so these rows are NVIDIA's; on ROCm the reference kernels run.
TINYGEMM = capability(  # uint8 input to _convert_weight_to_int4pack: torch >= 2.5; mma.sync bf16: sm80
    "cuda:tinygemm", "cuda",
    lambda d: _sm_at_least(8, 0)(d) and torch_at_least("2.5") and hasattr(aten, "_weight_int4pack_mm"),
)
INT_MM = capability("cuda:int_mm", "cuda", lambda d: _sm_at_least(7, 5)(d) and hasattr(torch, "_int_mm"))
SCALED_MM = capability(  # per-tensor float8 scaling: sm89
    "cuda:scaled_mm", "cuda", lambda d: _sm_at_least(8, 9)(d) and torch_at_least("2.5") and hasattr(torch, "_scaled_mm")
)
SCALED_MM_ROWWISE = capability(  # row-wise scaling (CUTLASS on sm90, cuBLAS later): e4m3 x e4m3, bf16 out
    "cuda:scaled_mm_rowwise", "cuda",
    lambda d: _sm_at_least(9, 0)(d) and torch_at_least("2.5") and hasattr(torch, "_scaled_mm"),
)


def _tinygemm_layout_probe(device) -> bool:
    """Whether aten's packer writes the layout tinygemm_layout.py transcribes, on this GPU."""
    codes = torch.randint(0, 16, (16, 128), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    try:
        packed = aten._convert_weight_to_int4pack(((codes[:, 0::2] << 4) | codes[:, 1::2]).to(device), 4).cpu()
    except RuntimeError:
        return False
    return packed.dtype == torch.int32 and torch.equal(packed, tinygemm_pack(codes, 4))


# The layout is then undone directly instead of through a nibble probe (nibbles.py).
TINYGEMM_LAYOUT = capability("cuda:tinygemm_layout", "cuda", _tinygemm_layout_probe)


def _no_rows(x: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The output for an empty batch (an MoE expert without tokens): aten's kernels launch an
    empty grid (tinygemm) or refuse it."""
    return x.new_empty((*x.shape[:-1], n), dtype=dtype)


# ---------------------------------------------------------------------- int4 (tinygemm)
def _tinygemm_pack_fn(k: int):
    tiles = inner_k_tiles(k)

    def pack(codes: torch.Tensor) -> torch.Tensor:
        # tinygemm reads each byte high nibble first.
        codes = codes.to(torch.uint8)
        return aten._convert_weight_to_int4pack(((codes[:, 0::2] << 4) | codes[:, 1::2]).contiguous(), tiles)

    return pack


def _tinygemm_available(w) -> bool:
    n, k = w.shape
    return w.block_size[-1] in INT4_GROUP_SIZES and n % 8 == 0 and inner_k_tiles(int4_padded_k(w)) > 0


def pack_int4_for_tinygemm(w):
    kp = int4_padded_k(w)
    packed = _tinygemm_pack_fn(kp)(pad_int4_codes(unpack_int4(w.qdata), kp))
    # scale_and_zero keeps the canonical scale dtype so that unpacking is exact; the kernel
    # casts to bf16, which tinygemm requires.
    return w.replace(qdata=packed, scale=scale_and_zero(w), packing="cuda_tinygemm")


def unpack_int4_from_tinygemm(w):
    n, k = w.shape
    kp = int4_padded_k(w)
    if capable((TINYGEMM_LAYOUT,), w.qdata.device):
        codes = tinygemm_unpack(w.qdata, n, kp)[:, :k]
    else:
        codes = unpack_nibbles(w.qdata, n, kp, _tinygemm_pack_fn(kp))[:, :k]
    return w.replace(qdata=pack_int4(codes), scale=w.scale[..., 0].t().contiguous(), packing=None)


register_packing(
    Packing("cuda_tinygemm", "Int4Tensor", "cuda", 10, _tinygemm_available, pack_int4_for_tinygemm,
            unpack_int4_from_tinygemm, needs=(TINYGEMM,))
)


def _float_input(x, w) -> bool:
    return x.dtype in FLOATS


@register_kernel("linear", "Int4Tensor", "cuda_tinygemm", backend="cuda", priority=10, reads=("cuda_tinygemm",),
                 device="cuda", needs=(TINYGEMM,), when=_float_input)
def int4_tinygemm_linear(x, w, bias):
    """tinygemm reads bf16 activations only: fp16 and fp32 ones are cast to bf16 and the output
    back (the reference would unpack the weight on every call)."""
    n, k = w.shape
    x = simulate_input_quantization_fused(w, x)  # activation-quantized Int4Tensors: as the reference
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return _no_rows(x, n, x.dtype)
    sz = w.scale if w.scale.dtype == torch.bfloat16 else w.scale.to(torch.bfloat16)
    a = pad_input(x2.to(torch.bfloat16), int4_padded_k(w)).contiguous()
    y = aten._weight_int4pack_mm(a, w.qdata, w.block_size[-1], sz)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


# ---------------------------------------------------------------------- int8 dynamic (_int_mm)
INT_MM_MIN_ROWS = 17  # _int_mm needs more than 16 rows


def _int_mm_applies(x, w) -> bool:
    n, k = w.shape
    return (w.act_quant == "per_token" and tuple(w.block_size) == (1, k) and k % 8 == 0 and n % 8 == 0
            and x.dtype in FLOATS)


@register_kernel("linear", "Int8Tensor", "cuda_int_mm", backend="cuda", priority=10, device="cuda", needs=(INT_MM,),
                 when=_int_mm_applies)
def int8_dynamic_cuda_linear(x, w, bias):
    n, k = w.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0:
        return _no_rows(x, n, x.dtype)
    xq, x_scale = quantize_int8_per_token_fused(x2)  # one Triton kernel where triton runs
    if m < INT_MM_MIN_ROWS:  # padding rows cost nothing next to the weight read
        xq = F.pad(xq, (0, 0, 0, INT_MM_MIN_ROWS - m))
    acc = torch._int_mm(xq, w.qdata.t())[:m]
    y = acc.float() * x_scale * w.scale.reshape(1, -1).float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


# ---------------------------------------------------------------------- float8 dynamic (_scaled_mm)
def _scaled_mm_operands(x, w) -> bool:
    """What both float8 rows need: dynamic activations, K and N multiples of 16, a float input,
    and not e5m2 x e5m2 ("Multiplication of two Float8_e5m2 matrices is not supported")."""
    n, k = w.shape
    if w.act_quant is None or k % 16 or n % 16 or x.dtype not in FLOATS:
        return False
    return not (w.qdata.dtype == torch.float8_e5m2 and (w.act_dtype or w.qdata.dtype) == torch.float8_e5m2)


def _per_tensor_scaled_mm_applies(x, w) -> bool:
    return _scaled_mm_operands(x, w) and w.act_quant == "per_tensor" and tuple(w.block_size) == tuple(w.shape)


def _rowwise_scaled_mm_applies(x, w) -> bool:
    # Row-wise scaling takes e4m3 x e4m3 only, and one scale per output row of the weight.
    e4m3 = w.qdata.dtype == torch.float8_e4m3fn and w.act_dtype in (None, torch.float8_e4m3fn)
    return _scaled_mm_operands(x, w) and w.act_quant == "per_row" and e4m3 and tuple(w.block_size) == (1, w.shape[1])


def _scaled_mm_linear(x, w, bias, rowwise: bool):
    """Scaling follows the config (`act_quant`), never the scale's size: one activation row has
    a [1, 1] row-wise scale. A transposed weight (x @ W, addmm) is copied on each call to the
    column-major mat2 that `_scaled_mm` needs."""
    n, k = w.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0:
        return _no_rows(x, n, x.dtype)
    xq, x_scale = quantize_input_fused(w, x2)  # e4m3 per row: one Triton kernel where triton runs
    mat2 = w.qdata.t() if w.qdata.is_contiguous() else w.qdata.contiguous().t()
    if rowwise:
        scale_a = x_scale.float().reshape(m, 1).contiguous()
        scale_b = w.scale.float().reshape(1, n).contiguous()
        out_dtype = torch.bfloat16  # what every row-wise backend writes
    else:
        scale_a, scale_b = x_scale.float().reshape(()), w.scale.float().reshape(())
        out_dtype = x.dtype
    y = torch._scaled_mm(xq.contiguous(), mat2, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


@register_kernel("linear", "Float8Tensor", "cuda_scaled_mm_rowwise", backend="cuda", priority=10, device="cuda",
                 needs=(SCALED_MM_ROWWISE,), when=_rowwise_scaled_mm_applies)
def float8_rowwise_cuda_linear(x, w, bias):
    return _scaled_mm_linear(x, w, bias, rowwise=True)


@register_kernel("linear", "Float8Tensor", "cuda_scaled_mm", backend="cuda", priority=10, device="cuda",
                 needs=(SCALED_MM,), when=_per_tensor_scaled_mm_applies)
def float8_per_tensor_cuda_linear(x, w, bias):
    return _scaled_mm_linear(x, w, bias, rowwise=False)
