"""Rows of the kernel table that run Triton kernels (triton_jit.py), on CUDA devices where
triton is installed. This module does not import triton: the rows are always in the table, and
their capability says whether triton can run here.

The GEMVs read the canonical layouts, at up to TRITON_GEMV_MAX_ROWS rows. int4: placement packs
for tinygemm where that runs, so today the int4 rows serve the int4 weights tinygemm cannot take
(N not a multiple of 8, ROCm, torch < 2.5); whether they should replace tinygemm waits on GPU
figures (scripts/gpu_bench.py). int8 and float8 weight-only: the codes read in place instead of
the reference's dequantization to a float weight on every call. Int4DQ (no CUDA packing, so
always canonical there): each weight decoded in the kernel exactly as Int4DQTensor.dequantize
does, instead of the reference's dequantization on every call.

int4 and Int4DQ past the GEMV: the tiled GEMM (triton_gemm.py; bf16 and fp16 activations on
tensor cores) up to TRITON_GEMM_MAX_ROWS rows, and above that (or float32 activations) one
Triton pass that dequantizes the weight to x's dtype, then cuBLAS. Both limits are guesses until
scripts/gpu_bench.py's crossover rows are measured on a GPU.

e4m3 per-row activations (fp8-dyn, fp8-int4): one Triton kernel quantizes them, bit for bit as
torch does (quantize_input_fused, simulate_input_quantization_fused)."""
from __future__ import annotations

import importlib.util
from typing import Optional

import torch
import torch.nn.functional as F

from .common import FLOATS, quantize_int8_per_token, rows as _rows
from .registry import capability, capable, opaque_op, register_kernel


def _triton_runs(device) -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.version.hip is not None or tuple(torch.cuda.get_device_capability(device)) >= (8, 0)


TRITON = capability("cuda:triton", "cuda", _triton_runs)
TRITON_GEMV_MAX_ROWS = 8  # above this, the GEMM (int4, Int4DQ) or the reference (int8, float8)
TRITON_GEMM_MAX_ROWS = 64  # above this, one dequantization and cuBLAS
TENSOR_CORE_FLOATS = (torch.bfloat16, torch.float16)


def _gemv_rows(x, w) -> bool:
    return x.dtype in FLOATS and _rows(x) <= TRITON_GEMV_MAX_ROWS


def _gemm_rows(x, w) -> bool:
    return x.dtype in TENSOR_CORE_FLOATS and TRITON_GEMV_MAX_ROWS < _rows(x) <= TRITON_GEMM_MAX_ROWS


def _dequantize_rows(x, w) -> bool:
    """Checked after the GEMM's row: more rows than it takes, or float32 past the GEMV."""
    return x.dtype in FLOATS and _rows(x) > TRITON_GEMV_MAX_ROWS


def _contiguous(*tensors) -> bool:
    return all(t is None or t.is_contiguous() for t in tensors)


def _gemv_out(x2, qdata, scale, zero, bias, group_size, n, k):
    return x2.new_empty(x2.shape[0], n)


@opaque_op("int4_gemv_triton", _gemv_out)
def int4_gemv_op(
    x2: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor],
    bias: Optional[torch.Tensor], group_size: int, n: int, k: int,
) -> torch.Tensor:
    from .triton_jit import int4_gemv

    return int4_gemv(x2, qdata, scale, zero, bias, group_size, n, k)


def _int4_gemv_applies(x, w) -> bool:
    return _gemv_rows(x, w) and _contiguous(w.qdata, w.scale, w.zero)


@register_kernel("linear", "Int4Tensor", "triton_int4_gemv", backend="triton", priority=5, device="cuda",
                 needs=(TRITON,), when=_int4_gemv_applies)
def int4_triton_linear(x, w, bias):
    n, k = w.shape
    x = simulate_input_quantization_fused(w, x)  # activation-quantized Int4Tensors: as the reference
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = int4_gemv_op(x2, w.qdata, w.scale, w.zero, bias, w.block_size[-1], n, k)
    return y.reshape(*x.shape[:-1], n)


# ---------------------------------------------------------------------- Int4DQ
@opaque_op("int4dq_gemv_triton", lambda x2, qdata, gparams, rparams, tparams, lut, bias, group_size, n, k:
           x2.new_empty(x2.shape[0], n))
def int4dq_gemv_op(
    x2: torch.Tensor, qdata: torch.Tensor, gparams: torch.Tensor, rparams: torch.Tensor, tparams: torch.Tensor,
    lut: torch.Tensor, bias: Optional[torch.Tensor], group_size: int, n: int, k: int,
) -> torch.Tensor:
    from .triton_jit import int4dq_gemv

    return int4dq_gemv(x2, qdata, gparams, rparams, tparams, lut, bias, group_size, n, k)


_LUTS: dict = {}


def _lut_on(device: torch.device) -> torch.Tensor:
    """The Int4DQ format's 32 mantissas on `device`, copied there once."""
    from ..tensors.int4dq import LUT

    if device not in _LUTS:
        _LUTS[device] = LUT.to(device)
    return _LUTS[device]


def _int4dq_gemv_applies(x, w) -> bool:
    return _gemv_rows(x, w) and _contiguous(w.qdata, w.gparams, w.rparams, w.tparams)


@register_kernel("linear", "Int4DQTensor", "triton_int4dq_gemv", backend="triton", priority=5, device="cuda",
                 needs=(TRITON,), when=_int4dq_gemv_applies)
def int4dq_triton_linear(x, w, bias):
    n, k = w.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = int4dq_gemv_op(x2, w.qdata, w.gparams, w.rparams, w.tparams, _lut_on(x2.device), bias, w.block_size[-1],
                       n, k)
    return y.reshape(*x.shape[:-1], n)


# ---------------------------------------------------------------------- int4 / Int4DQ past the GEMV
def _linear_2d(x, n: int, k: int, fn):
    """fn(x2) on x as [M, K] with unit stride along K, back to x's leading shape."""
    x2 = x.reshape(-1, k)
    return fn(x2 if x2.stride(-1) == 1 else x2.contiguous()).reshape(*x.shape[:-1], n)


@opaque_op("int4_gemm_triton", _gemv_out)
def int4_gemm_op(
    x2: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor],
    bias: Optional[torch.Tensor], group_size: int, n: int, k: int,
) -> torch.Tensor:
    from .triton_gemm import int4_gemm

    return int4_gemm(x2, qdata, scale, zero, bias, group_size, n, k)


@opaque_op("int4_dequantize_triton", lambda qdata, scale, zero, group_size, n, k, like:
           like.new_empty((n, k)))
def int4_dequantize_op(qdata: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor], group_size: int,
                       n: int, k: int, like: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] in the dtype of `like` (the activation)."""
    from .triton_gemm import int4_dequantize

    return int4_dequantize(qdata, scale, zero, group_size, n, k, like.dtype)


@register_kernel("linear", "Int4Tensor", "triton_int4_gemm", backend="triton", priority=5, device="cuda",
                 needs=(TRITON,), when=lambda x, w: _gemm_rows(x, w) and _contiguous(w.qdata, w.scale, w.zero))
def int4_triton_gemm_linear(x, w, bias):
    n, k = w.shape
    x = simulate_input_quantization_fused(w, x)
    return _linear_2d(x, n, k, lambda x2: int4_gemm_op(x2, w.qdata, w.scale, w.zero, bias, w.block_size[-1], n, k))


@register_kernel("linear", "Int4Tensor", "triton_int4_dequantize_mm", backend="triton", priority=4, device="cuda",
                 needs=(TRITON,), when=lambda x, w: _dequantize_rows(x, w) and _contiguous(w.qdata, w.scale, w.zero))
def int4_triton_dequantize_linear(x, w, bias):
    """Large M: the weight dequantized once per call, in one pass, then cuBLAS."""
    n, k = w.shape
    x = simulate_input_quantization_fused(w, x)
    weight = int4_dequantize_op(w.qdata, w.scale, w.zero, w.block_size[-1], n, k, x)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


@opaque_op("int4dq_gemm_triton", lambda x2, qdata, gparams, rparams, tparams, lut, bias, group_size, n, k:
           x2.new_empty(x2.shape[0], n))
def int4dq_gemm_op(
    x2: torch.Tensor, qdata: torch.Tensor, gparams: torch.Tensor, rparams: torch.Tensor, tparams: torch.Tensor,
    lut: torch.Tensor, bias: Optional[torch.Tensor], group_size: int, n: int, k: int,
) -> torch.Tensor:
    from .triton_gemm import int4dq_gemm

    return int4dq_gemm(x2, qdata, gparams, rparams, tparams, lut, bias, group_size, n, k)


@opaque_op("int4dq_dequantize_triton", lambda qdata, gparams, rparams, tparams, lut, group_size, n, k, like:
           like.new_empty((n, k)))
def int4dq_dequantize_op(qdata: torch.Tensor, gparams: torch.Tensor, rparams: torch.Tensor, tparams: torch.Tensor,
                         lut: torch.Tensor, group_size: int, n: int, k: int, like: torch.Tensor) -> torch.Tensor:
    from .triton_gemm import int4dq_dequantize

    return int4dq_dequantize(qdata, gparams, rparams, tparams, lut, group_size, n, k, like.dtype)


def _int4dq_fields(w):
    return w.qdata, w.gparams, w.rparams, w.tparams


@register_kernel("linear", "Int4DQTensor", "triton_int4dq_gemm", backend="triton", priority=5, device="cuda",
                 needs=(TRITON,), when=lambda x, w: _gemm_rows(x, w) and _contiguous(*_int4dq_fields(w)))
def int4dq_triton_gemm_linear(x, w, bias):
    n, k = w.shape
    lut = _lut_on(x.device)
    return _linear_2d(x, n, k, lambda x2: int4dq_gemm_op(x2, *_int4dq_fields(w), lut, bias, w.block_size[-1], n, k))


@register_kernel("linear", "Int4DQTensor", "triton_int4dq_dequantize_mm", backend="triton", priority=4,
                 device="cuda", needs=(TRITON,),
                 when=lambda x, w: _dequantize_rows(x, w) and _contiguous(*_int4dq_fields(w)))
def int4dq_triton_dequantize_linear(x, w, bias):
    """Large M: the weight dequantized once per call, in one pass, then cuBLAS."""
    n, k = w.shape
    weight = int4dq_dequantize_op(*_int4dq_fields(w), _lut_on(x.device), w.block_size[-1], n, k, x)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


# ---------------------------------------------------------------------- int8 / float8 weight-only
@opaque_op("scaled_gemv_triton", lambda x2, qdata, scale, group_size, bias: x2.new_empty(x2.shape[0], qdata.shape[0]))
def scaled_gemv_op(x2: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, group_size: int,
                   bias: Optional[torch.Tensor]) -> torch.Tensor:
    from .triton_jit import scaled_gemv

    return scaled_gemv(x2, qdata, scale, group_size, bias)


def _scaled_gemv_applies(x, w) -> bool:
    """Weight-only codes read in place: few rows, codes with unit stride along K (not a
    transposed weight), one scale per row, per group along K or per tensor."""
    n, k = w.qdata.shape[0], x.shape[-1]
    block = tuple(w.block_size)
    return (w.act_quant is None and _gemv_rows(x, w) and w.qdata.stride(-1) == 1
            and (block[0] == 1 or block == (n, k)) and w.scale.stride(-1) == 1)


def _scaled_triton_linear(x, w, bias):
    n, k = w.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = scaled_gemv_op(x2, w.qdata, w.scale, w.block_size[-1], bias)
    return y.reshape(*x.shape[:-1], n)


for _type, _name in (("Int8Tensor", "triton_int8_gemv"), ("Float8Tensor", "triton_fp8_gemv")):
    register_kernel("linear", _type, _name, backend="triton", priority=5, device="cuda", needs=(TRITON,),
                    when=_scaled_gemv_applies)(_scaled_triton_linear)


# ---------------------------------------------------------------------- activation quantizer
def _quantize_rows_out(x2):
    return x2.new_empty(x2.shape, dtype=torch.int8), x2.new_empty((x2.shape[0], 1), dtype=torch.float32)


@opaque_op("quantize_rows_int8_triton", _quantize_rows_out)
def quantize_rows_int8_op(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from .triton_jit import quantize_rows_int8

    return quantize_rows_int8(x2)


def quantize_int8_per_token_fused(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """common.quantize_int8_per_token in one Triton kernel where triton runs on x2's GPU (bit for
    bit the same codes and scales), else that function."""
    if x2.device.type == "cuda" and capable((TRITON,), x2.device):
        return quantize_rows_int8_op(x2 if x2.stride(-1) == 1 else x2.contiguous())
    return quantize_int8_per_token(x2)


# ---------------------------------------------------------------------- float8 (e4m3) activations
@opaque_op("quantize_rows_fp8_triton", lambda x2: (x2.new_empty(x2.shape, dtype=torch.float8_e4m3fn),
                                                   x2.new_empty((x2.shape[0], 1), dtype=torch.float32)))
def quantize_rows_fp8_op(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from .triton_jit import quantize_rows_fp8

    return quantize_rows_fp8(x2)


@opaque_op("fake_quantize_rows_fp8_triton", lambda x2: x2.new_empty(x2.shape))
def fake_quantize_rows_fp8_op(x2: torch.Tensor) -> torch.Tensor:
    from .triton_jit import fake_quantize_rows_fp8

    return fake_quantize_rows_fp8(x2)


def _e4m3_rows_fused(w, x: torch.Tensor) -> bool:
    """Activations quantized to e4m3 with one scale per row (Float8Tensor "per_row", Int4Tensor
    "per_token" with a float8_e4m3fn act_dtype: fp8-dyn and fp8-int4), on a GPU where triton runs."""
    if w.act_quant not in ("per_row", "per_token") or (w.act_dtype or w.qdata.dtype) != torch.float8_e4m3fn:
        return False
    return x.device.type == "cuda" and x.numel() > 0 and x.dtype in FLOATS and capable((TRITON,), x.device)


def quantize_input_fused(w, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w.quantize_input(x2) (2-D), in one Triton kernel for e4m3 per-row activations where triton
    runs (bit for bit the same codes and scales; torch takes about ten kernels)."""
    if _e4m3_rows_fused(w, x2):
        return quantize_rows_fp8_op(x2 if x2.stride(-1) == 1 else x2.contiguous())
    return w.quantize_input(x2)


def simulate_input_quantization_fused(w, x: torch.Tensor) -> torch.Tensor:
    """w.simulate_input_quantization(x), in one Triton kernel for e4m3 per-row activations where
    triton runs (bit for bit the same values)."""
    if _e4m3_rows_fused(w, x):
        x2 = x.reshape(-1, x.shape[-1])
        return fake_quantize_rows_fp8_op(x2 if x2.stride(-1) == 1 else x2.contiguous()).reshape(x.shape)
    return w.simulate_input_quantization(x)


# ---------------------------------------------------------------------- MX (MXFP4, MXFP8) and NVFP4
@opaque_op("mx_gemv_triton", lambda x2, qdata, scale, per_tensor_scale, bias, fmt, n, k:
           x2.new_empty(x2.shape[0], n))
def mx_gemv_op(x2: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, per_tensor_scale: Optional[torch.Tensor],
               bias: Optional[torch.Tensor], fmt: int, n: int, k: int) -> torch.Tensor:
    from .triton_mx import mx_gemv

    return mx_gemv(x2, qdata, scale, per_tensor_scale, bias, fmt, n, k)


@opaque_op("mx_dequantize_triton", lambda qdata, scale, per_tensor_scale, fmt, n, k, like: like.new_empty((n, k)))
def mx_dequantize_op(qdata: torch.Tensor, scale: torch.Tensor, per_tensor_scale: Optional[torch.Tensor], fmt: int,
                     n: int, k: int, like: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] in the dtype of `like` (the activation)."""
    from .triton_mx import mx_dequantize

    return mx_dequantize(qdata, scale, per_tensor_scale, fmt, n, k, like.dtype)


# triton_mx's FORMAT by element dtype (MXFP4, MX e4m3, MX e5m2); NVFP4 is 3.
_MX_FORMATS = {torch.float4_e2m1fn_x2: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
_NVFP4_FORMAT = 3


def _mx_fields(w):
    """(qdata, scale, per_tensor_scale or None, FORMAT) of a 2-D MX or NVFP4 weight."""
    if hasattr(w, "per_tensor_scale"):
        return w.qdata, w.scale, w.per_tensor_scale, _NVFP4_FORMAT
    return w.qdata, w.scale, None, _MX_FORMATS[w.elem_dtype]


def _mx_2d(w) -> bool:
    """A 2-D MX / NVFP4 weight with contiguous fields (not a slice along K)."""
    return w.qdata.ndim == 2 and _contiguous(w.qdata, w.scale)


def mx_triton_linear(x, w, bias):
    """Activation-quantized weights (MX act_dtype, NVFP4 "nvfp4"): x quantized and decoded by
    the type's torch code first, as the reference does; the weight is decoded by the kernel."""
    n, k = w.shape
    x = w.simulate_input_quantization(x)
    qdata, scale, p, fmt = _mx_fields(w)
    return _linear_2d(x, n, k, lambda x2: mx_gemv_op(x2, qdata, scale, p, bias, fmt, n, k))


def mx_triton_dequantize_linear(x, w, bias):
    """Large M (or float32 past the GEMV): the weight dequantized once per call, then cuBLAS."""
    n, k = w.shape
    x = w.simulate_input_quantization(x)
    qdata, scale, p, fmt = _mx_fields(w)
    weight = mx_dequantize_op(qdata, scale, p, fmt, n, k, x)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


for _type, _name in (("MXTensor", "mx"), ("NVFP4Tensor", "nvfp4")):
    register_kernel("linear", _type, f"triton_{_name}_gemv", backend="triton", priority=5, device="cuda",
                    needs=(TRITON,), when=lambda x, w: _gemv_rows(x, w) and _mx_2d(w))(mx_triton_linear)
    register_kernel("linear", _type, f"triton_{_name}_dequantize_mm", backend="triton", priority=4, device="cuda",
                    needs=(TRITON,), when=lambda x, w: _dequantize_rows(x, w) and _mx_2d(w))(
                        mx_triton_dequantize_linear)
